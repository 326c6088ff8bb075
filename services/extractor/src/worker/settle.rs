//! Step 4, settle: the one place that records a decision in the job record — a
//! compare-and-set fenced by the lease's generation — and then settles the message.
//! A holder whose lease was taken over records nothing and leaves the message alone
//! (the new holder owns it); its discarded answer is counted.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use reviewlane_core::job::{Budget, Event, JobState, TerminalReason, TransitionError};
use reviewlane_shared::faults::point;
use reviewlane_shared::job_store::StoreError;

use super::plan::{LeaseView, Policy, Settlement, plan};
use super::{Job, Lease, Worker};

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

impl Worker {
    /// Records `decision` for the lease and settles the message: the settlement the
    /// pure core plans (`plan`), applied here — one retried write, one ack.
    pub(super) async fn settle(&self, job: &Job<'_>, lease: &Lease, decision: Decision) -> Result<Outcome, StoreError> {
        let generation = lease.generation();
        let tokens = *lease.tokens.lock().expect("tokens lock");
        let view = LeaseView { generation, attempts: lease.rec.attempts, deadline_ms: lease.rec.deadline_ms, tokens };
        let policy = Policy { budgets: self.policy.budgets, backoff: self.policy.backoff(job.review.lane) };
        let (event, outcome, ack_kind) =
            match plan(decision, &view, &policy, self.clock.now_ms(), rand::random::<f64>()) {
                Settlement::Stale => {
                    self.metrics.stale_result();
                    tracing::warn!(generation, "answer arrived after the lease was taken over; discarded");
                    return Ok(Outcome::Stale);
                }
                Settlement::Release(delay) => {
                    // Give the lease up in the record too, so the next holder need not wait
                    // for it to run out (best effort: it runs out anyway).
                    let now = Event::Extended { generation, lease_expires_at_ms: self.clock.now_ms() };
                    if let Err(e) = self.apply_leased(job, lease, &now, None).await {
                        tracing::debug!(kind = e.kind(), "releasing the lease in the record failed");
                    }
                    ack(job.msg, AckKind::Nak(delay)).await;
                    return Ok(Outcome::Released);
                }
                Settlement::Ended(reason) => {
                    tracing::info!(reason = reason.as_str(), "job ended during the provider call; call abandoned");
                    self.dead_letter(job, reason).await?;
                    ack(job.msg, AckKind::Ack).await;
                    return Ok(Outcome::Terminal(reason));
                }
                Settlement::Record { event, outcome, ack } => (event, outcome, Some(ack.kind())),
                Settlement::Progress { event } => (event, Outcome::PartDone { parts: Default::default() }, None),
            };
        let validated = matches!(event, Event::Validated { .. } | Event::PartDone { .. });
        // The lease's paid call is charged to the job in the same write.
        let charge = tokens.map(|t| (t, self.policy.price.map_or(0, |p| p.cost_micro_usd(t))));
        let applied = self
            .with_store_retry(job, "record", || async {
                if validated {
                    self.faults.check(point::EXTRACTOR_RECORD_VALIDATED)?;
                }
                self.apply_leased(job, lease, &event, charge).await
            })
            .await;
        match applied {
            Ok(rec) => {
                // Charged: a later write of this lease (a split review's merge) must not
                // charge the same call again.
                if charge.is_some() {
                    lease.tokens.lock().expect("tokens lock").take();
                }
                self.recorded(job, lease, &rec, outcome, ack_kind).await
            }
            Err(StoreError::Transition(TransitionError::Fenced { .. }, _)) => {
                Box::pin(self.settle(job, lease, Decision::Stale)).await
            }
            // Ended meanwhile (cancelled): what the record says stands.
            Err(StoreError::Transition(_, current)) => {
                tracing::info!(state = current.state.as_str(), "job moved on before the decision was recorded");
                if current.state == JobState::Terminal {
                    self.dead_letter(job, current.reason.unwrap_or(TerminalReason::Cancelled)).await?;
                }
                ack(job.msg, AckKind::Ack).await;
                Ok(Outcome::Skipped)
            }
            // A kept result survives this: the next delivery finishes from it.
            Err(e) if validated => {
                tracing::warn!(error = %e, kind = e.kind(), "recording validated failed; the kept result is resumed later");
                ack(job.msg, AckKind::Nak(Some(self.policy.store_retry.cap))).await;
                Ok(Outcome::Released)
            }
            Err(e) => Err(e),
        }
    }

    /// After the decision's write: metrics, logs, the dead letter of a terminal job,
    /// and the message settled.
    async fn recorded(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        rec: &reviewlane_core::job::JobRecord,
        outcome: Outcome,
        ack_kind: Option<AckKind>,
    ) -> Result<Outcome, StoreError> {
        let calls = lease.calls(rec);
        // A part recorded: the message stays held for the others and the merge.
        let Some(ack_kind) = ack_kind else {
            let parts = rec.parts.clone().expect("a part done is recorded in a split job");
            tracing::info!(done = parts.done.len(), total = parts.total, "part recorded");
            return Ok(Outcome::PartDone { parts });
        };
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
        ack(job.msg, ack_kind).await;
        Ok(outcome)
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

pub(super) async fn ack(msg: &jetstream::Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::warn!(error = %e, "settling the message failed; it will be redelivered after its lease");
    }
}
