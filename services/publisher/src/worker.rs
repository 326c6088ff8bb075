//! The publisher's unit of work: one `FINDINGS_<R>` message -> at most one delivery.
//!
//! Publish-once: the first attempt for a job creates its record in `PUBLISHED_<R>`
//! (`publishing`; KV `create`, so one creator wins); a delivered job moves it to
//! `published` by compare-and-set, then the job record to `published`. A later copy of
//! the same message finds `published` and delivers nothing. Deliveries carry the job id
//! (`Idempotency-Key`) for the rare repeat after a crash between delivery and record.
//! A failed delivery is a nak with a delay: nobody sleeps holding a lease.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, kv};
use reviewlane_shared::job::{Event, JobRecord, JobState, TerminalReason};
use reviewlane_shared::job_store::{JobStore, StoreError};
use reviewlane_shared::messages::{Delivery, FindingsMessage};
use reviewlane_shared::region::Region;
use reviewlane_shared::telemetry::now_ms;
use reviewlane_shared::tenants::Tenants;
use serde::{Deserialize, Serialize};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::metrics::Metrics;
use crate::sink::{SinkOutcome, Sinks};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PublicationState {
    Publishing,
    Published,
    Failed,
}

/// A record in `PUBLISHED_<R>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Publication {
    pub state: PublicationState,
    pub at_ms: u64,
}

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
    /// Delivery failed for now; the message comes back after the delay.
    RetryScheduled(Duration),
    Failed(TerminalReason),
    /// Handed back after an infrastructure error or because the job is not validated yet.
    Released,
}

pub struct Worker {
    pub region: Region,
    pub jobs: JobStore,
    pub published: kv::Store,
    pub tenants: Arc<Tenants>,
    pub sinks: Sinks,
    pub delivery_attempts: u32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    pub metrics: Metrics,
    pub results: reviewlane_shared::results::Results,
}

/// How long to wait for the extractor's `validated` write that follows its publish.
const VALIDATED_WAIT: Duration = Duration::from_secs(5);
const NOT_READY_RETRY: Duration = Duration::from_secs(2);

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
                tracing::warn!(error = %e, "infrastructure error; handing the message back");
                settle(&msg, AckKind::Nak(Some(NOT_READY_RETRY))).await;
                Outcome::Released
            }
        }
    }

    async fn run(&self, msg: &jetstream::Message, f: &FindingsMessage) -> Result<Outcome, StoreError> {
        let id = f.job_id.as_str();
        let rec = match self.jobs.get(id).await? {
            Some((rec, _)) if rec.state == JobState::Running && rec.generation() == f.generation => {
                self.await_validated(id).await?
            }
            Some((rec, _)) => rec,
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

        // Claim the publication, or find who did.
        let revision = match self.published.create(id, encode(PublicationState::Publishing)).await {
            Ok(rev) => rev,
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                let entry =
                    self.published.entry(id).await.map_err(StoreError::kv_entry)?.ok_or(StoreError::NotFound)?;
                let p: Publication = serde_json::from_slice(&entry.value).map_err(|_| StoreError::Corrupt)?;
                match p.state {
                    PublicationState::Published => {
                        // Delivered before; the job record may lag behind a crash.
                        self.mark_job(id, &Event::Published).await?;
                        tracing::info!(outcome = "duplicate", "already published");
                        settle(msg, AckKind::Ack).await;
                        return Ok(Outcome::Duplicate);
                    }
                    PublicationState::Failed => {
                        settle(msg, AckKind::Ack).await;
                        return Ok(Outcome::Dropped);
                    }
                    // An earlier attempt failed or died mid-way: deliver again.
                    PublicationState::Publishing => entry.revision,
                }
            }
            Err(e) => return Err(StoreError::kv_create(e)),
        };

        let delivery = Delivery::from_findings(f);
        let body = serde_json::to_vec(&delivery).expect("delivery serializes");
        let outcome = match self.tenants.get(&f.tenant).and_then(|t| t.sink.clone()) {
            Some(sink) => {
                let span = tracing::info_span!(
                    "sink.deliver",
                    otel.kind = "client",
                    sink = sink.kind(),
                    findings = f.findings.len(),
                    result = Empty,
                );
                let outcome = self.sinks.deliver(&sink, id, &body).instrument(span.clone()).await;
                span.record("result", outcome.as_str());
                outcome
            }
            // No sink: findings are read with GetReview/WatchReview.
            None => SinkOutcome::Delivered,
        };
        match outcome {
            SinkOutcome::Delivered => {
                match self.published.update(id, encode(PublicationState::Published), revision).await {
                    Ok(_) => {}
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                        tracing::info!("publication record changed concurrently");
                    }
                    Err(e) => return Err(StoreError::kv_update(e)),
                }
                self.mark_job(id, &Event::Published).await?;
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
                let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).max(1) as u32;
                if delivered >= self.delivery_attempts {
                    return self.fail(msg, f, revision, TerminalReason::DeliveryBudgetExhausted).await;
                }
                let exp = self.backoff_base.as_secs_f64() * 2f64.powi(delivered.min(30) as i32 - 1);
                let delay =
                    Duration::from_secs_f64(exp.min(self.backoff_cap.as_secs_f64()) * (0.5 + rand::random::<f64>()))
                        .min(self.backoff_cap);
                tracing::warn!(
                    status_class = class,
                    attempt = delivered,
                    delay_ms = delay.as_millis() as u64,
                    "delivery failed; retry scheduled"
                );
                self.metrics.retry(delay);
                settle(msg, AckKind::Nak(Some(delay))).await;
                Ok(Outcome::RetryScheduled(delay))
            }
            SinkOutcome::Permanent(status) => {
                tracing::warn!(status, "sink rejected the delivery");
                self.fail(msg, f, revision, TerminalReason::DeliveryRejected).await
            }
        }
    }

    async fn fail(
        &self,
        msg: &jetstream::Message,
        f: &FindingsMessage,
        revision: u64,
        reason: TerminalReason,
    ) -> Result<Outcome, StoreError> {
        let id = f.job_id.as_str();
        let _ = self.published.update(id, encode(PublicationState::Failed), revision).await;
        self.mark_job(id, &Event::Terminate { reason, upstream_status: None, generation: None }).await?;
        self.metrics.failed(f.lane, reason);
        settle(msg, AckKind::Ack).await;
        tracing::warn!(outcome = "failed", reason = reason.as_str(), "delivery failed for good");
        Ok(Outcome::Failed(reason))
    }

    /// The extractor keeps findings, then records `validated`: wait briefly for that
    /// write instead of bouncing the message. The record as it stands at the end.
    async fn await_validated(&self, id: &str) -> Result<JobRecord, StoreError> {
        let mut changes = self.jobs.changes(id).await?;
        let wait = async {
            loop {
                let (current, _) = self.jobs.get(id).await?.ok_or(StoreError::NotFound)?;
                if current.state != JobState::Running {
                    return Ok(current);
                }
                tokio::select! {
                    c = changes.next() => if c.is_none() { return Ok(current) },
                    _ = tokio::time::sleep(reviewlane_shared::job_store::RECHECK) => {}
                }
            }
        };
        match tokio::time::timeout(VALIDATED_WAIT, wait).await {
            Ok(done) => done,
            Err(_) => Ok(self.jobs.get(id).await?.ok_or(StoreError::NotFound)?.0),
        }
    }

    async fn mark_job(&self, id: &str, event: &Event) -> Result<(), StoreError> {
        match self.jobs.apply(id, event).await {
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
            Outcome::RetryScheduled(_) => "retry_scheduled",
            Outcome::Failed(_) => "failed",
            Outcome::Released => "released",
        }
    }
}

fn encode(state: PublicationState) -> bytes::Bytes {
    serde_json::to_vec(&Publication { state, at_ms: now_ms() }).expect("publication serializes").into()
}

async fn settle(msg: &jetstream::Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::warn!(error = %e, "settling the message failed; it will be redelivered after its lease");
    }
}
