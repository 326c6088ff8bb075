//! reviewlane's gRPC API: the generated types (`proto`), the codec that makes a
//! request that does not decode the caller's error (`codec`), the closed set of
//! `ErrorInfo` reasons, and the conversions between the job model and the API types.
//! `reviewctl` and the ingress both build on it; it has no NATS and no store.

pub mod codec;

/// Generated gRPC types and the descriptor set for reflection.
pub mod proto {
    #![allow(clippy::all)]
    tonic::include_proto!("reviewlane.v1");
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/reviewlane_descriptor.bin"));
}

use reviewlane_core::findings::{Finding, Side};
use reviewlane_core::job::{JobRecord, JobState, ReviewDepth, TerminalReason};
use reviewlane_core::region::Lane;

/// `google.rpc.ErrorInfo.domain` of every error reviewlane returns.
pub const ERROR_DOMAIN: &str = "reviewlane";

/// `google.rpc.ErrorInfo.reason` of every error reviewlane returns: the closed set a
/// caller branches on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    ApiKeyMissing,
    ApiKeyMalformed,
    ApiKeyInvalid,
    InvalidField,
    MalformedRequest,
    RequestTooLarge,
    ReviewNotFound,
    IdempotencyKeyReused,
    LaneFull,
    LaneOverWindow,
    TooManyWatches,
    RegionStoreUnavailable,
    RegionStoreFull,
    ShuttingDown,
    ContentExpired,
    OperatorRoleRequired,
    SweepNotFound,
    SweepNotOpen,
    ProviderBatchUnavailable,
    Internal,
}

impl Reason {
    pub const ALL: [Reason; 20] = [
        Reason::ApiKeyMissing,
        Reason::ApiKeyMalformed,
        Reason::ApiKeyInvalid,
        Reason::InvalidField,
        Reason::MalformedRequest,
        Reason::RequestTooLarge,
        Reason::ReviewNotFound,
        Reason::IdempotencyKeyReused,
        Reason::LaneFull,
        Reason::LaneOverWindow,
        Reason::TooManyWatches,
        Reason::RegionStoreUnavailable,
        Reason::RegionStoreFull,
        Reason::ShuttingDown,
        Reason::ContentExpired,
        Reason::OperatorRoleRequired,
        Reason::SweepNotFound,
        Reason::SweepNotOpen,
        Reason::ProviderBatchUnavailable,
        Reason::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::ApiKeyMissing => "API_KEY_MISSING",
            Reason::ApiKeyMalformed => "API_KEY_MALFORMED",
            Reason::ApiKeyInvalid => "API_KEY_INVALID",
            Reason::InvalidField => "INVALID_FIELD",
            Reason::MalformedRequest => "MALFORMED_REQUEST",
            Reason::RequestTooLarge => "REQUEST_TOO_LARGE",
            Reason::ReviewNotFound => "REVIEW_NOT_FOUND",
            Reason::IdempotencyKeyReused => "IDEMPOTENCY_KEY_REUSED",
            Reason::LaneFull => "LANE_FULL",
            Reason::LaneOverWindow => "LANE_OVER_WINDOW",
            Reason::TooManyWatches => "TOO_MANY_WATCHES",
            Reason::RegionStoreUnavailable => "REGION_STORE_UNAVAILABLE",
            Reason::RegionStoreFull => "REGION_STORE_FULL",
            Reason::ShuttingDown => "SHUTTING_DOWN",
            Reason::ContentExpired => "CONTENT_EXPIRED",
            Reason::OperatorRoleRequired => "OPERATOR_ROLE_REQUIRED",
            Reason::SweepNotFound => "SWEEP_NOT_FOUND",
            Reason::SweepNotOpen => "SWEEP_NOT_OPEN",
            Reason::ProviderBatchUnavailable => "PROVIDER_BATCH_UNAVAILABLE",
            Reason::Internal => "INTERNAL",
        }
    }
}

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

/// The job model's state of an API state (`None`: unspecified).
pub fn state_from_proto(s: proto::JobState) -> Option<JobState> {
    Some(match s {
        proto::JobState::Unspecified => return None,
        proto::JobState::Accepted => JobState::Accepted,
        proto::JobState::Waiting => JobState::Waiting,
        proto::JobState::Running => JobState::Running,
        proto::JobState::RetryScheduled => JobState::RetryScheduled,
        proto::JobState::Validated => JobState::Validated,
        proto::JobState::Published => JobState::Published,
        proto::JobState::Terminal => JobState::Terminal,
    })
}

pub fn reason_to_proto(r: TerminalReason) -> proto::TerminalReason {
    use proto::TerminalReason as P;
    match r {
        TerminalReason::RateLimitBudgetExhausted => P::RateLimitBudgetExhausted,
        TerminalReason::TransientBudgetExhausted => P::TransientBudgetExhausted,
        TerminalReason::InvalidOutput => P::InvalidOutput,
        TerminalReason::UpstreamRejected => P::UpstreamRejected,
        TerminalReason::Cancelled => P::Cancelled,
        TerminalReason::DeadlineExceeded => P::DeadlineExceeded,
        TerminalReason::InsufficientQuota => P::InsufficientQuota,
        TerminalReason::InvalidInput => P::InvalidInput,
        TerminalReason::DeliveryRejected => P::DeliveryRejected,
        TerminalReason::DeliveryBudgetExhausted => P::DeliveryBudgetExhausted,
        TerminalReason::StoreBudgetExhausted => P::StoreBudgetExhausted,
        TerminalReason::Lost => P::Lost,
        TerminalReason::TooLarge => P::TooLarge,
        TerminalReason::BatchTokenLimit => P::BatchTokenLimit,
        TerminalReason::ContentFiltered => P::ContentFiltered,
    }
}

pub fn depth_to_proto(d: ReviewDepth) -> proto::ReviewDepth {
    match d {
        ReviewDepth::Full => proto::ReviewDepth::Full,
        ReviewDepth::ChangedHunks => proto::ReviewDepth::ChangedHunks,
    }
}

pub fn timestamp(ms: u64) -> prost_types::Timestamp {
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
        fingerprint: f.fingerprint.clone().unwrap_or_else(|| reviewlane_core::findings::fingerprint(f)),
        severity_enum: severity_to_proto(&f.severity) as i32,
        category_enum: category_to_proto(&f.category) as i32,
    }
}

/// A finding of the API as the job model's (for review surfaces built from an API
/// answer: SARIF, rdjson).
pub fn finding_from_proto(f: &proto::Finding) -> Finding {
    let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
    Finding {
        path: f.path.clone(),
        line: f.line,
        end_line: f.end_line,
        side: match proto::Side::try_from(f.side) {
            Ok(proto::Side::Old) => Some(Side::Old),
            _ => None,
        },
        severity: f.severity.clone(),
        category: f.category.clone(),
        title: f.title.clone(),
        message: f.message.clone(),
        evidence: f.evidence.clone(),
        suggested_action: some(&f.suggested_action),
        suggested_replacement: f.suggested_replacement.clone(),
        confidence: some(&f.confidence),
        fingerprint: some(&f.fingerprint),
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
/// A deployment of a region's pool as its extractors last saw it.
pub fn deployment_to_proto(
    region: reviewlane_core::region::Region,
    s: reviewlane_core::pool_status::DeploymentStatus,
) -> proto::DeploymentStatus {
    proto::DeploymentStatus {
        region: region.as_str().to_string(),
        deployment: s.deployment,
        kind: s.kind,
        model: s.model,
        model_class: s.model_class,
        state: s.state,
        in_flight: s.in_flight,
        window: s.window,
        budgets: s
            .budgets
            .into_iter()
            .map(|b| proto::BudgetRoom { dimension: b.dimension, limit: b.limit, room: b.room })
            .collect(),
        paused_for: s
            .paused_for_ms
            .map(|ms| prost_types::Duration { seconds: (ms / 1000) as i64, nanos: ((ms % 1000) * 1_000_000) as i32 }),
        observed_at: Some(timestamp(s.observed_at_ms)),
    }
}

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
        terminal_reason_enum: rec.reason.map_or(proto::TerminalReason::Unspecified, reason_to_proto) as i32,
        replay_of: rec.replay_of.clone().unwrap_or_default(),
        sweep_id: rec.sweep_id.clone().unwrap_or_default(),
        deeper_of: rec.deeper_of.clone().unwrap_or_default(),
        deeper_review_id: rec.deeper_review.clone().unwrap_or_default(),
        model_class: rec.served_by.as_ref().map(|s| s.model_class.clone()).unwrap_or_default(),
        deployment: rec.served_by.as_ref().map(|s| s.deployment.clone()).unwrap_or_default(),
    }
}

pub fn sweep_mode_to_proto(m: reviewlane_core::sweep::SweepMode) -> proto::SweepMode {
    use reviewlane_core::sweep::SweepMode;
    match m {
        SweepMode::Auto => proto::SweepMode::Auto,
        SweepMode::ProviderBatch => proto::SweepMode::ProviderBatch,
        SweepMode::Lanes => proto::SweepMode::Lanes,
    }
}

pub fn sweep_mode_from_proto(v: i32) -> Option<reviewlane_core::sweep::SweepMode> {
    use reviewlane_core::sweep::SweepMode;
    match proto::SweepMode::try_from(v).ok()? {
        proto::SweepMode::Unspecified | proto::SweepMode::Auto => Some(SweepMode::Auto),
        proto::SweepMode::ProviderBatch => Some(SweepMode::ProviderBatch),
        proto::SweepMode::Lanes => Some(SweepMode::Lanes),
    }
}

pub fn item_state_to_proto(s: reviewlane_core::sweep::ItemState) -> proto::SweepItemState {
    use reviewlane_core::sweep::ItemState;
    match s {
        ItemState::Queued => proto::SweepItemState::Queued,
        ItemState::Submitted => proto::SweepItemState::Submitted,
        ItemState::Running => proto::SweepItemState::Running,
        ItemState::Validated => proto::SweepItemState::Validated,
        ItemState::Published => proto::SweepItemState::Published,
        ItemState::Failed => proto::SweepItemState::Failed,
        ItemState::Cancelled => proto::SweepItemState::Cancelled,
    }
}

pub fn item_state_from_proto(v: i32) -> Option<reviewlane_core::sweep::ItemState> {
    reviewlane_core::sweep::ItemState::ALL.into_iter().find(|s| item_state_to_proto(*s) as i32 == v)
}

pub fn reason_from_proto(v: i32) -> Option<TerminalReason> {
    TerminalReason::ALL.into_iter().find(|r| reason_to_proto(*r) as i32 == v)
}

/// The API view of a sweep with its progress; `estimated_completion_ms` when it can
/// be told.
pub fn sweep(
    rec: &reviewlane_core::sweep::SweepRecord,
    counts: &reviewlane_core::sweep::SweepCounts,
    running: &reviewlane_core::sweep::RunningBatches,
    estimated_completion_ms: Option<u64>,
) -> proto::Sweep {
    use reviewlane_core::sweep::{ItemState, SweepState};
    let state = match rec.state {
        SweepState::Open => proto::SweepState::Open,
        SweepState::Sealed => proto::SweepState::Sealed,
        SweepState::Cancelled => proto::SweepState::Cancelled,
    };
    proto::Sweep {
        sweep_id: rec.sweep_id.clone(),
        state: state as i32,
        region: rec.region.as_str().to_string(),
        mode: sweep_mode_to_proto(rec.mode) as i32,
        runs_on: sweep_mode_to_proto(rec.runs_on) as i32,
        created_at: Some(timestamp(rec.created_at_ms)),
        sealed_at: rec.sealed_at_ms.map(timestamp),
        completion_window: Some(prost_types::Duration {
            seconds: (rec.completion_window_ms / 1000) as i64,
            nanos: ((rec.completion_window_ms % 1000) * 1_000_000) as i32,
        }),
        items_total: counts.total,
        items: ItemState::ALL
            .iter()
            .map(|s| proto::SweepItemCount { state: item_state_to_proto(*s) as i32, count: counts.of(*s) })
            .collect(),
        failed: counts
            .failed_by_reason
            .iter()
            .map(|(r, n)| proto::ReasonCount { reason: reason_to_proto(*r) as i32, count: *n })
            .collect(),
        percent_done: counts.percent_done(),
        tokens: Some(proto::Tokens { input: counts.tokens.input, output: counts.tokens.output }),
        estimated_cost_usd: counts.cost_micro_usd as f64 / 1e6,
        estimated_completion: estimated_completion_ms.map(timestamp),
        provider_batches: (rec.runs_on == reviewlane_core::sweep::SweepMode::ProviderBatch).then_some(
            proto::ProviderBatchProgress {
                batches_running: running.batches,
                lines: running.lines,
                lines_succeeded: running.lines_succeeded,
                lines_failed: running.lines_failed,
            },
        ),
    }
}

/// The API view of a dead letter's reference; `content_available` when its content is
/// still kept.
pub fn dead_letter(d: &reviewlane_core::messages::DeadLetter, content_available: bool) -> proto::DeadLetter {
    let reason = TerminalReason::parse(&d.reason);
    proto::DeadLetter {
        job_id: d.job_id.clone(),
        tenant: d.tenant.clone(),
        region: d.region.as_str().to_string(),
        lane: lane_to_proto(d.lane) as i32,
        terminal_reason: d.reason.clone(),
        terminal_reason_enum: reason.map_or(proto::TerminalReason::Unspecified, reason_to_proto) as i32,
        attempts: Some(proto::Attempts {
            congestion: d.attempts.congestion,
            transient: d.attempts.transient,
            schema: d.attempts.schema,
        }),
        schema_version: d.schema_version.clone(),
        submitted_at: Some(timestamp(d.submitted_at_ms)),
        dead_at: Some(timestamp(d.dead_at_ms)),
        content_available,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_reasons_are_distinct_upper_snake_names() {
        let names: std::collections::BTreeSet<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
        assert!(names.iter().all(|n| n.chars().all(|c| c.is_ascii_uppercase() || c == '_')), "{names:?}");
        // Every reason a caller can meet is in the errors table of docs/api.md.
        let doc = include_str!("../../docs/api.md");
        let errors = doc.split("\n## Errors\n").nth(1).expect("docs/api.md has an `## Errors` section");
        let errors = errors.split("\n## ").next().unwrap_or(errors);
        for n in names {
            assert!(errors.contains(&format!("`{n}`")), "docs/api.md's errors do not list {n}");
        }
    }

    #[test]
    fn every_terminal_reason_has_its_enum_with_the_same_name() {
        let all = reviewlane_core::job::TerminalReason::ALL;
        for r in all {
            assert_eq!(reviewlane_core::job::TerminalReason::parse(r.as_str()), Some(r));
            let name = reason_to_proto(r).as_str_name();
            assert_eq!(name, format!("TERMINAL_REASON_{}", r.as_str().to_uppercase()));
        }
        assert_eq!(severity_to_proto("critical"), proto::Severity::Critical);
        assert_eq!(category_to_proto("style"), proto::Category::Style);
        assert_eq!(severity_to_proto("catastrophic"), proto::Severity::Unspecified);
    }
}
