//! Step 2, call: one provider call (`attempt`), with the lease kept alive while it
//! runs — progress acks on the message and a fenced extension of the record's lease —
//! and watched (`watched`, which also watches a split review's parts in flight): a
//! cancelled job, a lease taken over or the job's deadline ends the wait for the
//! answer.

use std::future::Future;
use std::time::{Duration, Instant};

use async_nats::jetstream::AckKind;
use reviewlane_core::findings::Validated;
use reviewlane_core::job::{Event, JobState, TerminalReason, TransitionError};
use reviewlane_shared::job_store::StoreError;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use tracing::field::Empty;

use super::{Job, Lease, Metering, Target, Worker};
use crate::provider::ProviderRequest;
use crate::upstream::UpstreamOutcome;

/// How a call ended.
pub enum Answer {
    Upstream {
        outcome: UpstreamOutcome,
        /// When the call started (for the scope's congestion window).
        started_ms: u64,
        /// The fleet's calls in flight on the key when it started, itself included.
        in_flight: u32,
    },
    /// The same review was answered before: no call, no cost.
    Cached(Validated),
    /// Shutdown grace over.
    Aborted,
    /// Another holder took the lease over while this one waited (it was paused or cut
    /// off): its answer must not be recorded.
    LostLease,
    /// The job ended (cancelled) while the call ran.
    Ended(TerminalReason),
    /// The job's deadline came during the call: the call was abandoned.
    DeadlinePassed,
}

impl Worker {
    /// One call with the lease kept alive and watched (`watched`).
    pub(super) async fn call(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        target: &Target<'_>,
        metering: &Metering,
        abort: &CancellationToken,
    ) -> Result<Answer, StoreError> {
        Ok(self.watched(job, lease, self.attempt(job, lease, target, metering), abort).await?.unwrap_or_else(|end| end))
    }

    /// One provider call, answered or timed out: traced, counted and metered. The
    /// caller keeps the lease alive meanwhile (`watched`).
    pub(super) async fn attempt(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        target: &Target<'_>,
        metering: &Metering,
    ) -> Answer {
        let req = ProviderRequest {
            job_id: job.id(),
            region: job.review.region,
            schema_version: &job.review.schema_version,
            diff_text: &target.text,
            diff: target.diff,
            review_depth: job.review.review_depth,
            part: target.part,
        };
        let (deployment, _, scope) = job.callee(metering);
        let started_ms = self.clock.now_ms();
        let in_flight = deployment.quota.fleet_in_flight();
        // Time the job waited while eligible: since submit, or since its retry delay ended.
        let eligible_at_ms = lease.rec.next_eligible_at_ms.unwrap_or(lease.rec.created_at_ms);
        let attempt = tracing::info_span!(
            "provider.attempt",
            otel.kind = "client",
            attempt = lease.generation(),
            part = target.part.map(i64::from).unwrap_or(-1),
            provider = deployment.provider.name(),
            model_class = %scope.model_class,
            queue_wait_ms = started_ms.saturating_sub(eligible_at_ms),
            outcome = Empty,
            status_class = Empty,
            budget = Empty,
            budget_remaining = Empty,
            duration_ms = Empty,
        );
        let started = Instant::now();
        metering.called.store(true, std::sync::atomic::Ordering::Relaxed);
        let call = tokio::time::timeout(self.policy.provider_timeout, deployment.provider.review(&req));
        let upstream =
            call.instrument(attempt.clone()).await.unwrap_or(UpstreamOutcome::Transient { status_class: "timeout" });
        let took = started.elapsed();
        attempt.record("duration_ms", took.as_millis() as u64);
        let outcome_class = match &upstream {
            UpstreamOutcome::Ok { .. } => "ok",
            UpstreamOutcome::RateLimited { .. } => "rate_limited",
            UpstreamOutcome::QuotaExhausted => "insufficient_quota",
            UpstreamOutcome::Transient { .. } => "transient",
            UpstreamOutcome::Permanent { .. } => "rejected",
            UpstreamOutcome::ContentFiltered { .. } => "content_filtered",
        };
        self.metrics.upstream(scope, outcome_class, upstream.status_class(), took);
        attempt.record("outcome", outcome_class).record("status_class", upstream.status_class());
        let charged = match &upstream {
            UpstreamOutcome::RateLimited { .. } => Some(reviewlane_core::job::Budget::Congestion),
            UpstreamOutcome::Transient { .. } => Some(reviewlane_core::job::Budget::Transient),
            _ => None,
        };
        if let Some(b) = charged {
            let left = self.policy.budgets.of(b).saturating_sub(lease.rec.attempts.get(b) + 1);
            attempt.record("budget", b.as_str()).record("budget_remaining", left);
        }
        attempt.in_scope(|| {
            tracing::info!(outcome = outcome_class, status_class = upstream.status_class(), "provider answered")
        });
        Answer::Upstream { outcome: upstream, started_ms, in_flight }
    }

    /// Runs `work` (calls) with the lease kept alive — progress acks on the message and
    /// a fenced extension of the record's lease — and watched. `Err(answer)` when the
    /// work was abandoned: shutdown grace over (`Aborted`), the job ended, the lease was
    /// taken over, or the job's deadline came (an answer after it would be of no use).
    pub(super) async fn watched<T>(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        work: impl Future<Output = T>,
        abort: &CancellationToken,
    ) -> Result<Result<T, Answer>, StoreError> {
        // A cancel is seen here at once; one racing the subscription, at the next
        // heartbeat's extend at the latest.
        let mut changes = self.stores.jobs.signals(job.id()).await?;
        tokio::pin!(work);
        let mut heartbeat = reviewlane_shared::pull::heartbeat(self.policy.lease / 3);
        let deadline = async {
            match lease.rec.deadline_ms {
                Some(at) => tokio::time::sleep(Duration::from_millis(at.saturating_sub(self.clock.now_ms()))).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                done = &mut work => return Ok(Ok(done)),
                _ = heartbeat.tick() => {
                    if let Some(end) = self.extend(job, lease).await {
                        return Ok(Err(end));
                    }
                }
                Some(_) = futures::StreamExt::next(&mut changes) => {
                    if let Some((rec, _)) = self.stores.jobs.get(job.id()).await?
                        && rec.state == JobState::Terminal
                    {
                        return Ok(Err(Answer::Ended(rec.reason.unwrap_or(TerminalReason::Cancelled))));
                    }
                }
                _ = &mut deadline => return Ok(Err(Answer::DeadlinePassed)),
                _ = abort.cancelled() => return Ok(Err(Answer::Aborted)),
            }
        }
    }

    /// Extends the lease on the message and in the record. An answer when the job ended
    /// or another holder has the lease.
    async fn extend(&self, job: &Job<'_>, lease: &Lease) -> Option<Answer> {
        if let Err(e) = job.msg.ack_with(AckKind::Progress).await {
            tracing::warn!(error = %e, "progress ack failed");
        }
        let event = Event::Extended {
            generation: lease.generation(),
            lease_expires_at_ms: self.clock.now_ms() + self.policy.lease.as_millis() as u64,
        };
        match lease.apply(&self.stores.jobs, &event, None).await {
            Ok(_) => None,
            Err(StoreError::Transition(TransitionError::Fenced { .. }, _)) => {
                tracing::warn!(generation = lease.generation(), "lease taken over by another holder");
                Some(Answer::LostLease)
            }
            Err(StoreError::Transition(_, current)) if current.state == JobState::Terminal => {
                Some(Answer::Ended(current.reason.unwrap_or(TerminalReason::Cancelled)))
            }
            Err(StoreError::Transition(..)) => Some(Answer::LostLease),
            Err(e) => {
                // The next tick tries again; the lease outlives two missed extensions.
                tracing::warn!(error = %e, kind = e.kind(), "extending the lease failed");
                None
            }
        }
    }
}
