//! Conversions between the job model and the gRPC API types.

use crate::findings::{Finding, Side};
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

pub fn severity_to_proto(s: &str) -> proto::Severity {
    match s {
        "info" => proto::Severity::Info,
        "low" => proto::Severity::Low,
        "medium" => proto::Severity::Medium,
        "high" => proto::Severity::High,
        "critical" => proto::Severity::Critical,
        _ => proto::Severity::Unspecified,
    }
}

pub fn category_to_proto(c: &str) -> proto::Category {
    match c {
        "security" => proto::Category::Security,
        "correctness" => proto::Category::Correctness,
        "reliability" => proto::Category::Reliability,
        "performance" => proto::Category::Performance,
        "maintainability" => proto::Category::Maintainability,
        "style" => proto::Category::Style,
        _ => proto::Category::Unspecified,
    }
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
        end_line: f.end_line,
        side: match f.side() {
            Side::New => proto::Side::New,
            Side::Old => proto::Side::Old,
        } as i32,
        suggested_action: f.suggested_action.clone().unwrap_or_default(),
        suggested_replacement: f.suggested_replacement.clone(),
        confidence: f.confidence.clone().unwrap_or_default(),
        fingerprint: f.fingerprint.clone().unwrap_or_else(|| crate::findings::fingerprint(f)),
        severity_enum: severity_to_proto(&f.severity) as i32,
        category_enum: category_to_proto(&f.category) as i32,
    }
}

/// Parts of the review and how many are done (a review of one part: 1, and 1 once its
/// result is validated).
pub fn parts_progress(rec: &JobRecord) -> (u32, u32) {
    match &rec.parts {
        Some(p) => (p.total, p.done.len() as u32),
        None => (1, u32::from(matches!(rec.state, JobState::Validated | JobState::Published))),
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
        parts_total: parts_progress(rec).0,
        parts_done: parts_progress(rec).1,
        findings_dropped: rec.findings_dropped,
    }
}
