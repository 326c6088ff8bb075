//! The publisher's unit of work: one `FINDINGS_<R>` message -> at most one delivery.
//!
//! Publish-once: a delivery is claimed in `PUBLISHED_<R>` (`claim`: one owner, an
//! expiry, an attempt count), then marked on the job record (`Delivering`: from here a
//! cancel no longer applies), delivered, and the claim and the job move to
//! `published`. A later copy of the message finds `published` and delivers nothing; a
//! result of a lease generation the job did not validate is never delivered.
//! Deliveries carry the job id (`Idempotency-Key`) for the rare repeat after a crash
//! between delivery and record. A failed delivery is a nak with a delay: nobody sleeps
//! holding a lease.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use reviewlane_shared::job::{Event, JobRecord, JobState, TerminalReason, TransitionError};
use reviewlane_shared::job_store::{JobStore, StoreError};
use reviewlane_shared::messages::{Delivery, FindingsMessage};
use reviewlane_shared::region::Region;
use reviewlane_shared::telemetry::now_ms;
use reviewlane_shared::tenants::Tenants;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::claim::{Claim, Claimed, Claims, PublicationState};
use crate::metrics::Metrics;
use crate::sink::{SinkOutcome, Sinks};

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

pub struct Worker {
    pub region: Region,
    pub jobs: JobStore,
    pub claims: Claims,
    pub tenants: Arc<Tenants>,
    pub sinks: Sinks,
    pub delivery_attempts: u32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    pub metrics: Metrics,
    pub results: reviewlane_shared::results::Results,
    /// Retries of the writes that record a delivery already made.
    pub store_retry: reviewlane_shared::store::StoreRetry,
    /// What the store refused (counted; a full store makes the publisher unready).
    pub health: reviewlane_shared::store_health::StoreHealth,
    pub faults: reviewlane_shared::faults::Faults,
}

/// How long to wait for the extractor's `validated` write that follows its keep.
const VALIDATED_WAIT: Duration = Duration::from_secs(5);
const NOT_READY_RETRY: Duration = Duration::from_secs(2);
/// Added when handing a message back until another publisher's claim expires.
const CLAIM_MARGIN: Duration = Duration::from_millis(250);

impl Worker {
    /// Runs in a `publish` span whose parent is the extractor's `findings.publish` span
    /// (the message's `traceparent`): the job's trace ends here.
    pub async fn process_one(&self, msg: jetstream::Message) -> Outcome {
        let span = tracing::info_span!(
            parent: None,
            "publish",
            otel.name = "publish findings",
            otel.kind = "consumer",
            messaging.system = "nats",
            messaging.operation.type = "process",
            messaging.destination.name = %msg.subject,
            job_id = Empty,
            tenant = Empty,
            region = %self.region,
            lane = Empty,
            schema_version = Empty,
            review_depth = Empty,
            outcome = Empty,
        );
        reviewlane_shared::telemetry::set_remote_parent(
            &span,
            reviewlane_shared::telemetry::parent_from_nats(msg.headers.as_ref()),
        );
        let outcome = self.process(msg).instrument(span.clone()).await;
        let name = outcome.as_str();
        span.record("outcome", name);
        self.metrics.outcome(name);
        outcome
    }

    async fn process(&self, msg: jetstream::Message) -> Outcome {
        let findings = match self.results.resolve(&msg.payload).await {
            Ok(f) => f,
            Err(e) if e.is_retryable() => {
                tracing::warn!(error = %e, kind = e.kind(), "reading the result failed; handing the message back");
                settle(&msg, AckKind::Nak(Some(NOT_READY_RETRY))).await;
                return Outcome::Released;
            }
            Err(e) => {
                tracing::error!(kind = e.kind(), "unreadable findings message; terminating it");
                settle(&msg, AckKind::Term).await;
                return Outcome::Dropped;
            }
        };
        Span::current()
            .record("job_id", findings.job_id.as_str())
            .record("tenant", findings.tenant.as_str())
            .record("lane", findings.lane.as_str())
            .record("schema_version", findings.schema_version.as_str())
            .record("review_depth", findings.review_depth.as_str());
        match self.run(&msg, &findings).await {
            Ok(o) => o,
            Err(e) => {
                self.health.refused(self.region, &e);
                tracing::warn!(error = %e, "infrastructure error; handing the message back");
                settle(&msg, AckKind::Nak(Some(NOT_READY_RETRY))).await;
                Outcome::Released
            }
        }
    }

    async fn run(&self, msg: &jetstream::Message, f: &FindingsMessage) -> Result<Outcome, StoreError> {
        let id = f.job_id.as_str();
        // The record as read, with its revision: this delivery's writes to it are
        // compare-and-sets from there, without reading again.
        let (rec, revision) = match self.jobs.get(id).await? {
            Some((rec, _)) if rec.state == JobState::Running && rec.generation() == f.generation => {
                self.await_validated(id).await?
            }
            Some(found) => found,
            None => {
                tracing::warn!("no job record for findings; terminating the message");
                settle(msg, AckKind::Term).await;
                return Ok(Outcome::Dropped);
            }
        };
        if rec.generation() != f.generation {
            tracing::info!(
                generation = f.generation,
                newest = rec.generation(),
                "result of a lease that was taken over; not delivered"
            );
            settle(msg, AckKind::Ack).await;
            return Ok(Outcome::Stale);
        }
        match rec.state {
            JobState::Validated => {}
            JobState::Published => {
                tracing::info!(outcome = "duplicate", "already published");
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Duplicate);
            }
            JobState::Terminal => {
                tracing::info!(outcome = "dropped", "job ended before delivery");
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Dropped);
            }
            _ => {
                settle(msg, AckKind::Nak(Some(NOT_READY_RETRY))).await;
                return Ok(Outcome::Released);
            }
        }

        let claim = match self.claims.claim(id).await? {
            Claimed::Mine(claim) => claim,
            Claimed::Busy { until_ms } => {
                let wait = Duration::from_millis(until_ms.saturating_sub(self.claims.clock.now_ms())) + CLAIM_MARGIN;
                tracing::info!(wait_ms = wait.as_millis() as u64, "another publisher holds the delivery");
                settle(msg, AckKind::Nak(Some(wait))).await;
                return Ok(Outcome::Deferred(wait));
            }
            Claimed::Published => {
                // Delivered before; the job record may lag behind a crash.
                self.mark_job(id, &Event::Published).await?;
                tracing::info!(outcome = "duplicate", "already published");
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Duplicate);
            }
            Claimed::Failed => {
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Dropped);
            }
        };
        if claim.attempt > self.delivery_attempts {
            return self.fail(msg, f, &claim, TerminalReason::DeliveryBudgetExhausted).await;
        }
        // Findings after the caller's deadline are of no use to it: not delivered.
        let rec_deadline = rec.deadline_ms;
        if rec.deadline_ms.is_some_and(|d| self.claims.clock.now_ms() >= d) {
            return self.fail(msg, f, &claim, TerminalReason::DeadlineExceeded).await;
        }
        // From here a cancel no longer applies; one that came first wins.
        let mut known = match self.jobs.apply_tracked(id, Some((rec, revision)), &Event::Delivering, None).await {
            Ok(written) => Some(written),
            Err(StoreError::Transition(_, current)) if current.state == JobState::Terminal => {
                self.claims.settle(id, &claim, PublicationState::Failed).await?;
                tracing::info!(outcome = "dropped", "job ended before delivery");
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Dropped);
            }
            Err(StoreError::Transition(TransitionError::AlreadyFinal(JobState::Published), _)) => {
                self.claims.settle(id, &claim, PublicationState::Published).await?;
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Duplicate);
            }
            Err(e) => return Err(e),
        };

        let tenant = self.tenants.get(&f.tenant);
        let delivery = Delivery::from_findings(f);
        let outcome = match tenant.as_ref().and_then(|t| t.sink.clone()) {
            Some(sink) => {
                let allow_private = tenant.as_ref().is_some_and(|t| t.allow_private_webhook);
                let span = tracing::info_span!(
                    "sink.deliver",
                    otel.kind = "client",
                    sink = sink.kind(),
                    findings = f.findings.len(),
                    attempt = claim.attempt,
                    result = Empty,
                );
                let outcome = self.sinks.deliver_review(&sink, allow_private, &delivery).instrument(span.clone()).await;
                span.record("result", outcome.as_str());
                outcome
            }
            // No sink: findings are read with GetReview/WatchReview.
            None => SinkOutcome::Delivered,
        };
        match outcome {
            SinkOutcome::Delivered => {
                // The sink has it: recording that must not fail over a store outage or a
                // full store, or the message comes back and is delivered again. The
                // writes are retried while the message is held (its lease and the claim
                // kept alive) until the store takes them or the job's deadline passes —
                // after which a message that comes back is not delivered (too late).
                let until = rec_deadline.map(|d| {
                    tokio::time::Instant::now() + Duration::from_millis(d.saturating_sub(self.claims.clock.now_ms()))
                });
                let retry = |e: &StoreError, attempt: u32, delay: Duration| {
                    self.health.refused(self.region, e);
                    tracing::warn!(
                        kind = e.kind(),
                        attempt,
                        delay_ms = delay.as_millis() as u64,
                        "recording a delivery failed; retrying"
                    );
                    async {
                        let _ = msg.ack_with(AckKind::Progress).await;
                    }
                };
                let record = || async {
                    self.faults.check(reviewlane_shared::faults::point::PUBLISHER_RECORD_DELIVERED)?;
                    self.claims.settle(id, &claim, PublicationState::Published).await
                };
                self.store_retry.run_until(until, record, retry).await?;
                self.store_retry
                    .run_until(until, || self.mark_job_from(id, known.take(), &Event::Published), retry)
                    .await?;
                settle(msg, AckKind::Ack).await;
                self.metrics.published(f.lane, Duration::from_millis(now_ms().saturating_sub(f.submitted_at_ms)));
                tracing::info!(
                    outcome = "published",
                    findings = f.findings.len(),
                    quarantined = f.quarantined.len(),
                    "delivered"
                );
                Ok(Outcome::Published)
            }
            SinkOutcome::Transient(class) => {
                let delay = self.backoff(claim.attempt);
                tracing::warn!(status_class = class, attempt = claim.attempt, "delivery failed");
                self.retry_later(msg, f, &claim, delay).await
            }
            SinkOutcome::RetryAfter(delay) => {
                // The receiver's own limit: its delay, within the same delivery budget.
                tracing::warn!(attempt = claim.attempt, "sink rate-limited");
                self.retry_later(msg, f, &claim, delay).await
            }
            SinkOutcome::Deferred(delay) => {
                // Nothing was refused: the attempt is given back, the message handed back.
                tracing::info!(delay_ms = delay.as_millis() as u64, "delivery deferred (receiver paused or paced)");
                self.claims.give_back(&f.job_id, &claim).await?;
                settle(msg, AckKind::Nak(Some(delay))).await;
                Ok(Outcome::Deferred(delay))
            }
            SinkOutcome::Permanent(status) => {
                tracing::warn!(status, "sink refused the delivery");
                self.fail(msg, f, &claim, TerminalReason::DeliveryRejected).await
            }
            SinkOutcome::Refused(why) => {
                tracing::warn!(why, "delivery target not allowed for this tenant");
                self.fail(msg, f, &claim, TerminalReason::DeliveryRejected).await
            }
        }
    }

    /// Capped exponential backoff with jitter after failed attempt `attempt` (1-based).
    fn backoff(&self, attempt: u32) -> Duration {
        let exp = self.backoff_base.as_secs_f64() * 2f64.powi(attempt.min(30) as i32 - 1);
        Duration::from_secs_f64(exp.min(self.backoff_cap.as_secs_f64()) * (0.5 + rand::random::<f64>()))
            .min(self.backoff_cap)
    }

    /// A delivery that may be tried again: after `delay`, within the delivery budget.
    async fn retry_later(
        &self,
        msg: &jetstream::Message,
        f: &FindingsMessage,
        claim: &Claim,
        delay: Duration,
    ) -> Result<Outcome, StoreError> {
        if claim.attempt >= self.delivery_attempts {
            return self.fail(msg, f, claim, TerminalReason::DeliveryBudgetExhausted).await;
        }
        tracing::warn!(attempt = claim.attempt, delay_ms = delay.as_millis() as u64, "delivery retry scheduled");
        self.claims.settle(&f.job_id, claim, PublicationState::Publishing).await?;
        self.metrics.retry(delay);
        settle(msg, AckKind::Nak(Some(delay))).await;
        Ok(Outcome::RetryScheduled(delay))
    }

    async fn fail(
        &self,
        msg: &jetstream::Message,
        f: &FindingsMessage,
        claim: &Claim,
        reason: TerminalReason,
    ) -> Result<Outcome, StoreError> {
        let id = f.job_id.as_str();
        self.claims.settle(id, claim, PublicationState::Failed).await?;
        self.mark_job(id, &Event::Terminate { reason, upstream_status: None, generation: None }).await?;
        self.metrics.failed(f.lane, reason);
        settle(msg, AckKind::Ack).await;
        tracing::warn!(outcome = "failed", reason = reason.as_str(), "delivery failed for good");
        Ok(Outcome::Failed(reason))
    }

    /// The extractor keeps findings, then records `validated`: wait briefly for that
    /// write instead of bouncing the message. The record (and revision) as it stands at
    /// the end. Waits on the record's change signals (a core subscription: no consumer
    /// to create) and short pauses, reading again after each.
    async fn await_validated(&self, id: &str) -> Result<(JobRecord, u64), StoreError> {
        let mut signals = self.jobs.signals(id).await?;
        let wait = async {
            // A signal is sent when the write reaches the server, before it is stored,
            // and a write already on its way when the subscription started sends none:
            // so read again on the next signal or after a pause (1 ms, doubling to
            // 32 ms), whichever comes first.
            let mut pause = Duration::from_millis(1);
            loop {
                let current = self.jobs.get(id).await?.ok_or(StoreError::NotFound)?;
                if current.0.state != JobState::Running {
                    return Ok(current);
                }
                if let Ok(None) = tokio::time::timeout(pause, signals.next()).await {
                    return Ok(current);
                }
                pause = (pause * 2).min(Duration::from_millis(32));
            }
        };
        match tokio::time::timeout(VALIDATED_WAIT, wait).await {
            Ok(done) => done,
            Err(_) => self.jobs.get(id).await?.ok_or(StoreError::NotFound),
        }
    }

    async fn mark_job(&self, id: &str, event: &Event) -> Result<(), StoreError> {
        self.mark_job_from(id, None, event).await
    }

    /// `mark_job` from a record and revision this delivery wrote (`None`: read first).
    async fn mark_job_from(&self, id: &str, known: Option<(JobRecord, u64)>, event: &Event) -> Result<(), StoreError> {
        match self.jobs.apply_tracked(id, known, event, None).await {
            Ok(_) | Err(StoreError::Transition(..)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl Outcome {
    /// The outcome's class, for the span and `reviewlane_publish_outcomes_total`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Published => "published",
            Outcome::Duplicate => "duplicate",
            Outcome::Dropped => "dropped",
            Outcome::Stale => "stale",
            Outcome::Deferred(_) => "deferred",
            Outcome::RetryScheduled(_) => "retry_scheduled",
            Outcome::Failed(_) => "failed",
            Outcome::Released => "released",
        }
    }
}

async fn settle(msg: &jetstream::Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::warn!(error = %e, "settling the message failed; it will be redelivered after its lease");
    }
}
