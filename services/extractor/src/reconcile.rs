//! The region's reconciler: finds jobs that are not final and that nothing drives any
//! more — no message on the lane, no live lease, past their deadline — and re-drives or
//! ends them. Safe on every replica: each action is a compare-and-set on the revision it
//! read, so replicas that find the same job cannot both act on it.
//!
//! - A job whose previous holder kept its answer before it died is recorded
//!   `validated` from that answer (the publisher delivers it): `resumed`.
//! - A job with neither message nor kept answer cannot be re-driven (its content is
//!   gone): it ends `terminal(lost)`, counted, and the alert `ReviewlaneJobsStuck`
//!   pages while such jobs remain.

use std::time::Duration;

use futures::StreamExt;
use reviewlane_core::clock::SharedClock;
use reviewlane_core::job::{Event, JobRecord, JobState, TerminalReason};
use reviewlane_shared::job_store::{JobStore, StoreError};
use reviewlane_shared::layout::{self, RegionLayout};
use reviewlane_shared::results::Results;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// Whether a record is past its deadline with nothing that would move it: the job is
/// a candidate; the lane is checked before anything is done to it.
pub fn overdue(rec: &JobRecord, now_ms: u64, grace: Duration) -> bool {
    let grace = grace.as_millis() as u64;
    // Its sweep's coordinator drives a job of a provider batch (and ends it at the
    // sweep's window); it has no lane message to look for.
    if rec.in_provider_batch() {
        return false;
    }
    let since = match rec.state {
        JobState::Published | JobState::Terminal => return false,
        // The publisher's message is durable on FINDINGS_<R> and retried there.
        JobState::Validated => return false,
        JobState::Running => rec.lease_expires_at_ms.unwrap_or(rec.updated_at_ms),
        JobState::RetryScheduled => rec.next_eligible_at_ms.unwrap_or(rec.updated_at_ms).max(rec.updated_at_ms),
        JobState::Accepted | JobState::Waiting => rec.updated_at_ms,
    };
    now_ms >= since.saturating_add(grace)
}

/// What one pass found and did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    /// Overdue with no message on the lane.
    pub stranded: usize,
    pub resumed: usize,
    pub ended: usize,
}

pub struct Reconciler {
    pub layout: RegionLayout,
    pub jobs: JobStore,
    pub results: Results,
    pub clock: SharedClock,
    pub grace: Duration,
    pub metrics: Metrics,
}

impl Reconciler {
    /// Passes every `every` until `stop`.
    pub async fn run(self, every: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! { _ = tick.tick() => {}, _ = stop.cancelled() => return }
            match self.pass().await {
                Ok(p) if p.stranded > 0 => {
                    tracing::warn!(stranded = p.stranded, resumed = p.resumed, ended = p.ended, "reconciler pass")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, kind = e.kind(), "reconciler pass failed"),
            }
        }
    }

    /// One look at every job record of the region.
    pub async fn pass(&self) -> Result<Pass, StoreError> {
        let now = self.clock.now_ms();
        let mut pass = Pass::default();
        for rec in self.open_records().await? {
            if !overdue(&rec, now, self.grace) || self.has_message(&rec).await? {
                continue;
            }
            pass.stranded += 1;
            match self.act(&rec).await {
                Ok(Some("resumed")) => pass.resumed += 1,
                Ok(Some(_)) => pass.ended += 1,
                Ok(None) => {}
                Err(e) => tracing::warn!(job_id = %rec.job_id, kind = e.kind(), "reconciling a job failed"),
            }
        }
        self.metrics.stuck(pass.stranded - pass.resumed - pass.ended);
        Ok(pass)
    }

    async fn act(&self, rec: &JobRecord) -> Result<Option<&'static str>, StoreError> {
        let generation = rec.generation();
        let (event, action) = match self.results.read(&rec.tenant, &rec.job_id, generation).await? {
            Some(kept) if rec.state == JobState::Running => (
                Event::Validated {
                    generation,
                    findings: kept.findings.len() as u32,
                    quarantined: kept.quarantined.len() as u32,
                    dropped: kept.findings_dropped,
                },
                "resumed",
            ),
            _ => (Event::Terminate { reason: TerminalReason::Lost, upstream_status: None, generation: None }, "ended"),
        };
        // From the record as read: if anything moved it since, it is not stranded.
        let (current, revision) = self.jobs.get(&rec.job_id).await?.ok_or(StoreError::NotFound)?;
        if current.updated_at_ms != rec.updated_at_ms || current.state != rec.state {
            return Ok(None);
        }
        match self.jobs.apply_once(&rec.job_id, (current, revision), &event).await {
            Ok(_) => {
                tracing::warn!(job_id = %rec.job_id, action, state = rec.state.as_str(), "stranded job reconciled");
                self.metrics.reconciled(action);
                if action == "ended" {
                    self.metrics.terminal.inc(rec.region, rec.lane, TerminalReason::Lost);
                }
                Ok(Some(action))
            }
            Err(StoreError::Conflict) | Err(StoreError::Transition(..)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Records not final, read in one scan of the bucket.
    async fn open_records(&self) -> Result<Vec<JobRecord>, StoreError> {
        let kv = self.jobs.kv();
        // The bucket's status is cached in the handle: ask the stream.
        let bucket = format!("KV_{}", layout::jobs_bucket(self.layout.region));
        let mut stream = self.layout.js.get_stream(bucket).await.map_err(StoreError::other)?;
        let values = stream.info().await.map_err(StoreError::other)?.state.messages;
        let mut open = Vec::new();
        if values == 0 {
            return Ok(open);
        }
        let mut watch = kv.watch_with_history(">").await.map_err(StoreError::other)?;
        while let Some(entry) = watch.next().await {
            let entry = entry.map_err(StoreError::other)?;
            if let Ok(rec) = serde_json::from_slice::<JobRecord>(&entry.value)
                && !rec.state.is_final()
            {
                open.push(rec);
            }
            if entry.delta == 0 {
                break;
            }
        }
        Ok(open)
    }

    /// Whether the job's review is still on its lane.
    async fn has_message(&self, rec: &JobRecord) -> Result<bool, StoreError> {
        reviewlane_shared::lanes::holds(&self.layout.js, rec).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(state: JobState) -> JobRecord {
        reviewlane_core::testing::record("us_1", state)
    }

    #[test]
    fn a_job_is_overdue_only_past_its_own_deadline_plus_grace() {
        let grace = Duration::from_secs(10);
        let waiting = rec(JobState::Waiting);
        assert!(!overdue(&waiting, 10_999, grace));
        assert!(overdue(&waiting, 11_000, grace));

        let mut running = rec(JobState::Running);
        running.lease_expires_at_ms = Some(50_000);
        assert!(!overdue(&running, 59_999, grace), "a live lease (plus grace) is not overdue");
        assert!(overdue(&running, 60_000, grace));

        let mut retry = rec(JobState::RetryScheduled);
        retry.next_eligible_at_ms = Some(100_000);
        assert!(!overdue(&retry, 109_999, grace), "waiting out a retry delay is not overdue");
        assert!(overdue(&retry, 110_000, grace));

        for state in [JobState::Validated, JobState::Published, JobState::Terminal] {
            assert!(!overdue(&rec(state), u64::MAX, grace), "{state:?}");
        }
        // A provider batch's item has no lane message: its coordinator drives it.
        let mut batched = running.clone();
        batched.owner = Some(reviewlane_core::job::Owner::ProviderBatch(reviewlane_core::batch::chunk_id("us_s", 1)));
        assert!(!overdue(&batched, 60_000, grace));
        retry.owner = batched.owner.clone();
        assert!(!overdue(&retry, 110_000, grace));
    }
}
