//! The job record (metadata only, never content) and its state machine.
//!
//! `transition` is pure: the store reads a record with its KV revision, applies an
//! event here, and writes the result with a compare-and-set on that revision. A
//! conflict means someone else moved the job; the caller re-reads and decides again.

use serde::{Deserialize, Serialize};

use crate::region::{Lane, Region};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Accepted,
    Waiting,
    Running,
    RetryScheduled,
    Validated,
    Published,
    Terminal,
}

impl JobState {
    pub fn is_final(self) -> bool {
        matches!(self, JobState::Published | JobState::Terminal)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Accepted => "accepted",
            JobState::Waiting => "waiting",
            JobState::Running => "running",
            JobState::RetryScheduled => "retry_scheduled",
            JobState::Validated => "validated",
            JobState::Published => "published",
            JobState::Terminal => "terminal",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalReason {
    RateLimitBudgetExhausted,
    TransientBudgetExhausted,
    InvalidOutput,
    UpstreamRejected,
    Cancelled,
    DeadlineExceeded,
    /// The provider account is out of quota (429 `insufficient_quota`): money, not load.
    InsufficientQuota,
    /// The message on the lane could not be read back (should never happen: the ingress
    /// validated it).
    InvalidInput,
    /// The tenant's sink refused the delivery permanently (4xx other than 408/429).
    DeliveryRejected,
    /// The tenant's sink kept failing transiently until the delivery budget ran out.
    DeliveryBudgetExhausted,
}

impl TerminalReason {
    pub fn as_str(self) -> &'static str {
        match self {
            TerminalReason::RateLimitBudgetExhausted => "rate_limit_budget_exhausted",
            TerminalReason::TransientBudgetExhausted => "transient_budget_exhausted",
            TerminalReason::InvalidOutput => "invalid_output",
            TerminalReason::UpstreamRejected => "upstream_rejected",
            TerminalReason::Cancelled => "cancelled",
            TerminalReason::DeadlineExceeded => "deadline_exceeded",
            TerminalReason::InsufficientQuota => "insufficient_quota",
            TerminalReason::InvalidInput => "invalid_input",
            TerminalReason::DeliveryRejected => "delivery_rejected",
            TerminalReason::DeliveryBudgetExhausted => "delivery_budget_exhausted",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReviewDepth {
    #[default]
    Full,
    ChangedHunks,
}

impl ReviewDepth {
    pub fn as_str(self) -> &'static str {
        match self {
            ReviewDepth::Full => "full",
            ReviewDepth::ChangedHunks => "changed_hunks",
        }
    }
}

/// Which retry budget an attempt spends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    Congestion,
    Transient,
    Schema,
}

impl Budget {
    pub fn as_str(self) -> &'static str {
        match self {
            Budget::Congestion => "congestion",
            Budget::Transient => "transient",
            Budget::Schema => "schema",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Attempts {
    pub congestion: u32,
    pub transient: u32,
    pub schema: u32,
    /// Leases taken (provider calls started or about to start).
    pub leases: u32,
}

impl Attempts {
    pub fn get(&self, b: Budget) -> u32 {
        match b {
            Budget::Congestion => self.congestion,
            Budget::Transient => self.transient,
            Budget::Schema => self.schema,
        }
    }

    fn bump(&mut self, b: Budget) {
        match b {
            Budget::Congestion => self.congestion += 1,
            Budget::Transient => self.transient += 1,
            Budget::Schema => self.schema += 1,
        }
    }
}

/// One job, as stored in KV `JOBS_<R>` under its job id. Metadata only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: String,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    pub state: JobState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<TerminalReason>,
    #[serde(default)]
    pub attempts: Attempts,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_eligible_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_expires_at_ms: Option<u64>,
    /// Status class of the last upstream answer: `2xx`, `4xx`, `429`, `5xx`, `timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_upstream_status: Option<String>,
    pub schema_version: String,
    /// sha256 of the diff: for caching and support, not reversible to content.
    pub input_digest: String,
    /// sha256 over everything the request asked for; tells a retry from a reuse.
    pub request_digest: String,
    pub review_depth: ReviewDepth,
    #[serde(default)]
    pub findings_count: u32,
    #[serde(default)]
    pub quarantined_count: u32,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

/// What happened to a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The review message is durably on its lane.
    Enqueued,
    /// A worker took the message; its lease ends at the given time.
    Leased { lease_expires_at_ms: u64 },
    /// The attempt failed in a retryable way; the message was handed back with a delay.
    RetryScheduled { budget: Budget, next_eligible_at_ms: u64, upstream_status: Option<String> },
    /// The output passed validation and the findings are on `FINDINGS_<R>`.
    Validated { findings: u32, quarantined: u32 },
    /// The findings were delivered.
    Published,
    /// The job ends without a result.
    Terminate { reason: TerminalReason, upstream_status: Option<String> },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("job is already final ({})", .0.as_str())]
    AlreadyFinal(JobState),
    #[error("event not allowed in state {}", .0.as_str())]
    NotAllowed(JobState),
}

impl JobRecord {
    #[allow(clippy::too_many_arguments)]
    pub fn accepted(
        job_id: String,
        tenant: String,
        region: Region,
        lane: Lane,
        schema_version: String,
        input_digest: String,
        request_digest: String,
        review_depth: ReviewDepth,
        now_ms: u64,
    ) -> Self {
        JobRecord {
            job_id,
            tenant,
            region,
            lane,
            state: JobState::Accepted,
            reason: None,
            attempts: Attempts::default(),
            next_eligible_at_ms: None,
            lease_expires_at_ms: None,
            last_upstream_status: None,
            schema_version,
            input_digest,
            request_digest,
            review_depth,
            findings_count: 0,
            quarantined_count: 0,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
        }
    }
}

/// The state machine:
/// `accepted -> waiting -> running -> (retry_scheduled -> running)* -> validated -> published`,
/// and `terminal(reason)` from any non-final state.
///
/// `running -> running` is a new lease after the previous holder lost its lease
/// (JetStream redelivers only after the ack wait ran out). `accepted -> running` happens
/// when a worker is quicker than the ingress's own `accepted -> waiting` write.
pub fn transition(rec: &JobRecord, event: &Event, now_ms: u64) -> Result<JobRecord, TransitionError> {
    use JobState::*;
    if rec.state.is_final() {
        return Err(TransitionError::AlreadyFinal(rec.state));
    }
    let mut next = rec.clone();
    next.updated_at_ms = now_ms;
    match (rec.state, event) {
        (Accepted, Event::Enqueued) => next.state = Waiting,
        (Accepted | Waiting | RetryScheduled | Running, Event::Leased { lease_expires_at_ms }) => {
            next.state = Running;
            next.lease_expires_at_ms = Some(*lease_expires_at_ms);
            next.next_eligible_at_ms = None;
            next.attempts.leases += 1;
        }
        (Running, Event::RetryScheduled { budget, next_eligible_at_ms, upstream_status }) => {
            next.state = RetryScheduled;
            next.attempts.bump(*budget);
            next.next_eligible_at_ms = Some(*next_eligible_at_ms);
            next.lease_expires_at_ms = None;
            if upstream_status.is_some() {
                next.last_upstream_status = upstream_status.clone();
            }
        }
        (Running, Event::Validated { findings, quarantined }) => {
            next.state = Validated;
            next.findings_count = *findings;
            next.quarantined_count = *quarantined;
            next.lease_expires_at_ms = None;
            next.last_upstream_status = Some("2xx".into());
        }
        (Validated, Event::Published) => next.state = Published,
        (_, Event::Terminate { reason, upstream_status }) => {
            next.state = Terminal;
            next.reason = Some(*reason);
            next.lease_expires_at_ms = None;
            next.next_eligible_at_ms = None;
            if upstream_status.is_some() {
                next.last_upstream_status = upstream_status.clone();
            }
        }
        (state, _) => return Err(TransitionError::NotAllowed(state)),
    }
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> JobRecord {
        JobRecord::accepted(
            "us_ab".into(),
            "t1".into(),
            Region::Us,
            Lane::Interactive,
            "findings.v1".into(),
            "d".into(),
            "r".into(),
            ReviewDepth::Full,
            1,
        )
    }

    fn apply(r: &JobRecord, e: Event) -> JobRecord {
        transition(r, &e, 100).unwrap()
    }

    #[test]
    fn happy_path() {
        let r = apply(&rec(), Event::Enqueued);
        assert_eq!(r.state, JobState::Waiting);
        let r = apply(&r, Event::Leased { lease_expires_at_ms: 30_100 });
        assert_eq!(r.state, JobState::Running);
        assert_eq!(r.lease_expires_at_ms, Some(30_100));
        assert_eq!(r.attempts.leases, 1);
        let r = apply(&r, Event::Validated { findings: 3, quarantined: 2 });
        assert_eq!((r.state, r.findings_count, r.quarantined_count), (JobState::Validated, 3, 2));
        assert_eq!(r.lease_expires_at_ms, None);
        let r = apply(&r, Event::Published);
        assert_eq!(r.state, JobState::Published);
        assert_eq!(r.updated_at_ms, 100);
        assert_eq!(r.created_at_ms, 1);
    }

    #[test]
    fn retries_count_per_budget() {
        let mut r = apply(&apply(&rec(), Event::Enqueued), Event::Leased { lease_expires_at_ms: 5 });
        for (budget, n) in [(Budget::Congestion, 2), (Budget::Transient, 1), (Budget::Schema, 1)] {
            for _ in 0..n {
                r = apply(
                    &r,
                    Event::RetryScheduled { budget, next_eligible_at_ms: 9, upstream_status: Some("429".into()) },
                );
                assert_eq!(r.state, JobState::RetryScheduled);
                assert_eq!(r.next_eligible_at_ms, Some(9));
                r = apply(&r, Event::Leased { lease_expires_at_ms: 5 });
                assert_eq!(r.next_eligible_at_ms, None);
            }
        }
        assert_eq!((r.attempts.congestion, r.attempts.transient, r.attempts.schema), (2, 1, 1));
        assert_eq!(r.attempts.leases, 5);
    }

    #[test]
    fn worker_may_lease_before_ingress_marks_waiting_and_re_lease_after_lost_lease() {
        let r = apply(&rec(), Event::Leased { lease_expires_at_ms: 5 });
        assert_eq!(r.state, JobState::Running);
        let r = apply(&r, Event::Leased { lease_expires_at_ms: 50 });
        assert_eq!((r.state, r.lease_expires_at_ms, r.attempts.leases), (JobState::Running, Some(50), 2));
        // The ingress' late `Enqueued` is refused and ignored by it.
        assert_eq!(transition(&r, &Event::Enqueued, 1), Err(TransitionError::NotAllowed(JobState::Running)));
    }

    #[test]
    fn terminal_from_every_non_final_state_and_nothing_after_final() {
        let waiting = apply(&rec(), Event::Enqueued);
        let running = apply(&waiting, Event::Leased { lease_expires_at_ms: 5 });
        let validated = apply(&running, Event::Validated { findings: 0, quarantined: 0 });
        for r in [rec(), waiting, running.clone(), validated.clone()] {
            let t = apply(&r, Event::Terminate { reason: TerminalReason::Cancelled, upstream_status: None });
            assert_eq!((t.state, t.reason), (JobState::Terminal, Some(TerminalReason::Cancelled)));
            for e in [Event::Published, Event::Enqueued, Event::Leased { lease_expires_at_ms: 1 }] {
                assert_eq!(transition(&t, &e, 1), Err(TransitionError::AlreadyFinal(JobState::Terminal)));
            }
        }
        let published = apply(&validated, Event::Published);
        assert_eq!(
            transition(&published, &Event::Terminate { reason: TerminalReason::Cancelled, upstream_status: None }, 1),
            Err(TransitionError::AlreadyFinal(JobState::Published))
        );
    }

    #[test]
    fn out_of_order_events_are_refused() {
        let r = rec();
        assert!(matches!(transition(&r, &Event::Published, 1), Err(TransitionError::NotAllowed(_))));
        assert!(matches!(
            transition(&r, &Event::Validated { findings: 1, quarantined: 0 }, 1),
            Err(TransitionError::NotAllowed(_))
        ));
        let running = apply(&r, Event::Leased { lease_expires_at_ms: 5 });
        assert!(matches!(transition(&running, &Event::Published, 1), Err(TransitionError::NotAllowed(_))));
    }

    #[test]
    fn record_serializes_without_content_fields() {
        let json = serde_json::to_value(rec()).unwrap();
        let keys: Vec<_> = json.as_object().unwrap().keys().cloned().collect();
        for k in &keys {
            assert!(!["diff", "repository", "path", "findings", "evidence"].contains(&k.as_str()), "{k}");
        }
    }
}
