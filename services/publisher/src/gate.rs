//! The publisher's pure gate: what a findings message comes to before anything is
//! delivered — from the job record as read, the claim as taken (on the record), the
//! delivery budget and the time. `Open` goes on; anything else is settled as it says,
//! in the worker's one settlement site.

use std::time::Duration;

use reviewlane_core::job::{JobRecord, JobState, TerminalReason};
pub use reviewlane_shared::pull::Ack;

use crate::claim::Claimed;

/// How the publisher settled one findings message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Published,
    /// Already published: nothing delivered.
    Duplicate,
    /// The job ended (cancelled) before delivery: nothing delivered.
    Dropped,
    /// A result of a lease generation the job record did not validate (its holder lost
    /// the lease): never delivered.
    Stale,
    /// Another publisher's claim is live: handed back until it expires.
    Deferred(Duration),
    /// Delivery failed for now; the message comes back after the delay.
    RetryScheduled(Duration),
    Failed(TerminalReason),
    /// Handed back after an infrastructure error or because the job is not validated yet.
    Released,
}

/// How long a message whose job is not validated yet comes back after.
pub const NOT_READY_RETRY: Duration = Duration::from_secs(2);
/// Added when handing a message back until another publisher's claim expires.
pub const CLAIM_MARGIN: Duration = Duration::from_millis(250);

/// The message settled, and what it came to.
#[derive(Debug, Clone, PartialEq)]
pub struct Done {
    pub ack: Ack,
    pub outcome: Outcome,
}

impl Done {
    pub fn new(ack: Ack, outcome: Outcome) -> Done {
        Done { ack, outcome }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Gate {
    /// Nothing stops the delivery here.
    Open,
    /// Settled as it says, nothing delivered.
    Done(Done),
    /// The delivery ends for good, untried.
    Fail(TerminalReason),
}

/// The job record as read for the findings of lease generation `generation`.
pub fn by_record(rec: Option<&JobRecord>, generation: u32) -> Gate {
    let Some(rec) = rec else { return Gate::Done(Done::new(Ack::Term, Outcome::Dropped)) };
    // A result of a lease that was taken over is never delivered.
    if rec.generation() != generation {
        return Gate::Done(Done::new(Ack::Ack, Outcome::Stale));
    }
    match rec.state {
        JobState::Validated => Gate::Open,
        JobState::Published => Gate::Done(Done::new(Ack::Ack, Outcome::Duplicate)),
        JobState::Terminal => Gate::Done(Done::new(Ack::Ack, Outcome::Dropped)),
        _ => Gate::Done(Done::new(Ack::Nak(Some(NOT_READY_RETRY)), Outcome::Released)),
    }
}

/// The delivery claim as taken at `now_ms`, for the findings of lease generation
/// `generation`.
pub fn by_claim(claimed: &Claimed, generation: u32, now_ms: u64) -> Gate {
    match claimed {
        Claimed::Mine(_) => Gate::Open,
        Claimed::Busy { until_ms } => {
            let wait = Duration::from_millis(until_ms.saturating_sub(now_ms)) + CLAIM_MARGIN;
            Gate::Done(Done::new(Ack::Nak(Some(wait)), Outcome::Deferred(wait)))
        }
        // Published or ended meanwhile: as the record now says. A record that would
        // still let the delivery through was not claimed: handed back.
        Claimed::Moved(current) => match by_record(Some(current), generation) {
            Gate::Open => Gate::Done(Done::new(Ack::Nak(Some(NOT_READY_RETRY)), Outcome::Released)),
            settled => settled,
        },
    }
}

/// A claim of ours, attempt `attempt` of `allowed`, for a job due by `deadline_ms`.
/// Findings after the caller's deadline are of no use to it: not delivered.
pub fn by_budget(attempt: u32, allowed: u32, deadline_ms: Option<u64>, now_ms: u64) -> Gate {
    if attempt > allowed {
        Gate::Fail(TerminalReason::DeliveryBudgetExhausted)
    } else if deadline_ms.is_some_and(|d| now_ms >= d) {
        Gate::Fail(TerminalReason::DeadlineExceeded)
    } else {
        Gate::Open
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claim::Claim;

    fn rec(state: JobState) -> JobRecord {
        reviewlane_core::testing::record("us_1", state)
    }

    fn done(ack: Ack, outcome: Outcome) -> Gate {
        Gate::Done(Done::new(ack, outcome))
    }

    #[test]
    fn the_record_lets_through_only_a_validated_result_of_its_own_generation() {
        let g = rec(JobState::Validated).generation();
        assert_eq!(by_record(Some(&rec(JobState::Validated)), g), Gate::Open);
        assert_eq!(by_record(Some(&rec(JobState::Validated)), g + 1), done(Ack::Ack, Outcome::Stale));
        assert_eq!(by_record(Some(&rec(JobState::Published)), g), done(Ack::Ack, Outcome::Duplicate));
        assert_eq!(by_record(Some(&rec(JobState::Terminal)), g), done(Ack::Ack, Outcome::Dropped));
        assert_eq!(by_record(None, g), done(Ack::Term, Outcome::Dropped), "no record: the message ends");
        for early in [JobState::Waiting, JobState::Running, JobState::RetryScheduled] {
            assert_eq!(
                by_record(Some(&rec(early)), g),
                done(Ack::Nak(Some(NOT_READY_RETRY)), Outcome::Released),
                "{early:?}"
            );
        }
    }

    #[test]
    fn the_claim_lets_through_only_our_own() {
        let g = rec(JobState::Validated).generation();
        assert_eq!(by_claim(&Claimed::Mine(Box::new(Claim { attempt: 1, record: None })), g, 0), Gate::Open);
        let wait = Duration::from_millis(1_500) + CLAIM_MARGIN;
        assert_eq!(
            by_claim(&Claimed::Busy { until_ms: 2_500 }, g, 1_000),
            done(Ack::Nak(Some(wait)), Outcome::Deferred(wait))
        );
        let moved = |state| Claimed::Moved(Box::new(rec(state)));
        assert_eq!(by_claim(&moved(JobState::Published), g, 0), done(Ack::Ack, Outcome::Duplicate));
        assert_eq!(by_claim(&moved(JobState::Terminal), g, 0), done(Ack::Ack, Outcome::Dropped), "cancelled first");
        assert_eq!(
            by_claim(&moved(JobState::Validated), g, 0),
            done(Ack::Nak(Some(NOT_READY_RETRY)), Outcome::Released),
            "not claimed: handed back, never delivered unclaimed"
        );
    }

    #[test]
    fn a_delivery_past_its_budget_or_its_deadline_is_not_tried() {
        assert_eq!(by_budget(8, 8, Some(10_000), 9_999), Gate::Open);
        assert_eq!(by_budget(9, 8, None, 0), Gate::Fail(TerminalReason::DeliveryBudgetExhausted));
        assert_eq!(by_budget(1, 8, Some(10_000), 10_000), Gate::Fail(TerminalReason::DeadlineExceeded));
    }
}
