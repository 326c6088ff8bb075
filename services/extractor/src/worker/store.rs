//! The worker's store writes: a write retried with backoff while the lease is kept
//! alive (`with_store_retry`), and a paid answer kept until the store takes it or the
//! job's deadline passes (`keep_paid`). The lease's own fenced write is
//! `Lease::apply` (`lease.rs`).

use std::future::Future;

use async_nats::jetstream::AckKind;
use reviewlane_core::job::TerminalReason;
use reviewlane_shared::job_store::StoreError;

use super::plan::Decision;
use super::{Job, Lease, Worker};

impl Worker {
    /// Stores a paid answer that exists only in this worker: retried with backoff, the
    /// lease kept alive, until the store takes it or the job's deadline passes. `Err` is
    /// what the job comes to when it cannot be kept: `deadline_exceeded` (retried to
    /// the deadline), `store_budget_exhausted` (refused for good), or handed back at
    /// once when a shutdown's grace is over (another replica calls again: paid twice,
    /// lost never).
    pub(super) async fn keep_paid<T, F, Fut>(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        what: &'static str,
        write: F,
    ) -> Result<T, Decision>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let until = lease.rec.deadline_ms.map(|d| {
            tokio::time::Instant::now() + std::time::Duration::from_millis(d.saturating_sub(self.clock.now_ms()))
        });
        let kept = tokio::select! {
            kept = self.policy.store_retry.run_until(until, write, |e, attempt, delay| self.store_retried(job, what, e, attempt, delay)) => kept,
            _ = self.abort.cancelled() => {
                tracing::warn!(what, "shutting down before a paid answer could be kept; the job goes back for another call");
                return Err(Decision::Release(None));
            }
        };
        kept.map_err(|e| {
            self.health.refused(self.region, &e);
            tracing::error!(what, error = %e, kind = e.kind(), "a paid answer could not be kept");
            let reason =
                if e.is_retryable() { TerminalReason::DeadlineExceeded } else { TerminalReason::StoreBudgetExhausted };
            Decision::Terminal { reason, status: Some("2xx".into()) }
        })
    }

    /// Runs a store write, retrying retryable failures with backoff up to the store
    /// budget, the lease kept alive meanwhile (progress acks).
    pub(super) async fn with_store_retry<T, F, Fut>(
        &self,
        job: &Job<'_>,
        what: &'static str,
        write: F,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        self.policy.store_retry.run(write, |e, attempt, delay| self.store_retried(job, what, e, attempt, delay)).await
    }

    /// Between two tries of a store write: counted, logged, and the lease kept alive.
    fn store_retried(
        &self,
        job: &Job<'_>,
        what: &'static str,
        e: &StoreError,
        attempt: u32,
        delay: std::time::Duration,
    ) -> impl Future<Output = ()> + use<> {
        self.health.refused(self.region, e);
        tracing::warn!(
            what,
            kind = e.kind(),
            attempt,
            delay_ms = delay.as_millis() as u64,
            "store write failed; retrying the write"
        );
        self.metrics.store_retry(e.kind());
        let msg = job.msg.clone();
        async move {
            let _ = msg.ack_with(AckKind::Progress).await;
        }
    }
}
