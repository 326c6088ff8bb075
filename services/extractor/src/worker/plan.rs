//! The pure cores of a job's trip. `verdict`: what an answer means — a decision, or an
//! output to validate and keep — and what the provider key's shared quota learns from
//! it. `plan`: what a decided attempt comes to — the event the job record gets, how the
//! message is settled, the outcome, whether a dead letter follows — from the decision,
//! the lease as held, the policy and the time. The worker applies both in one place
//! each; every row of both tables has a unit test here.

use std::time::Duration;

use reviewlane_core::job::{Attempts, Budget, Event, PartDone, TerminalReason, Tokens};

pub use reviewlane_shared::pull::Ack;

use super::call::Answer;
use crate::config::Budgets;
use crate::upstream::{Backoff, UpstreamOutcome};
use reviewlane_core::findings::Validated;

/// What the trip decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The result of the lease's generation is kept: record `validated`.
    Validated {
        findings: usize,
        quarantined: usize,
        /// Findings the merge of a split review left out (over the cap).
        dropped: u32,
    },
    /// One part of a split review is kept on `PARTS_<R>` at `seq`: record it done (the
    /// lease and the message stay held for the other parts).
    PartDone {
        index: u32,
        seq: u64,
        findings: usize,
        quarantined: usize,
    },
    /// Spend one unit of `budget` and try again after the hint (else backoff).
    Retry {
        budget: Budget,
        hint: Option<Duration>,
        status: Option<String>,
        /// Why an output was invalid (schema budget): a class, never content.
        invalid: Option<&'static str>,
    },
    Terminal {
        reason: TerminalReason,
        status: Option<String>,
    },
    /// Hand the message back (`None`: at once, for shutdown), recording nothing.
    Release(Option<Duration>),
    /// The lease was taken over: record nothing, settle nothing.
    Stale,
    /// The job ended while the call ran: move the message to the dead letters.
    Ended(TerminalReason),
}

/// How the worker settled one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Validated {
        findings: usize,
        quarantined: usize,
    },
    RetryScheduled {
        budget: Budget,
        delay: Duration,
    },
    Terminal(TerminalReason),
    /// Nothing to do: the job is final or its result is already recorded.
    Skipped,
    /// Handed back until another holder's lease or a retry delay is over.
    Deferred(Duration),
    /// The answer came after the lease was taken over: discarded.
    Stale,
    /// Handed back without delay (shutdown) or after an infrastructure error.
    Released,
    /// A part of a split review is recorded done; `parts` as recorded. The message is
    /// still held.
    PartDone {
        parts: reviewlane_core::job::Parts,
    },
}

impl Outcome {
    /// The outcome's class, for the `process` span.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Validated { .. } => "validated",
            Outcome::RetryScheduled { .. } => "retry_scheduled",
            Outcome::Terminal(_) => "terminal",
            Outcome::Skipped => "skipped",
            Outcome::Deferred(_) => "deferred",
            Outcome::Stale => "stale",
            Outcome::Released => "released",
            Outcome::PartDone { .. } => "part_done",
        }
    }
}

/// What an answer comes to before anything is written.
#[derive(Debug)]
pub enum Verdict {
    /// The same review's validated result, from the cache: keep it as this job's.
    Cached(Validated),
    /// A 2xx: validate the output against the schema and the diff, then keep it (an
    /// invalid one spends the schema budget, with `status`).
    Usable {
        output: String,
        usage: Option<Tokens>,
        status: Option<String>,
    },
    Decided(Decision),
}

/// What the provider key's shared quota learns from an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaEffect {
    None,
    /// A 2xx: the window may grow; `pause` when the answer's headers said a dimension
    /// is empty (the key slows down before a 429).
    Succeeded {
        started_ms: u64,
        pause: Option<Duration>,
    },
    /// A 429: every replica's calls on the key wait its `pause`, as this job does; a
    /// 429 of a metered dimension empties that bucket instead of narrowing the window.
    RateLimited(crate::quota::Limited),
    /// `insufficient_quota`: the key's circuit opens.
    OpenCircuit,
}

/// A 429 without a hint that the answers predicted (the last reading of a limited
/// dimension said none remained): the dimension, and how long until its bucket has room.
pub type Predicted = Option<(reviewlane_core::meter::Dimension, Duration)>;

/// The verdict on `answer` for a lease that has spent `congestion_used` congestion
/// retries: a 429 without the provider's hint waits the lane's `backoff` for the next
/// one (`unit`: uniform in [0, 1), the jitter) — unless the answers `predicted` it: then
/// the key pauses until the bucket has room and the job goes back to wait for it,
/// spending no retry.
pub fn verdict(
    answer: Answer,
    congestion_used: u32,
    backoff: &Backoff,
    unit: f64,
    predicted: Predicted,
) -> (Verdict, QuotaEffect) {
    let decided = |d| (Verdict::Decided(d), QuotaEffect::None);
    let (upstream, started_ms) = match answer {
        Answer::Cached(hit) => return (Verdict::Cached(hit), QuotaEffect::None),
        Answer::Upstream { outcome, started_ms, in_flight } => (outcome, (started_ms, in_flight)),
        other => return decided(abandoned(&other).unwrap_or(Decision::Release(None))),
    };
    let status = Some(upstream.status_class().to_string());
    match upstream {
        UpstreamOutcome::Ok { output, slow_down, usage, .. } => (
            Verdict::Usable { output, usage, status },
            QuotaEffect::Succeeded { started_ms: started_ms.0, pause: slow_down },
        ),
        UpstreamOutcome::RateLimited { retry_after: None, .. } if predicted.is_some() => {
            let (dimension, wait) = predicted.expect("checked");
            let (started_ms, in_flight) = started_ms;
            let limited =
                crate::quota::Limited { pause: wait, started_ms, in_flight: Some(in_flight), bucket: Some(dimension) };
            (Verdict::Decided(Decision::Release(Some(wait))), QuotaEffect::RateLimited(limited))
        }
        UpstreamOutcome::RateLimited { retry_after, dimension, .. } => {
            let delay = retry_after.unwrap_or_else(|| backoff.delay(congestion_used + 1, unit));
            let retry = Decision::Retry { budget: Budget::Congestion, hint: Some(delay), status, invalid: None };
            let (started_ms, in_flight) = started_ms;
            let limited =
                crate::quota::Limited { pause: delay, started_ms, in_flight: Some(in_flight), bucket: dimension };
            (Verdict::Decided(retry), QuotaEffect::RateLimited(limited))
        }
        UpstreamOutcome::Transient { .. } => {
            decided(Decision::Retry { budget: Budget::Transient, hint: None, status, invalid: None })
        }
        UpstreamOutcome::QuotaExhausted => (
            Verdict::Decided(Decision::Terminal { reason: TerminalReason::InsufficientQuota, status }),
            QuotaEffect::OpenCircuit,
        ),
        UpstreamOutcome::Permanent { .. } => {
            decided(Decision::Terminal { reason: TerminalReason::UpstreamRejected, status })
        }
    }
}

/// The decision on a call abandoned before its answer: the shutdown grace is over, the
/// lease was taken over, the job ended or its deadline came. `None` for an answer.
pub fn abandoned(answer: &Answer) -> Option<Decision> {
    match answer {
        Answer::Aborted => Some(Decision::Release(None)),
        Answer::LostLease => Some(Decision::Stale),
        Answer::Ended(reason) => Some(Decision::Ended(*reason)),
        Answer::DeadlinePassed => Some(Decision::Terminal { reason: TerminalReason::DeadlineExceeded, status: None }),
        Answer::Upstream { .. } | Answer::Cached(_) => None,
    }
}

/// What the plan needs of the lease.
#[derive(Debug, Clone, Copy)]
pub struct LeaseView {
    pub generation: u32,
    /// The record's attempt counts as leased.
    pub attempts: Attempts,
    pub deadline_ms: Option<u64>,
    /// The tokens of this lease's paid call, not yet charged.
    pub tokens: Option<Tokens>,
}

/// How retries are paced and bounded.
#[derive(Debug, Clone, Copy)]
pub struct Policy<'a> {
    pub budgets: Budgets,
    /// Backoff without a provider's hint (the job's lane's).
    pub backoff: &'a Backoff,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Settlement {
    /// The lease was taken over: record nothing, settle nothing.
    Stale,
    /// Give the lease up (best effort) and hand the message back.
    Release(Option<Duration>),
    /// The job ended while the call ran: move the message to the dead letters.
    Ended(TerminalReason),
    /// Write `event` (fenced by the lease's generation), then settle the message with
    /// `ack` (an ack, or a nak after the delay); a terminal outcome is dead-lettered.
    Record { event: Event, outcome: Outcome, ack: Ack },
    /// Write `event` (fenced) and keep the message: a part recorded, the trip goes on.
    Progress { event: Event },
}

/// The settlement of `decision` for `lease` at `now_ms` (`unit`: uniform in [0, 1),
/// the backoff's jitter).
pub fn plan(decision: Decision, lease: &LeaseView, policy: &Policy<'_>, now_ms: u64, unit: f64) -> Settlement {
    let generation = lease.generation;
    let terminal = |reason, status| Settlement::Record {
        event: Event::Terminate { reason, upstream_status: status, generation: Some(generation) },
        outcome: Outcome::Terminal(reason),
        ack: Ack::Ack,
    };
    match decision {
        Decision::Stale => Settlement::Stale,
        Decision::Release(delay) => Settlement::Release(delay),
        Decision::Ended(reason) => Settlement::Ended(reason),
        Decision::Validated { findings, quarantined, dropped } => Settlement::Record {
            event: Event::Validated { generation, findings: findings as u32, quarantined: quarantined as u32, dropped },
            outcome: Outcome::Validated { findings, quarantined },
            ack: Ack::Ack,
        },
        Decision::PartDone { index, seq, findings, quarantined } => {
            let part = PartDone {
                index,
                seq,
                findings: findings as u32,
                quarantined: quarantined as u32,
                tokens: lease.tokens.unwrap_or_default(),
            };
            Settlement::Progress { event: Event::PartDone { generation, part } }
        }
        Decision::Retry { budget, hint, status, invalid } => {
            let used = lease.attempts.get(budget);
            if used >= policy.budgets.of(budget) {
                let reason = match budget {
                    Budget::Congestion => TerminalReason::RateLimitBudgetExhausted,
                    Budget::Transient => TerminalReason::TransientBudgetExhausted,
                    Budget::Schema => TerminalReason::InvalidOutput,
                };
                return terminal(reason, status);
            }
            let delay = hint.unwrap_or_else(|| policy.backoff.delay(used + 1, unit));
            let eligible_at_ms = now_ms + delay.as_millis() as u64;
            // A retry that could only start after the deadline is not scheduled: the job
            // ends now, without paying for a call that cannot finish in time.
            if lease.deadline_ms.is_some_and(|d| eligible_at_ms >= d) {
                return terminal(TerminalReason::DeadlineExceeded, status);
            }
            Settlement::Record {
                event: Event::RetryScheduled {
                    generation,
                    budget,
                    next_eligible_at_ms: eligible_at_ms,
                    upstream_status: status,
                    invalid_output: invalid.map(str::to_string),
                },
                outcome: Outcome::RetryScheduled { budget, delay },
                ack: Ack::Nak(Some(delay)),
            }
        }
        Decision::Terminal { reason, status } => terminal(reason, status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000;

    fn decided(answer: Answer, used: u32, backoff: &Backoff) -> (Decision, QuotaEffect) {
        match verdict(answer, used, backoff, 0.5, None) {
            (Verdict::Decided(d), effect) => (d, effect),
            (other, _) => panic!("{other:?}"),
        }
    }

    fn upstream(outcome: UpstreamOutcome) -> Answer {
        Answer::Upstream { outcome, started_ms: NOW, in_flight: 3 }
    }

    #[test]
    fn a_2xx_is_kept_and_the_key_learns_it_succeeded() {
        let usage = Tokens { input: 10, output: 2 };
        let pause = Some(Duration::from_secs(3));
        let ok = UpstreamOutcome::Ok {
            output: "{}".into(),
            slow_down: pause,
            usage: Some(usage),
            meter: Default::default(),
        };
        let (v, effect) = verdict(upstream(ok), 0, &Backoff::default(), 0.5, None);
        assert!(
            matches!(&v, Verdict::Usable { output, usage: Some(u), status: Some(s) } if output == "{}" && *u == usage && s == "2xx"),
            "{v:?}"
        );
        assert_eq!(effect, QuotaEffect::Succeeded { started_ms: NOW, pause });
    }

    #[test]
    fn a_429_retries_on_the_congestion_budget_and_pauses_the_key_for_the_same_delay() {
        let b = Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60), jitter: (1.0, 1.0) };
        let limited = |retry_after, dimension| UpstreamOutcome::RateLimited {
            retry_after,
            capped: false,
            dimension,
            meter: Default::default(),
        };
        let effect_of = |pause, bucket| {
            QuotaEffect::RateLimited(crate::quota::Limited { pause, started_ms: NOW, in_flight: Some(3), bucket })
        };
        let hinted = limited(Some(Duration::from_secs(7)), None);
        let (d, effect) = decided(upstream(hinted), 0, &b);
        let seven = Duration::from_secs(7);
        assert_eq!(
            d,
            Decision::Retry {
                budget: Budget::Congestion,
                hint: Some(seven),
                status: Some("429".into()),
                invalid: None
            }
        );
        assert_eq!(effect, effect_of(seven, None));
        // Without a hint: the backoff of the next congestion retry (the third: 4 s); a
        // 429 of the tokens bucket says so to the quota.
        let bare = limited(None, Some(reviewlane_core::meter::Dimension::Tokens));
        let (d, effect) = decided(upstream(bare), 2, &b);
        let four = Duration::from_secs(4);
        assert!(matches!(d, Decision::Retry { budget: Budget::Congestion, hint: Some(h), .. } if h == four), "{d:?}");
        assert_eq!(effect, effect_of(four, Some(reviewlane_core::meter::Dimension::Tokens)));
        // Predicted by the answers (none left, no hint): the job waits for the bucket,
        // spending no retry, and the key pauses as long, for that bucket.
        let requests = reviewlane_core::meter::Dimension::Requests;
        let wait = Duration::from_secs(41);
        let (v, effect) = verdict(upstream(limited(None, None)), 2, &b, 0.5, Some((requests, wait)));
        assert!(matches!(v, Verdict::Decided(Decision::Release(Some(w))) if w == wait), "{v:?}");
        assert_eq!(effect, effect_of(wait, Some(requests)));
        // A hint is the provider's word: it is a congestion retry whatever was predicted.
        let (v, _) = verdict(upstream(limited(Some(seven), None)), 0, &b, 0.5, Some((requests, wait)));
        assert!(matches!(v, Verdict::Decided(Decision::Retry { budget: Budget::Congestion, .. })), "{v:?}");
    }

    #[test]
    fn transient_quota_and_permanent_answers_decide_without_keeping() {
        let b = Backoff::default();
        let (d, effect) = decided(upstream(UpstreamOutcome::Transient { status_class: "5xx" }), 0, &b);
        assert_eq!(
            d,
            Decision::Retry { budget: Budget::Transient, hint: None, status: Some("5xx".into()), invalid: None }
        );
        assert_eq!(effect, QuotaEffect::None);
        let (d, effect) = decided(upstream(UpstreamOutcome::QuotaExhausted), 0, &b);
        assert_eq!(d, Decision::Terminal { reason: TerminalReason::InsufficientQuota, status: Some("429".into()) });
        assert_eq!(effect, QuotaEffect::OpenCircuit);
        let (d, effect) = decided(upstream(UpstreamOutcome::Permanent { status: 400 }), 0, &b);
        assert!(matches!(d, Decision::Terminal { reason: TerminalReason::UpstreamRejected, status: Some(_) }), "{d:?}");
        assert_eq!(effect, QuotaEffect::None);
    }

    #[test]
    fn an_answer_that_never_came_decides_alone() {
        let b = Backoff::default();
        for (answer, want) in [
            (Answer::Aborted, Decision::Release(None)),
            (Answer::LostLease, Decision::Stale),
            (Answer::Ended(TerminalReason::Cancelled), Decision::Ended(TerminalReason::Cancelled)),
            (Answer::DeadlinePassed, Decision::Terminal { reason: TerminalReason::DeadlineExceeded, status: None }),
        ] {
            assert_eq!(decided(answer, 0, &b), (want, QuotaEffect::None));
        }
    }

    fn lease(attempts: Attempts, deadline_ms: Option<u64>) -> LeaseView {
        LeaseView { generation: 3, attempts, deadline_ms, tokens: None }
    }

    fn policy(backoff: &Backoff) -> Policy<'_> {
        Policy { budgets: Budgets { congestion: 2, transient: 1, schema: 1 }, backoff }
    }

    fn retry(budget: Budget, hint: Option<Duration>) -> Decision {
        Decision::Retry { budget, hint, status: Some("429".into()), invalid: None }
    }

    #[test]
    fn a_retry_within_its_budget_and_the_deadline_is_scheduled_after_its_hint_or_backoff() {
        let b = Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60), jitter: (1.0, 1.0) };
        let p = policy(&b);
        let got = plan(
            retry(Budget::Congestion, Some(Duration::from_secs(7))),
            &lease(Attempts::default(), None),
            &p,
            NOW,
            0.5,
        );
        let Settlement::Record {
            event: Event::RetryScheduled { generation, next_eligible_at_ms, budget, .. },
            outcome,
            ack,
        } = got
        else {
            panic!("{got:?}")
        };
        assert_eq!((generation, next_eligible_at_ms, budget), (3, NOW + 7_000, Budget::Congestion));
        assert_eq!(outcome, Outcome::RetryScheduled { budget: Budget::Congestion, delay: Duration::from_secs(7) });
        assert_eq!(ack, Ack::Nak(Some(Duration::from_secs(7))));
        // Without a hint: the backoff for the next attempt (the second: 2 s).
        let once = Attempts { congestion: 1, ..Default::default() };
        let got = plan(retry(Budget::Congestion, None), &lease(once, None), &p, NOW, 0.5);
        assert!(
            matches!(got, Settlement::Record { ack: Ack::Nak(Some(d)), .. } if d == Duration::from_secs(2)),
            "{got:?}"
        );
    }

    #[test]
    fn a_spent_budget_ends_the_job_with_its_own_reason() {
        let b = Backoff::default();
        let p = policy(&b);
        for (budget, attempts, reason) in [
            (
                Budget::Congestion,
                Attempts { congestion: 2, ..Default::default() },
                TerminalReason::RateLimitBudgetExhausted,
            ),
            (
                Budget::Transient,
                Attempts { transient: 1, ..Default::default() },
                TerminalReason::TransientBudgetExhausted,
            ),
            (Budget::Schema, Attempts { schema: 1, ..Default::default() }, TerminalReason::InvalidOutput),
        ] {
            let got = plan(retry(budget, None), &lease(attempts, None), &p, NOW, 0.5);
            let want = Settlement::Record {
                event: Event::Terminate { reason, upstream_status: Some("429".into()), generation: Some(3) },
                outcome: Outcome::Terminal(reason),
                ack: Ack::Ack,
            };
            assert_eq!(got, want, "{budget:?}");
        }
    }

    #[test]
    fn a_retry_that_could_only_start_after_the_deadline_ends_the_job_now() {
        let b = Backoff::default();
        let p = policy(&b);
        let hint = Some(Duration::from_secs(30));
        let late = plan(retry(Budget::Congestion, hint), &lease(Attempts::default(), Some(NOW + 2_000)), &p, NOW, 0.5);
        assert!(
            matches!(late, Settlement::Record { outcome: Outcome::Terminal(TerminalReason::DeadlineExceeded), .. }),
            "{late:?}"
        );
        let in_time =
            plan(retry(Budget::Congestion, hint), &lease(Attempts::default(), Some(NOW + 31_000)), &p, NOW, 0.5);
        assert!(matches!(in_time, Settlement::Record { outcome: Outcome::RetryScheduled { .. }, .. }), "{in_time:?}");
    }

    #[test]
    fn results_parts_and_endings_settle_as_the_table_says() {
        let b = Backoff::default();
        let p = policy(&b);
        let l = LeaseView { tokens: Some(Tokens { input: 5, output: 2 }), ..lease(Attempts::default(), None) };
        let validated = plan(Decision::Validated { findings: 2, quarantined: 1, dropped: 0 }, &l, &p, NOW, 0.5);
        assert_eq!(
            validated,
            Settlement::Record {
                event: Event::Validated { generation: 3, findings: 2, quarantined: 1, dropped: 0 },
                outcome: Outcome::Validated { findings: 2, quarantined: 1 },
                ack: Ack::Ack,
            }
        );
        let part = plan(Decision::PartDone { index: 4, seq: 9, findings: 1, quarantined: 0 }, &l, &p, NOW, 0.5);
        let Settlement::Progress { event: Event::PartDone { part, generation } } = part else { panic!("{part:?}") };
        assert_eq!((generation, part.index, part.seq, part.tokens), (3, 4, 9, Tokens { input: 5, output: 2 }));
        let rejected = plan(
            Decision::Terminal { reason: TerminalReason::UpstreamRejected, status: Some("4xx".into()) },
            &l,
            &p,
            NOW,
            0.5,
        );
        assert!(matches!(
            rejected,
            Settlement::Record { outcome: Outcome::Terminal(TerminalReason::UpstreamRejected), ack: Ack::Ack, .. }
        ));
        assert_eq!(plan(Decision::Stale, &l, &p, NOW, 0.5), Settlement::Stale);
        assert_eq!(plan(Decision::Release(None), &l, &p, NOW, 0.5), Settlement::Release(None));
        assert_eq!(
            plan(Decision::Ended(TerminalReason::Cancelled), &l, &p, NOW, 0.5),
            Settlement::Ended(TerminalReason::Cancelled)
        );
    }
}
