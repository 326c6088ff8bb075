//! Conversions between the job model and the gRPC API types.

use crate::findings::Finding;
use crate::job::{JobRecord, JobState, ReviewDepth};
use crate::proto;
use crate::region::Lane;

pub fn lane_from_proto(v: i32) -> Option<Lane> {
    match proto::Lane::try_from(v).ok()? {
        proto::Lane::Unspecified | proto::Lane::Interactive => Some(Lane::Interactive),
        proto::Lane::Batch => Some(Lane::Batch),
    }
}

pub fn lane_to_proto(l: Lane) -> proto::Lane {
    match l {
        Lane::Interactive => proto::Lane::Interactive,
        Lane::Batch => proto::Lane::Batch,
    }
}

pub fn state_to_proto(s: JobState) -> proto::JobState {
    match s {
        JobState::Accepted => proto::JobState::Accepted,
        JobState::Waiting => proto::JobState::Waiting,
        JobState::Running => proto::JobState::Running,
        JobState::RetryScheduled => proto::JobState::RetryScheduled,
        JobState::Validated => proto::JobState::Validated,
        JobState::Published => proto::JobState::Published,
        JobState::Terminal => proto::JobState::Terminal,
    }
}

pub fn depth_to_proto(d: ReviewDepth) -> proto::ReviewDepth {
    match d {
        ReviewDepth::Full => proto::ReviewDepth::Full,
        ReviewDepth::ChangedHunks => proto::ReviewDepth::ChangedHunks,
    }
}

fn timestamp(ms: u64) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds: (ms / 1000) as i64, nanos: ((ms % 1000) * 1_000_000) as i32 }
}

pub fn finding_to_proto(f: &Finding) -> proto::Finding {
    proto::Finding {
        path: f.path.clone(),
        line: f.line,
        severity: f.severity.clone(),
        category: f.category.clone(),
        title: f.title.clone(),
        message: f.message.clone(),
        evidence: f.evidence.clone(),
    }
}

/// The API view of a job; `findings` is given for a validated or published job.
pub fn review(rec: &JobRecord, findings: &[Finding]) -> proto::Review {
    proto::Review {
        job_id: rec.job_id.clone(),
        state: state_to_proto(rec.state) as i32,
        region: rec.region.as_str().to_string(),
        lane: lane_to_proto(rec.lane) as i32,
        review_depth: depth_to_proto(rec.review_depth) as i32,
        attempts: Some(proto::Attempts {
            congestion: rec.attempts.congestion,
            transient: rec.attempts.transient,
            schema: rec.attempts.schema,
        }),
        terminal_reason: rec.reason.map(|r| r.as_str().to_string()).unwrap_or_default(),
        schema_version: rec.schema_version.clone(),
        findings: findings.iter().map(finding_to_proto).collect(),
        quarantined_count: rec.quarantined_count,
        created_at: Some(timestamp(rec.created_at_ms)),
        updated_at: Some(timestamp(rec.updated_at_ms)),
        deadline: rec.deadline_ms.map(timestamp),
        tokens: Some(proto::Tokens { input: rec.tokens.input, output: rec.tokens.output }),
        estimated_cost_usd: rec.cost_micro_usd as f64 / 1e6,
    }
}
