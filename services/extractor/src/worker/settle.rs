//! The trip's end: `conclude`, the one place a lane message is answered (acked, nak'd,
//! terminated or left alone), from the `End` the trip came to. A decision of a lease is
//! recorded first (`record`): what it comes to is the pure `settlement` (at the end of
//! this file), written as one compare-and-set fenced by the lease's generation. A holder whose lease was taken over records nothing
//! and leaves the message alone (the new holder owns it); its discarded answer is
//! counted.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use reviewlane_core::job::{Event, JobState, TerminalReason, Tokens, TransitionError};
use reviewlane_shared::faults::point;
use reviewlane_shared::job_store::StoreError;

use reviewlane_core::job::{Attempts, Budget, PartDone};
use reviewlane_shared::pull::Ack;

use super::{Decision, End, Job, Lease, Outcome, Worker};
use crate::config::Budgets;
use crate::upstream::Backoff;

/// Retry after our own infrastructure failed (NATS), not the provider.
const INFRA_RETRY: Duration = Duration::from_secs(1);

impl Worker {
    /// Carries out how the trip ended: records a lease's decision, dead-letters a job
    /// that ended, and answers the message — here and nowhere else. A store failure
    /// hands the message back. `job` is `None` for a message that could not be read.
    pub(super) async fn conclude(
        &self,
        msg: &jetstream::Message,
        job: Option<&Job<'_>>,
        end: Result<End, StoreError>,
    ) -> Outcome {
        let answered = match (end, job) {
            (Ok(End::Decided { lease, decision, charge }), Some(job)) => {
                self.record(job, &lease, decision, charge).await
            }
            (Ok(End::Answered { outcome, ack, dead_letter }), _) => match (dead_letter, job) {
                (Some(reason), Some(job)) => self.dead_letter(job, reason).await.map(|()| (outcome, ack)),
                _ => Ok((outcome, ack)),
            },
            (Ok(End::Decided { .. }), None) => unreachable!("a decision is of a job's lease"),
            (Err(e), _) => Err(e),
        };
        let (outcome, ack) = answered.unwrap_or_else(|e| {
            self.health.refused(self.region, &e);
            tracing::warn!(error = %e, kind = e.kind(), "store error; handing the message back");
            (Outcome::Released, Some(AckKind::Nak(Some(INFRA_RETRY))))
        });
        if let Some(kind) = ack {
            reviewlane_shared::pull::ack(msg, kind).await;
        }
        outcome
    }

    /// Records `decision` for the lease, charging `charge` in the same write: the
    /// pure `settlement`, applied — one retried write, and what
    /// the message is to be answered with (`None`: left alone, a part recorded or the
    /// lease lost).
    pub(super) async fn record(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        decision: Decision,
        charge: Option<reviewlane_core::job::Charge>,
    ) -> Result<(Outcome, Option<AckKind>), StoreError> {
        let generation = lease.generation();
        let tokens = charge.as_ref().map(|c| c.tokens);
        let view = LeaseView { generation, attempts: lease.rec.attempts, deadline_ms: lease.rec.deadline_ms, tokens };
        let policy = Policy { budgets: self.policy.budgets, backoff: self.policy.backoff(job.review.lane) };
        let (event, outcome, ack_kind) =
            match settlement(decision, &view, &policy, self.clock.now_ms(), rand::random::<f64>()) {
                Settlement::Stale => return Ok(self.stale(generation)),
                Settlement::Release(delay) => {
                    // Give the lease up in the record too, so the next holder need not wait
                    // for it to run out (best effort: it runs out anyway).
                    let now = Event::Extended { generation, lease_expires_at_ms: self.clock.now_ms() };
                    if let Err(e) = lease.apply(&self.stores.jobs, &now, None).await {
                        tracing::debug!(kind = e.kind(), "releasing the lease in the record failed");
                    }
                    return Ok((Outcome::Released, Some(AckKind::Nak(delay))));
                }
                Settlement::Ended(reason) => {
                    tracing::info!(reason = reason.as_str(), "job ended during the provider call; call abandoned");
                    self.dead_letter(job, reason).await?;
                    return Ok((Outcome::Terminal(reason), Some(AckKind::Ack)));
                }
                Settlement::Record { event, outcome, ack } => (event, outcome, Some(ack.kind())),
                Settlement::Progress { event } => (event, Outcome::PartDone { parts: Default::default() }, None),
            };
        let validated = matches!(event, Event::Validated { .. } | Event::PartDone { .. });
        // The paid calls are charged to the job in the same write.
        let write = || async {
            if validated {
                self.faults.check(point::EXTRACTOR_RECORD_VALIDATED)?;
            }
            lease.apply(&self.stores.jobs, &event, charge.as_ref()).await
        };
        let retried = |e: &StoreError, attempt, delay| self.store_retried(job, "record", e, attempt, delay);
        let applied = self.policy.store_retry.run(write, retried).await;
        match applied {
            Ok(rec) => self.recorded(job, &rec, outcome, ack_kind).await,
            Err(StoreError::Transition(TransitionError::Fenced { .. }, _)) => Ok(self.stale(generation)),
            // Ended meanwhile (cancelled): what the record says stands.
            Err(StoreError::Transition(_, current)) => {
                tracing::info!(state = current.state.as_str(), "job moved on before the decision was recorded");
                if current.state == JobState::Terminal {
                    self.dead_letter(job, current.reason.unwrap_or(TerminalReason::Cancelled)).await?;
                }
                Ok((Outcome::Skipped, Some(AckKind::Ack)))
            }
            // A kept result survives this: the next delivery finishes from it.
            Err(e) if validated => {
                tracing::warn!(error = %e, kind = e.kind(), "recording validated failed; the kept result is resumed later");
                Ok((Outcome::Released, Some(AckKind::Nak(Some(self.policy.store_retry.cap)))))
            }
            Err(e) => Err(e),
        }
    }

    /// The lease was taken over: nothing recorded, the message left to its new holder.
    fn stale(&self, generation: u32) -> (Outcome, Option<AckKind>) {
        self.metrics.stale_result();
        tracing::warn!(generation, "answer arrived after the lease was taken over; discarded");
        (Outcome::Stale, None)
    }

    /// After the decision's write: metrics, logs and the dead letter of a terminal job.
    async fn recorded(
        &self,
        job: &Job<'_>,
        rec: &reviewlane_core::job::JobRecord,
        outcome: Outcome,
        ack_kind: Option<AckKind>,
    ) -> Result<(Outcome, Option<AckKind>), StoreError> {
        let calls = calls(rec, job.called());
        // A part recorded: the message stays held for the others and the merge.
        if ack_kind.is_none() {
            let parts = rec.parts.clone().expect("a part done is recorded in a split job");
            tracing::info!(done = parts.done.len(), total = parts.total, "part recorded");
            return Ok((Outcome::PartDone { parts }, None));
        }
        match &outcome {
            Outcome::Validated { findings, quarantined } => {
                self.metrics.finished(job.review.lane, calls, None);
                tracing::info!(findings, quarantined, "validated");
            }
            Outcome::RetryScheduled { budget, delay } => {
                self.metrics.retry(*budget, *delay);
                tracing::info!(
                    budget = budget.as_str(),
                    attempt = rec.attempts.get(*budget),
                    delay_ms = delay.as_millis() as u64,
                    "retry scheduled"
                );
            }
            Outcome::Terminal(reason) => {
                self.metrics.finished(job.review.lane, calls, Some(*reason));
                self.dead_letter(job, *reason).await?;
                tracing::warn!(reason = reason.as_str(), "job terminal");
            }
            _ => {}
        }
        Ok((outcome, ack_kind))
    }

    /// Moves a failed review off its lane into the dead letters (the store's
    /// `DeadLetters::publish`), with the attempts its record counted.
    pub(super) async fn dead_letter(&self, job: &Job<'_>, reason: TerminalReason) -> Result<(), StoreError> {
        if reason == TerminalReason::Cancelled {
            return Ok(());
        }
        let attempts = match self.stores.jobs.get(job.id()).await {
            Ok(Some((rec, _))) => rec.attempts,
            _ => Default::default(),
        };
        let dead_letters =
            reviewlane_shared::dead_letters::DeadLetters::new(self.stores.layout.js.clone(), self.region);
        dead_letters.publish(job.review, job.msg.payload.clone(), reason, attempts, self.clock.now_ms()).await
    }
}

/// Provider calls the job has made: one per retry spent, and this delivery's if it
/// called.
fn calls(rec: &reviewlane_core::job::JobRecord, called: bool) -> u32 {
    let a = rec.attempts;
    a.congestion + a.transient + a.schema + u32::from(called)
}

// What a decision comes to: the pure table of step 4.

/// What a settlement needs of the lease.
#[derive(Debug, Clone, Copy)]
pub(super) struct LeaseView {
    pub generation: u32,
    /// The record's attempt counts as leased.
    pub attempts: Attempts,
    pub deadline_ms: Option<u64>,
    /// The tokens of this lease's paid call, not yet charged.
    pub tokens: Option<Tokens>,
}

/// How retries are paced and bounded.
#[derive(Debug, Clone, Copy)]
pub(super) struct Policy<'a> {
    pub budgets: Budgets,
    /// Backoff without a provider's hint (the job's lane's).
    pub backoff: &'a Backoff,
}

/// What a decision comes to: the record's event and the message's answer.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Settlement {
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
pub(super) fn settlement(
    decision: Decision,
    lease: &LeaseView,
    policy: &Policy<'_>,
    now_ms: u64,
    unit: f64,
) -> Settlement {
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
        let got = settlement(
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
        let got = settlement(retry(Budget::Congestion, None), &lease(once, None), &p, NOW, 0.5);
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
            let got = settlement(retry(budget, None), &lease(attempts, None), &p, NOW, 0.5);
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
        let late =
            settlement(retry(Budget::Congestion, hint), &lease(Attempts::default(), Some(NOW + 2_000)), &p, NOW, 0.5);
        assert!(
            matches!(late, Settlement::Record { outcome: Outcome::Terminal(TerminalReason::DeadlineExceeded), .. }),
            "{late:?}"
        );
        let in_time =
            settlement(retry(Budget::Congestion, hint), &lease(Attempts::default(), Some(NOW + 31_000)), &p, NOW, 0.5);
        assert!(matches!(in_time, Settlement::Record { outcome: Outcome::RetryScheduled { .. }, .. }), "{in_time:?}");
    }

    #[test]
    fn results_parts_and_endings_settle_as_the_table_says() {
        let b = Backoff::default();
        let p = policy(&b);
        let l = LeaseView { tokens: Some(Tokens { input: 5, output: 2 }), ..lease(Attempts::default(), None) };
        let validated = settlement(Decision::Validated { findings: 2, quarantined: 1, dropped: 0 }, &l, &p, NOW, 0.5);
        assert_eq!(
            validated,
            Settlement::Record {
                event: Event::Validated { generation: 3, findings: 2, quarantined: 1, dropped: 0 },
                outcome: Outcome::Validated { findings: 2, quarantined: 1 },
                ack: Ack::Ack,
            }
        );
        let part = settlement(Decision::PartDone { index: 4, seq: 9, findings: 1, quarantined: 0 }, &l, &p, NOW, 0.5);
        let Settlement::Progress { event: Event::PartDone { part, generation } } = part else { panic!("{part:?}") };
        assert_eq!((generation, part.index, part.seq, part.tokens), (3, 4, 9, Tokens { input: 5, output: 2 }));
        let rejected = settlement(
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
        assert_eq!(settlement(Decision::Stale, &l, &p, NOW, 0.5), Settlement::Stale);
        assert_eq!(settlement(Decision::Release(None), &l, &p, NOW, 0.5), Settlement::Release(None));
        assert_eq!(
            settlement(Decision::Ended(TerminalReason::Cancelled), &l, &p, NOW, 0.5),
            Settlement::Ended(TerminalReason::Cancelled)
        );
    }
}
