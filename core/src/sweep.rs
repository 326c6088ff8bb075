//! Sweeps: many reviews as one manifest — a repository's files, an evaluation set, a
//! backlog — created, filled page by page, sealed, then followed as a whole. Each item
//! becomes an ordinary job linked to its sweep (its id derived from the sweep and the
//! item's own key, so a page added twice adds nothing twice), published once like any
//! review. Here: the sweep's record and its state machine, the item's entry in the
//! manifest, and the counts a sweep's progress is told by. Pure.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::batch::{self, ChunkRecord, ChunkStep};
use crate::job::{JobState, TerminalReason};
use crate::messages::ReviewMessage;
use crate::region::Region;

/// Where a sweep's items run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SweepMode {
    /// Through the provider's own batch API (at its batch price).
    ProviderBatch,
    /// Through the batch lane, one call each, yielding to interactive work.
    Lanes,
    /// The provider's batch API where the region's provider has one, else the lanes.
    Auto,
}

impl SweepMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SweepMode::ProviderBatch => "provider_batch",
            SweepMode::Lanes => "lanes",
            SweepMode::Auto => "auto",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SweepState {
    /// Items may be added; nothing runs yet.
    Open,
    /// No more items; they run.
    Sealed,
    /// Items not yet run end `cancelled`; results already paid for are still delivered.
    Cancelled,
}

impl SweepState {
    pub fn as_str(self) -> &'static str {
        match self {
            SweepState::Open => "open",
            SweepState::Sealed => "sealed",
            SweepState::Cancelled => "cancelled",
        }
    }
}

/// A sweep as its region keeps it (KV `SWEEPS_<R>`, key `sweep.<id>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepRecord {
    /// Region prefix, then a digest of (tenant, the sweep's idempotency key).
    pub sweep_id: String,
    pub tenant: String,
    pub region: Region,
    /// As asked.
    pub mode: SweepMode,
    /// Where the items run: `mode`, with `auto` resolved at create.
    pub runs_on: SweepMode,
    /// How long the sweep may take from its seal; its items' deadline.
    pub completion_window_ms: u64,
    /// Of mode and completion window: what makes a same-key create the same one.
    pub request_digest: String,
    pub state: SweepState,
    pub created_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelled_at_ms: Option<u64>,
    /// Every item was handed to where it runs (set after the seal, once all are).
    #[serde(default)]
    pub started: bool,
    /// Items added, as counted with each page (a page a crash cut short counts less;
    /// never more): what the sweep's size limit is held to.
    #[serde(default)]
    pub items_added: u64,
    /// Provider batch: every item is final and no batch of it is left (its coordinator
    /// looks at it no more). Read from records that name it `settled` too.
    #[serde(default, alias = "settled")]
    pub finished: bool,
}

/// What happens to a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepEvent {
    /// A page added this many items.
    Added(u64),
    Seal,
    /// Every item is handed to where it runs.
    Started,
    Cancel,
    /// Every item is final (a provider-batch sweep's coordinator is done with it).
    Finished,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SweepError {
    #[error("the sweep is {} and takes no more items", .0.as_str())]
    NotOpen(SweepState),
    #[error("the sweep is cancelled")]
    Cancelled,
}

impl SweepRecord {
    /// Items may be added only while it is open.
    pub fn may_add(&self) -> Result<(), SweepError> {
        match self.state {
            SweepState::Open => Ok(()),
            s => Err(SweepError::NotOpen(s)),
        }
    }

    /// The record after `event` at `now_ms`; `Ok(None)` when it changes nothing (a
    /// repeated seal or cancel).
    pub fn after(&self, event: SweepEvent, now_ms: u64) -> Result<Option<SweepRecord>, SweepError> {
        let mut next = self.clone();
        match (self.state, event) {
            (_, SweepEvent::Added(0)) => return Ok(None),
            (SweepState::Open, SweepEvent::Added(n)) => next.items_added += n,
            (state, SweepEvent::Added(_)) => return Err(SweepError::NotOpen(state)),
            (SweepState::Open, SweepEvent::Seal) => {
                next.state = SweepState::Sealed;
                next.sealed_at_ms = Some(now_ms);
            }
            (SweepState::Sealed, SweepEvent::Seal) => return Ok(None),
            (SweepState::Cancelled, SweepEvent::Seal) => return Err(SweepError::Cancelled),
            (_, SweepEvent::Started) if self.started => return Ok(None),
            (SweepState::Sealed, SweepEvent::Started) => next.started = true,
            (SweepState::Open, SweepEvent::Started) => return Err(SweepError::NotOpen(SweepState::Open)),
            (SweepState::Cancelled, SweepEvent::Started) => return Err(SweepError::Cancelled),
            (SweepState::Cancelled, SweepEvent::Cancel) => return Ok(None),
            (_, SweepEvent::Finished) if self.finished => return Ok(None),
            (SweepState::Open, SweepEvent::Finished) => return Err(SweepError::NotOpen(SweepState::Open)),
            (_, SweepEvent::Finished) => next.finished = true,
            (_, SweepEvent::Cancel) => {
                next.state = SweepState::Cancelled;
                next.cancelled_at_ms = Some(now_ms);
            }
        }
        Ok(Some(next))
    }

    /// The deadline of its items: the completion window from the seal (from now while
    /// it is open).
    pub fn items_deadline_ms(&self, now_ms: u64) -> u64 {
        self.sealed_at_ms.unwrap_or(now_ms).saturating_add(self.completion_window_ms)
    }
}

/// One item of a sweep's manifest (KV `SWEEPS_<R>`, key `item.<sweep id>.<job id>`):
/// its job, its key, and — until it is handed to where it runs — its review.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemEntry {
    pub job_id: String,
    /// The caller's key for the item, unique within the sweep.
    pub item_key: String,
    /// Of the item's review: what makes a same-key item the same one.
    pub request_digest: String,
    pub added_at_ms: u64,
    /// Its place in the page that added it: the items of one page share `added_at_ms`.
    #[serde(default)]
    pub position: u32,
    /// The review, until it is enqueued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub review: Option<ReviewMessage>,
}

/// An item's state as a sweep's progress counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemState {
    /// In the manifest, not yet handed to where it runs.
    Queued,
    /// Handed over, waiting for a call (or in a provider batch).
    Submitted,
    /// Being called, or waiting to retry.
    Running,
    /// Validated, not yet delivered.
    Validated,
    Published,
    /// Ended without findings (any reason but a cancel).
    Failed,
    Cancelled,
}

impl ItemState {
    pub const ALL: [ItemState; 7] = [
        ItemState::Queued,
        ItemState::Submitted,
        ItemState::Running,
        ItemState::Validated,
        ItemState::Published,
        ItemState::Failed,
        ItemState::Cancelled,
    ];

    /// The item's state from its job's (`None`: no job record yet — it never runs once
    /// its sweep is cancelled). In a provider batch it is submitted; waiting for the
    /// next one, queued.
    pub fn of(job: Option<&ItemJob>, sweep_cancelled: bool) -> ItemState {
        let Some(job) = job else {
            return if sweep_cancelled { ItemState::Cancelled } else { ItemState::Queued };
        };
        match (job.state, job.reason) {
            (JobState::Running, _) if job.in_batch => ItemState::Submitted,
            (JobState::RetryScheduled, _) if job.in_batch => ItemState::Queued,
            (JobState::Accepted | JobState::Waiting, _) => ItemState::Submitted,
            (JobState::Running | JobState::RetryScheduled, _) => ItemState::Running,
            (JobState::Validated, _) => ItemState::Validated,
            (JobState::Published, _) => ItemState::Published,
            (JobState::Terminal, Some(TerminalReason::Cancelled)) => ItemState::Cancelled,
            (JobState::Terminal, _) => ItemState::Failed,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ItemState::Queued => "queued",
            ItemState::Submitted => "submitted",
            ItemState::Running => "running",
            ItemState::Validated => "validated",
            ItemState::Published => "published",
            ItemState::Failed => "failed",
            ItemState::Cancelled => "cancelled",
        }
    }

    /// Nothing more happens to it.
    pub fn is_final(self) -> bool {
        matches!(self, ItemState::Published | ItemState::Failed | ItemState::Cancelled)
    }
}

/// What a sweep's progress reads of an item's job record (metadata only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemJob {
    pub state: JobState,
    pub reason: Option<TerminalReason>,
    pub tokens: crate::job::Tokens,
    pub cost_micro_usd: u64,
    /// Owned by a provider batch of the sweep (`job::Owner::ProviderBatch`).
    pub in_batch: bool,
}

impl ItemJob {
    pub fn of(rec: &crate::job::JobRecord) -> ItemJob {
        ItemJob {
            state: rec.state,
            reason: rec.reason,
            tokens: rec.tokens,
            cost_micro_usd: rec.cost_micro_usd,
            in_batch: rec.in_provider_batch(),
        }
    }
}

/// A sweep's progress: its items by state, the failed by reason, and the tokens of
/// their paid calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepCounts {
    pub total: u64,
    pub by_state: BTreeMap<ItemState, u64>,
    pub failed_by_reason: BTreeMap<TerminalReason, u64>,
    pub tokens: crate::job::Tokens,
    pub cost_micro_usd: u64,
}

impl SweepCounts {
    /// Adds one item whose job is `job` (`None`: no job yet) of a sweep that is or is
    /// not cancelled.
    pub fn add(&mut self, job: Option<&ItemJob>, sweep_cancelled: bool) {
        let state = ItemState::of(job, sweep_cancelled);
        self.total += 1;
        *self.by_state.entry(state).or_default() += 1;
        if let Some(job) = job {
            if state == ItemState::Failed {
                *self.failed_by_reason.entry(job.reason.unwrap_or(TerminalReason::Lost)).or_default() += 1;
            }
            self.tokens.input += job.tokens.input;
            self.tokens.output += job.tokens.output;
            self.cost_micro_usd += job.cost_micro_usd;
        }
    }

    pub fn of(&self, state: ItemState) -> u64 {
        self.by_state.get(&state).copied().unwrap_or(0)
    }

    /// Items in a final state.
    pub fn done(&self) -> u64 {
        ItemState::ALL.iter().filter(|s| s.is_final()).map(|s| self.of(*s)).sum()
    }

    /// Share of the items in a final state, 0 to 100 (100 for a sweep of none).
    pub fn percent_done(&self) -> f64 {
        if self.total == 0 { 100.0 } else { self.done() as f64 * 100.0 / self.total as f64 }
    }
}

/// The id of a tenant's sweep of idempotency key `key`: a create repeated finds the
/// same sweep.
pub fn sweep_id(region: Region, tenant: &str, key: &str) -> String {
    crate::job_id::derive(region, tenant, &format!("sweep\0{key}"))
}

/// The job id of a sweep's item of key `item_key`: an item added twice, or a seal
/// racing an add, names one job.
pub fn item_job_id(region: Region, tenant: &str, sweep_id: &str, item_key: &str) -> String {
    crate::job_id::derive(region, tenant, &format!("sweep\0{sweep_id}\0{item_key}"))
}

/// The ids of the deeper pass of a degraded review, derived from its id alone: the
/// submit that admits it names the deeper review before it exists, and a retry finds
/// the same one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeeperIds {
    /// The sweep's idempotency key.
    pub key: String,
    pub sweep_id: String,
    pub job_id: String,
}

impl DeeperIds {
    pub fn of(region: Region, tenant: &str, first: &str) -> DeeperIds {
        let key = format!("deeper\0{first}");
        let sweep_id = sweep_id(region, tenant, &key);
        let job_id = item_job_id(region, tenant, &sweep_id, first);
        DeeperIds { key, sweep_id, job_id }
    }
}

/// What the provider reports of a sweep's batches still running: OpenAI counts lines
/// as they finish, Anthropic reports nothing per line before a batch has ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunningBatches {
    pub batches: u64,
    /// Request lines in them.
    pub lines: u64,
    pub lines_succeeded: u64,
    pub lines_failed: u64,
}

impl RunningBatches {
    pub fn of(chunks: &[ChunkRecord]) -> RunningBatches {
        chunks.iter().filter(|c| c.step == ChunkStep::Created).fold(RunningBatches::default(), |mut r, c| {
            r.batches += 1;
            r.lines += c.job_ids.len() as u64;
            r.lines_succeeded += c.lines_succeeded;
            r.lines_failed += c.lines_failed;
            r
        })
    }

    /// Lines the provider has run, either way.
    pub fn lines_done(&self) -> u64 {
        self.lines_succeeded + self.lines_failed
    }
}

/// When the rest of a sealed sweep is likely done, at `now_ms`; `None` before anything
/// can be told, or when nothing is left. The one estimate of every read of a sweep.
///
/// On the lanes: at the pace of the items final since the seal. Through provider
/// batches (`chunks`, the sweep's): at the pace of the items final and the lines its
/// running batches report done, since the seal; when they report none, the mean
/// turnaround of its batches that ended after the last was sent.
pub fn estimate(rec: &SweepRecord, counts: &SweepCounts, chunks: &[ChunkRecord], now_ms: u64) -> Option<u64> {
    let sealed = rec.sealed_at_ms.filter(|_| rec.state == SweepState::Sealed && counts.done() < counts.total)?;
    if rec.runs_on != SweepMode::ProviderBatch {
        return batch::estimate(counts.done(), counts.total, sealed, now_ms, None);
    }
    let running = RunningBatches::of(chunks);
    if running.lines_done() > 0 {
        return batch::estimate(counts.done() + running.lines_done(), counts.total, sealed, now_ms, None);
    }
    let turnarounds: Vec<u64> = chunks.iter().filter_map(ChunkRecord::turnaround_ms).collect();
    let turnaround = (!turnarounds.is_empty()).then(|| turnarounds.iter().sum::<u64>() / turnarounds.len() as u64);
    let since = chunks.iter().filter_map(|c| c.submitted_at_ms).max().unwrap_or(sealed);
    batch::estimate(0, counts.total, since, now_ms, turnaround)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Tokens;

    fn sweep() -> SweepRecord {
        SweepRecord {
            sweep_id: "us_0".into(),
            tenant: "acme".into(),
            region: Region::Us,
            mode: SweepMode::Auto,
            runs_on: SweepMode::Lanes,
            completion_window_ms: 1_000,
            request_digest: String::new(),
            state: SweepState::Open,
            created_at_ms: 5,
            sealed_at_ms: None,
            cancelled_at_ms: None,
            started: false,
            items_added: 0,
            finished: false,
        }
    }

    #[test]
    fn a_sweep_takes_items_until_sealed_starts_once_and_cancels_from_any_state() {
        let open = sweep();
        assert!(open.may_add().is_ok());
        let grown = open.after(SweepEvent::Added(3), 1).unwrap().unwrap();
        assert_eq!(grown.items_added, 3);
        assert_eq!(open.after(SweepEvent::Added(0), 1), Ok(None));
        assert_eq!(open.items_deadline_ms(100), 1_100);
        assert_eq!(open.after(SweepEvent::Started, 10), Err(SweepError::NotOpen(SweepState::Open)));
        let sealed = open.after(SweepEvent::Seal, 10).unwrap().unwrap();
        assert_eq!((sealed.state, sealed.sealed_at_ms), (SweepState::Sealed, Some(10)));
        assert_eq!(sealed.may_add(), Err(SweepError::NotOpen(SweepState::Sealed)));
        // The completion window runs from the seal.
        assert_eq!(sealed.items_deadline_ms(500), 1_010);
        assert_eq!(sealed.after(SweepEvent::Seal, 20), Ok(None), "a repeated seal changes nothing");
        let started = sealed.after(SweepEvent::Started, 30).unwrap().unwrap();
        assert!(started.started);
        assert_eq!(started.after(SweepEvent::Started, 40), Ok(None));
        let cancelled = started.after(SweepEvent::Cancel, 50).unwrap().unwrap();
        assert_eq!((cancelled.state, cancelled.cancelled_at_ms), (SweepState::Cancelled, Some(50)));
        assert_eq!(cancelled.after(SweepEvent::Cancel, 60), Ok(None));
        assert_eq!(cancelled.after(SweepEvent::Seal, 60), Err(SweepError::Cancelled));
        assert_eq!(cancelled.may_add(), Err(SweepError::NotOpen(SweepState::Cancelled)));
        assert_eq!(sealed.after(SweepEvent::Added(1), 60), Err(SweepError::NotOpen(SweepState::Sealed)));
        // An open sweep may be cancelled too: nothing of it runs.
        assert_eq!(open.after(SweepEvent::Cancel, 70).unwrap().unwrap().state, SweepState::Cancelled);
        assert_eq!(open.after(SweepEvent::Finished, 70), Err(SweepError::NotOpen(SweepState::Open)));
        let finished = cancelled.after(SweepEvent::Finished, 80).unwrap().unwrap();
        assert!(finished.finished);
        assert_eq!(finished.after(SweepEvent::Finished, 90), Ok(None));
    }

    #[test]
    fn progress_counts_each_item_once_by_its_jobs_state() {
        let t = |i, o| Tokens { input: i, output: o };
        let job =
            |state, reason, tokens, cost| ItemJob { state, reason, tokens, cost_micro_usd: cost, in_batch: false };
        let mut c = SweepCounts::default();
        c.add(None, false);
        c.add(Some(&job(JobState::Waiting, None, t(0, 0), 0)), false);
        c.add(Some(&job(JobState::RetryScheduled, None, t(0, 0), 0)), false);
        c.add(Some(&job(JobState::Published, None, t(100, 20), 7)), false);
        c.add(Some(&job(JobState::Published, None, t(50, 10), 3)), false);
        c.add(Some(&job(JobState::Terminal, Some(TerminalReason::UpstreamRejected), t(0, 0), 0)), false);
        c.add(Some(&job(JobState::Terminal, Some(TerminalReason::Cancelled), t(0, 0), 0)), false);
        c.add(Some(&job(JobState::Validated, None, t(10, 1), 1)), false);
        assert_eq!(c.total, 8);
        let by: Vec<u64> = ItemState::ALL.iter().map(|s| c.of(*s)).collect();
        assert_eq!(by, [1, 1, 1, 1, 2, 1, 1]);
        assert_eq!(c.failed_by_reason.get(&TerminalReason::UpstreamRejected), Some(&1));
        assert_eq!(c.failed_by_reason.len(), 1, "a cancel is not a failure");
        assert_eq!((c.tokens, c.cost_micro_usd), (t(160, 31), 11));
        assert_eq!(c.done(), 4);
        assert_eq!(c.percent_done(), 50.0);
        assert_eq!(SweepCounts::default().percent_done(), 100.0);
        // An item never handed over of a cancelled sweep never runs.
        let mut cancelled = SweepCounts::default();
        cancelled.add(None, true);
        assert_eq!((cancelled.of(ItemState::Cancelled), cancelled.percent_done()), (1, 100.0));
        // In a provider batch: submitted; waiting for the next batch: queued.
        let batched = |state| ItemState::of(Some(&ItemJob { in_batch: true, ..job(state, None, t(0, 0), 0) }), false);
        assert_eq!(batched(JobState::Running), ItemState::Submitted);
        assert_eq!(batched(JobState::RetryScheduled), ItemState::Queued);
        assert_eq!(batched(JobState::Published), ItemState::Published);
    }

    fn items(total: u64, done: u64) -> SweepCounts {
        let mut c = SweepCounts::default();
        let job = |state| ItemJob { state, reason: None, tokens: Tokens::default(), cost_micro_usd: 0, in_batch: true };
        for i in 0..total {
            let state = if i < done { JobState::Published } else { JobState::Running };
            c.add(Some(&job(state)), false);
        }
        c
    }

    fn chunk(seq: u32, items: usize, step: ChunkStep, succeeded: u64, failed: u64) -> ChunkRecord {
        let ids = (0..items).map(|i| format!("us_{seq}_{i}")).collect();
        let mut c = ChunkRecord::new("us_0", "acme", seq, ids, 0);
        (c.step, c.lines_succeeded, c.lines_failed) = (step, succeeded, failed);
        c
    }

    #[test]
    fn running_batches_count_the_providers_live_lines_of_batches_not_yet_applied() {
        let chunks = [
            chunk(1, 10, ChunkStep::Created, 4, 1),
            chunk(2, 6, ChunkStep::Created, 0, 0),
            chunk(3, 8, ChunkStep::Applied, 8, 0),
            chunk(4, 5, ChunkStep::Intent, 0, 0),
        ];
        let running = RunningBatches::of(&chunks);
        assert_eq!(running, RunningBatches { batches: 2, lines: 16, lines_succeeded: 4, lines_failed: 1 });
        assert_eq!(running.lines_done(), 5);
    }

    #[test]
    fn one_estimate_reads_the_lanes_pace_or_the_providers_live_lines_or_the_batches_turnaround() {
        let sealed = |runs_on| SweepRecord { runs_on, state: SweepState::Sealed, sealed_at_ms: Some(1_000), ..sweep() };
        // Lanes: 2 of 10 final in 1 s: 4 s more.
        let lanes = sealed(SweepMode::Lanes);
        assert_eq!(estimate(&lanes, &items(10, 2), &[], 2_000), Some(6_000));
        assert_eq!(estimate(&lanes, &items(10, 0), &[], 2_000), None, "nothing to tell from yet");
        assert_eq!(estimate(&lanes, &items(10, 10), &[], 2_000), None, "nothing left");
        assert_eq!(estimate(&sweep(), &items(10, 2), &[], 2_000), None, "open: not yet");
        // Provider batches: the live lines count with the final items (1 + 4 of 10 in 1 s).
        let batched = sealed(SweepMode::ProviderBatch);
        let live = [chunk(1, 9, ChunkStep::Created, 3, 1)];
        assert_eq!(estimate(&batched, &items(10, 1), &live, 2_000), Some(3_000));
        // None reported (Anthropic): the turnaround of those that ended, from the last sent.
        let mut ended = chunk(1, 5, ChunkStep::Applied, 5, 0);
        (ended.submitted_at_ms, ended.ended_at_ms) = (Some(1_000), Some(4_000));
        let mut sent = chunk(2, 5, ChunkStep::Created, 0, 0);
        sent.submitted_at_ms = Some(4_500);
        assert_eq!(estimate(&batched, &items(10, 5), &[ended, sent.clone()], 5_000), Some(7_500));
        assert_eq!(estimate(&batched, &items(10, 0), &[sent], 5_000), None, "no batch has ended yet");
    }

    #[test]
    fn sweep_and_item_ids_are_derived_from_the_tenant_key_and_item_and_name_the_region() {
        let a = sweep_id(Region::Us, "acme", "nightly");
        assert_eq!(a, sweep_id(Region::Us, "acme", "nightly"), "a create repeated finds it");
        assert!(a.starts_with("us_"));
        assert_ne!(a, sweep_id(Region::Us, "globex", "nightly"));
        assert_ne!(a, sweep_id(Region::Eu, "acme", "nightly"));
        let item = item_job_id(Region::Us, "acme", &a, "src/a.rs");
        assert_eq!(item, item_job_id(Region::Us, "acme", &a, "src/a.rs"));
        assert_ne!(item, item_job_id(Region::Us, "acme", &a, "src/b.rs"));
        let deeper = DeeperIds::of(Region::Eu, "acme", "eu_first");
        assert_eq!(deeper, DeeperIds::of(Region::Eu, "acme", "eu_first"), "a retry finds the same pass");
        assert_eq!(deeper.sweep_id, sweep_id(Region::Eu, "acme", &deeper.key));
        assert_eq!(deeper.job_id, item_job_id(Region::Eu, "acme", &deeper.sweep_id, "eu_first"));
        assert!(deeper.job_id.starts_with("eu_"));
    }
}
