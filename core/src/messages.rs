//! Payloads on the region's NATS. Both carry content and never leave their region.

use serde::{Deserialize, Serialize};

use crate::findings::{Finding, Quarantined};
use crate::job::{JobRecord, ReviewDepth};
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
    /// The pull request number (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pull_request: u32,
}

/// A review on `REVIEWS_<R>_<LANE>`. It is stored before its job record, and carries
/// everything the record holds, so a job whose ingress died between the two writes is
/// still served: the extractor creates the record from the message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReviewMessage {
    pub job_id: String,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    pub schema_version: String,
    pub review_depth: ReviewDepth,
    pub metadata: ReviewMetadata,
    /// The diff when it is UTF-8 (empty when `diff_bytes` holds it).
    pub diff: String,
    /// The diff exactly as the caller sent it when it is not UTF-8 (base64 in JSON).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "base64_bytes")]
    pub diff_bytes: Option<Vec<u8>>,
    pub submitted_at_ms: u64,
    /// sha256 of the diff's bytes.
    #[serde(default)]
    pub input_digest: String,
    /// sha256 over everything the request asked for (see `JobRecord::request_digest`).
    #[serde(default)]
    pub request_digest: String,
    /// The job's deadline (see `JobRecord::deadline_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// The dead-lettered job this one replays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_of: Option<String>,
    /// The sweep this review is an item of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep_id: Option<String>,
    /// The review admitted at depth `changed_hunks` that this full-depth one deepens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deeper_of: Option<String>,
    /// The full-depth review that follows this degraded one (tenant option `deeper_pass`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deeper_review: Option<String>,
}

impl ReviewMessage {
    /// The diff as text: as sent when it is UTF-8, else decoded with replacement
    /// characters. What the model sees.
    pub fn diff_text(&self) -> std::borrow::Cow<'_, str> {
        match &self.diff_bytes {
            Some(b) => String::from_utf8_lossy(b),
            None => std::borrow::Cow::Borrowed(&self.diff),
        }
    }

    /// The diff parsed: its lines as [`ReviewMessage::diff_text`] has them, its file
    /// names exact (`diff::path`). What findings are validated against.
    pub fn parse_diff(&self) -> Result<crate::diff::Diff, crate::diff::DiffError> {
        match &self.diff_bytes {
            Some(b) => crate::diff::parse_bytes(b),
            None => crate::diff::parse(&self.diff),
        }
    }

    /// The job record this message stands for, as the ingress creates it.
    pub fn record(&self) -> JobRecord {
        let mut rec = JobRecord::waiting(crate::job::NewJob {
            job_id: self.job_id.clone(),
            tenant: self.tenant.clone(),
            region: self.region,
            lane: self.lane,
            schema_version: self.schema_version.clone(),
            input_digest: self.input_digest.clone(),
            request_digest: self.request_digest.clone(),
            review_depth: self.review_depth,
            created_at_ms: self.submitted_at_ms,
        });
        rec.deadline_ms = self.deadline_ms;
        rec.replay_of = self.replay_of.clone();
        rec.sweep_id = self.sweep_id.clone();
        rec.deeper_of = self.deeper_of.clone();
        rec.deeper_review = self.deeper_review.clone();
        rec
    }
}

/// A validated result on `FINDINGS_<R>`: the findings to deliver and the quarantined
/// ones, which stay in the region and are never delivered. One per lease generation;
/// only the generation the job record validated is ever delivered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FindingsMessage {
    pub job_id: String,
    #[serde(default)]
    pub generation: u32,
    /// Set on the message when the result was too large for one message: the name of
    /// the object in the region's `FINDINGS_<R>` object store that holds it whole (then
    /// `findings` and `quarantined` are empty here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_as: Option<String>,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    pub schema_version: String,
    pub review_depth: ReviewDepth,
    pub metadata: ReviewMetadata,
    pub findings: Vec<Finding>,
    pub quarantined: Vec<Quarantined>,
    pub submitted_at_ms: u64,
    /// The part of a split review this result answers (on `PARTS_<R>`; never delivered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<u32>,
    /// Findings over the cap, left out of a split review's merged result.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub findings_dropped: u32,
    /// See `ReviewMessage::deeper_of`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deeper_of: Option<String>,
    /// See `ReviewMessage::deeper_review`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deeper_review: Option<String>,
}

impl FindingsMessage {
    /// The validated result of `review` for lease generation `generation` (no part);
    /// each quarantined item's raw text cut to `quarantine_raw_max`.
    pub fn of(
        review: &ReviewMessage,
        generation: u32,
        v: &crate::findings::Validated,
        quarantine_raw_max: usize,
    ) -> FindingsMessage {
        FindingsMessage {
            job_id: review.job_id.clone(),
            generation,
            stored_as: None,
            tenant: review.tenant.clone(),
            region: review.region,
            lane: review.lane,
            schema_version: review.schema_version.clone(),
            review_depth: review.review_depth,
            metadata: review.metadata.clone(),
            findings: v.findings.clone(),
            quarantined: v.quarantined.iter().cloned().map(|q| q.bounded(quarantine_raw_max)).collect(),
            submitted_at_ms: review.submitted_at_ms,
            part: None,
            findings_dropped: 0,
            deeper_of: review.deeper_of.clone(),
            deeper_review: review.deeper_review.clone(),
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A dead letter's reference on `DEADLETTER_<R>`: what an operator needs to decide and
/// replay, without content. The content (the review with its diff) sits on
/// `DEADLETTER_CONTENT_<R>` under `content_subject` for a shorter retention. A
/// cancelled job has no dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub job_id: String,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    /// The terminal reason (`cancelled`, `rate_limit_budget_exhausted`, ...).
    pub reason: String,
    pub attempts: crate::job::Attempts,
    pub schema_version: String,
    /// sha256 of the diff's bytes.
    pub input_digest: String,
    pub request_digest: String,
    pub submitted_at_ms: u64,
    pub dead_at_ms: u64,
    /// Where the content is kept (on `DEADLETTER_CONTENT_<R>`, until its retention ends).
    pub content_subject: String,
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
    /// Findings left out because the merged result of a split review was over the cap.
    #[serde(default)]
    pub findings_dropped: u32,
    /// This full-depth review deepens that one, admitted at `changed_hunks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deeper_of: Option<String>,
    /// A full-depth review of the same diff follows this one under that id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deeper_review: Option<String>,
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
            findings_dropped: m.findings_dropped,
            deeper_of: m.deeper_of.clone(),
            deeper_review: m.deeper_review.clone(),
        }
    }
}

mod base64_bytes {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_str(&STANDARD.encode(b)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        let v: Option<String> = Option::deserialize(d)?;
        v.map(|t| STANDARD.decode(t).map_err(serde::de::Error::custom)).transpose()
    }
}
