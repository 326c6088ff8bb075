//! The trip's end: `conclude`, the one place a lane message is answered (acked, nak'd,
//! terminated or left alone), from the `End` the trip came to. A decision of a lease is
//! recorded first (`record`): a compare-and-set fenced by the lease's generation,
//! through the pure `plan::plan`. A holder whose lease was taken over records nothing
//! and leaves the message alone (the new holder owns it); its discarded answer is
//! counted.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use reviewlane_core::job::{Event, JobState, TerminalReason, Tokens, TransitionError};
use reviewlane_shared::faults::point;
use reviewlane_shared::job_store::StoreError;

use super::plan::{Decision, LeaseView, Outcome, Policy, Settlement, plan};
use super::{Job, Lease, Worker};

/// Retry after our own infrastructure failed (NATS), not the provider.
const INFRA_RETRY: Duration = Duration::from_secs(1);

/// How a trip ends for its message (`Worker::conclude` carries it out).
pub(super) enum End {
    /// The lease's decision: recorded (fenced by its generation) with the tokens of the
    /// paid calls it charges, then the message answered as the plan says.
    Decided { lease: Box<Lease>, decision: Decision, charge: Option<Tokens> },
    /// Nothing (more) to record: the message is answered with `ack` (`None`: left
    /// alone), after a dead letter for `dead_letter`.
    Answered { outcome: Outcome, ack: Option<AckKind>, dead_letter: Option<TerminalReason> },
}

impl End {
    /// The lease's decision, charging nothing.
    pub fn decided(lease: Box<Lease>, decision: Decision) -> End {
        End::Decided { lease, decision, charge: None }
    }

    /// Answered with `ack`, nothing recorded.
    pub fn answered(outcome: Outcome, ack: AckKind) -> End {
        End::Answered { outcome, ack: Some(ack), dead_letter: None }
    }
}

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
    /// settlement the pure core plans (`plan`), applied — one retried write, and what
    /// the message is to be answered with (`None`: left alone, a part recorded or the
    /// lease lost).
    pub(super) async fn record(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        decision: Decision,
        charge: Option<Tokens>,
    ) -> Result<(Outcome, Option<AckKind>), StoreError> {
        let generation = lease.generation();
        let view =
            LeaseView { generation, attempts: lease.rec.attempts, deadline_ms: lease.rec.deadline_ms, tokens: charge };
        let policy = Policy { budgets: self.policy.budgets, backoff: self.policy.backoff(job.review.lane) };
        let (event, outcome, ack_kind) =
            match plan(decision, &view, &policy, self.clock.now_ms(), rand::random::<f64>()) {
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
        let charge = charge.map(|t| (t, self.policy.price.map_or(0, |p| p.cost_micro_usd(t))));
        let applied = self
            .with_store_retry(job, "record", || async {
                if validated {
                    self.faults.check(point::EXTRACTOR_RECORD_VALIDATED)?;
                }
                lease.apply(&self.stores.jobs, &event, charge).await
            })
            .await;
        match applied {
            Ok(rec) => self.recorded(job, lease, &rec, outcome, ack_kind).await,
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
        lease: &Lease,
        rec: &reviewlane_core::job::JobRecord,
        outcome: Outcome,
        ack_kind: Option<AckKind>,
    ) -> Result<(Outcome, Option<AckKind>), StoreError> {
        let calls = lease.calls(rec);
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
