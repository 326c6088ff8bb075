//! Payloads on the region's NATS. Both carry content and never leave their region.

use serde::{Deserialize, Serialize};

use crate::findings::{Finding, Quarantined};
use crate::job::ReviewDepth;
use crate::region::{Lane, Region};

/// Repository and revisions the review is about. Content: never logged.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReviewMetadata {
    #[serde(default)]
    pub repository: String,
    #[serde(default)]
    pub base_revision: String,
    #[serde(default)]
    pub head_revision: String,
}

/// A review on `REVIEWS_<R>_<LANE>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReviewMessage {
    pub job_id: String,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    pub schema_version: String,
    pub review_depth: ReviewDepth,
    pub metadata: ReviewMetadata,
    pub diff: String,
    pub submitted_at_ms: u64,
}

/// A validated result on `FINDINGS_<R>`: the findings to deliver and the quarantined
/// ones, which stay in the region and are never delivered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FindingsMessage {
    pub job_id: String,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    pub schema_version: String,
    pub review_depth: ReviewDepth,
    pub metadata: ReviewMetadata,
    pub findings: Vec<Finding>,
    pub quarantined: Vec<Quarantined>,
    pub submitted_at_ms: u64,
}

/// What the publisher sends to a tenant's sink (webhook body, file line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Delivery {
    pub job_id: String,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    pub schema_version: String,
    pub review_depth: ReviewDepth,
    pub metadata: ReviewMetadata,
    pub findings: Vec<Finding>,
    pub quarantined_count: u32,
}

impl Delivery {
    pub fn from_findings(m: &FindingsMessage) -> Self {
        Delivery {
            job_id: m.job_id.clone(),
            tenant: m.tenant.clone(),
            region: m.region,
            lane: m.lane,
            schema_version: m.schema_version.clone(),
            review_depth: m.review_depth,
            metadata: m.metadata.clone(),
            findings: m.findings.clone(),
            quarantined_count: m.quarantined.len() as u32,
        }
    }
}
