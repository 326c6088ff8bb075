//! The publisher's unit of work: one `FINDINGS_<R>` message -> at most one delivery.
//!
//! Publish-once: a delivery is claimed on the job record (`claim`: one write naming an
//! owner, an expiry and the attempt; from here a cancel no longer applies), delivered,
//! and the job moves to `published` by a compare-and-set from the claim's revision. A
//! later copy of the message finds `published` and delivers nothing; a result of a
//! lease generation the job did not validate is never delivered.
//! Deliveries carry the job id (`Idempotency-Key`) for the rare repeat after a crash
//! between delivery and record. A failed delivery is a nak with a delay: nobody sleeps
//! holding a lease.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use reviewlane_core::job::{Event, JobRecord, JobState, TerminalReason};
use reviewlane_core::messages::{Delivery, FindingsMessage};
use reviewlane_core::region::Region;
use reviewlane_core::tenants::Tenants;
use reviewlane_shared::job_store::{JobStore, StoreError};
use reviewlane_shared::telemetry::now_ms;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::claim::{Claim, Claimed, Claims};
pub use crate::gate::Outcome;
use crate::gate::{self, Ack, Done, Gate, NOT_READY_RETRY};
use crate::metrics::Metrics;
use crate::sink::{SinkOutcome, Sinks};

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

    /// The one settlement site: whatever the message came to, it is settled here.
    async fn process(&self, msg: jetstream::Message) -> Outcome {
        let done = self.run(&msg).await;
        if let Err(e) = msg.ack_with(done.ack.kind()).await {
            tracing::warn!(error = %e, "settling the message failed; it will be redelivered after its lease");
        }
        done.outcome
    }

    /// The message's trip: read the result, pass the gate (record, claim, budget), mark
    /// the job delivering, deliver, record — and what it came to.
    async fn run(&self, msg: &jetstream::Message) -> Done {
        let f = match self.results.resolve(&msg.payload).await {
            Ok(f) => f,
            Err(e) if e.is_retryable() => {
                tracing::warn!(error = %e, kind = e.kind(), "reading the result failed; handing the message back");
                return Done::new(Ack::Nak(Some(NOT_READY_RETRY)), Outcome::Released);
            }
            Err(e) => {
                tracing::error!(kind = e.kind(), "unreadable findings message; terminating it");
                return Done::new(Ack::Term, Outcome::Dropped);
            }
        };
        Span::current()
            .record("job_id", f.job_id.as_str())
            .record("tenant", f.tenant.as_str())
            .record("lane", f.lane.as_str())
            .record("schema_version", f.schema_version.as_str())
            .record("review_depth", f.review_depth.as_str());
        match self.deliver_once(msg, &f).await {
            Ok(done) => done,
            Err(e) => {
                self.health.refused(self.region, &e);
                tracing::warn!(error = %e, "infrastructure error; handing the message back");
                Done::new(Ack::Nak(Some(NOT_READY_RETRY)), Outcome::Released)
            }
        }
    }

    async fn deliver_once(&self, msg: &jetstream::Message, f: &FindingsMessage) -> Result<Done, StoreError> {
        let id = f.job_id.as_str();
        // The record as read, with its revision: this delivery's writes to it are
        // compare-and-sets from there, without reading again.
        let found = match self.jobs.get(id).await? {
            Some((rec, _)) if rec.state == JobState::Running && rec.generation() == f.generation => {
                Some(self.await_validated(id).await?)
            }
            found => found,
        };
        if let Gate::Done(done) = gate::by_record(found.as_ref().map(|(rec, _)| rec), f.generation) {
            return Ok(self.noted(done));
        }
        let found = found.expect("the gate opens only for a record");
        let deadline_ms = found.0.deadline_ms;
        // The claim: from here a cancel no longer applies; one that came first wins.
        let claimed = self.claims.claim(&self.jobs, id, found).await?;
        let now = self.claims.clock.now_ms();
        if let Gate::Done(done) = gate::by_claim(&claimed, f.generation, now) {
            return Ok(self.noted(done));
        }
        let Claimed::Mine(mut claim) = claimed else { unreachable!("the gate opens only for our claim") };
        if let Gate::Fail(reason) = gate::by_budget(claim.attempt, self.delivery_attempts, deadline_ms, now) {
            return self.fail(f, &mut claim, reason).await;
        }
        match self.deliver(f, claim.attempt).await {
            SinkOutcome::Delivered => self.record_delivered(msg, f, *claim, deadline_ms).await,
            SinkOutcome::Transient(class) => {
                let delay = self.backoff(claim.attempt);
                tracing::warn!(status_class = class, attempt = claim.attempt, "delivery failed");
                self.retry_later(f, &mut claim, delay).await
            }
            SinkOutcome::RetryAfter(delay) => {
                // The receiver's own limit: its delay, within the same delivery budget.
                tracing::warn!(attempt = claim.attempt, "sink rate-limited");
                self.retry_later(f, &mut claim, delay).await
            }
            SinkOutcome::Deferred(delay) => {
                // Nothing was refused: the attempt is given back, the message handed back.
                tracing::info!(delay_ms = delay.as_millis() as u64, "delivery deferred (receiver paused or paced)");
                self.claims.release(&self.jobs, id, &mut claim, false).await?;
                Ok(Done::new(Ack::Nak(Some(delay)), Outcome::Deferred(delay)))
            }
            SinkOutcome::Permanent(status) => {
                tracing::warn!(status, "sink refused the delivery");
                self.fail(f, &mut claim, TerminalReason::DeliveryRejected).await
            }
            SinkOutcome::Refused(why) => {
                tracing::warn!(why, "delivery target not allowed for this tenant");
                self.fail(f, &mut claim, TerminalReason::DeliveryRejected).await
            }
        }
    }

    /// The record step: the sink has the findings, so recording that must not fail over
    /// a store outage or a full store, or the message comes back and is delivered again.
    /// The write is retried while the message is held (its lease kept alive) until the
    /// store takes it or the job's deadline passes — after which a message that comes
    /// back is not delivered (too late).
    async fn record_delivered(
        &self,
        msg: &jetstream::Message,
        f: &FindingsMessage,
        mut claim: Claim,
        deadline_ms: Option<u64>,
    ) -> Result<Done, StoreError> {
        let id = f.job_id.as_str();
        let until = deadline_ms
            .map(|d| tokio::time::Instant::now() + Duration::from_millis(d.saturating_sub(self.claims.clock.now_ms())));
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
        let record = || {
            let known = claim.record.take();
            async {
                self.faults.check(reviewlane_shared::faults::point::PUBLISHER_RECORD_DELIVERED)?;
                self.mark_job_from(id, known, &Event::Published).await
            }
        };
        self.store_retry.run_until(until, record, retry).await?;
        self.metrics.published(f.lane, Duration::from_millis(now_ms().saturating_sub(f.submitted_at_ms)));
        tracing::info!(
            outcome = "published",
            findings = f.findings.len(),
            quarantined = f.quarantined.len(),
            "delivered"
        );
        Ok(Done::new(Ack::Ack, Outcome::Published))
    }

    /// The delivery itself, to the tenant's sink (none: findings are read with
    /// GetReview/WatchReview).
    async fn deliver(&self, f: &FindingsMessage, attempt: u32) -> SinkOutcome {
        let tenant = self.tenants.get(&f.tenant);
        let Some(sink) = tenant.as_ref().and_then(|t| t.sink.clone()) else { return SinkOutcome::Delivered };
        let allow_private = tenant.as_ref().is_some_and(|t| t.allow_private_webhook);
        let span = tracing::info_span!(
            "sink.deliver",
            otel.kind = "client",
            sink = sink.kind(),
            findings = f.findings.len(),
            attempt,
            result = Empty,
        );
        let delivery = Delivery::from_findings(f);
        let outcome = self.sinks.deliver_review(&sink, allow_private, &delivery).instrument(span.clone()).await;
        span.record("result", outcome.as_str());
        outcome
    }

    /// A gate's verdict, logged.
    fn noted(&self, done: Done) -> Done {
        match &done.outcome {
            Outcome::Stale => tracing::info!("result of a lease that was taken over; not delivered"),
            Outcome::Duplicate => tracing::info!(outcome = "duplicate", "already published"),
            Outcome::Dropped if done.ack == Ack::Term => {
                tracing::warn!("no job record for findings; terminating the message")
            }
            Outcome::Dropped => tracing::info!(outcome = "dropped", "job ended before delivery"),
            Outcome::Deferred(wait) => {
                tracing::info!(wait_ms = wait.as_millis() as u64, "another publisher holds the delivery")
            }
            _ => {}
        }
        done
    }

    /// Capped exponential backoff with jitter after failed attempt `attempt` (1-based).
    fn backoff(&self, attempt: u32) -> Duration {
        let exp = self.backoff_base.as_secs_f64() * 2f64.powi(attempt.min(30) as i32 - 1);
        Duration::from_secs_f64(exp.min(self.backoff_cap.as_secs_f64()) * (0.5 + rand::random::<f64>()))
            .min(self.backoff_cap)
    }

    /// A delivery that may be tried again: after `delay`, within the delivery budget.
    async fn retry_later(&self, f: &FindingsMessage, claim: &mut Claim, delay: Duration) -> Result<Done, StoreError> {
        if claim.attempt >= self.delivery_attempts {
            return self.fail(f, claim, TerminalReason::DeliveryBudgetExhausted).await;
        }
        tracing::warn!(attempt = claim.attempt, delay_ms = delay.as_millis() as u64, "delivery retry scheduled");
        self.claims.release(&self.jobs, &f.job_id, claim, true).await?;
        self.metrics.retry(delay);
        Ok(Done::new(Ack::Nak(Some(delay)), Outcome::RetryScheduled(delay)))
    }

    async fn fail(&self, f: &FindingsMessage, claim: &mut Claim, reason: TerminalReason) -> Result<Done, StoreError> {
        let id = f.job_id.as_str();
        let end = Event::Terminate { reason, upstream_status: None, generation: None };
        self.mark_job_from(id, claim.record.take(), &end).await?;
        self.metrics.failed(f.lane, reason);
        tracing::warn!(outcome = "failed", reason = reason.as_str(), "delivery failed for good");
        Ok(Done::new(Ack::Ack, Outcome::Failed(reason)))
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

    /// Applies `event` to the job record, from a record and revision this delivery wrote
    /// (`None`: read first); a transition the record no longer allows is left as it is.
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
