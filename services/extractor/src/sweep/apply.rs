//! Applying a provider batch's result lines, each to its item once. An item's job is
//! leased to its chunk; a line is applied only while it still is (the compare-and-set
//! on the job record fences it), so a line applied again after a crash changes nothing.
//! What a line means is `core::batch::fate`; a success is validated against the
//! schema and the diff exactly as a lane answer is, kept on `FINDINGS_<R>` (the
//! publisher delivers it once), and the job records it validated with the tokens and
//! the cost of the line at the batch price.

use reviewlane_core::batch::{self, ChunkRecord, ItemFate, LineResult};
use reviewlane_core::job::{Budget, Charge, Event, JobRecord, JobState, Owner, TerminalReason, Tokens};
use reviewlane_core::messages::FindingsMessage;
use reviewlane_core::sweep::{SweepRecord, SweepState};
use reviewlane_shared::job_store::StoreError;

use super::{Coordinator, RoundError};
use crate::config::ResubmitVia;

/// While interactive reviews are about, the least gap after a result line: at most 100
/// lines a second.
const APPLY_GAP: std::time::Duration = std::time::Duration::from_millis(10);
/// While interactive reviews are about, the gap after a line is at least this many
/// times what applying it took.
const APPLY_SHARE: u32 = 5;
/// Interactive reviews are about when one asked for a call slot within this.
const INTERACTIVE_ABOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// While interactive reviews are about, the next line waits for those in flight here to
/// settle, for at most this: results go between interactive reviews, and still at least
/// a few a second while interactive work never stops.
const BETWEEN_AT_MOST: std::time::Duration = std::time::Duration::from_millis(250);

impl Coordinator {
    /// Applies every line of an ended batch (an item with none is `Missing`).
    pub(super) async fn apply_lines(
        &self,
        sweep: &SweepRecord,
        chunk: &ChunkRecord,
        lines: Vec<(String, LineResult)>,
    ) -> Result<(), RoundError> {
        let unrecognised =
            lines.iter().filter(|(_, l)| *l == LineResult::Retryable(batch::Retryable::Unrecognised)).count();
        if unrecognised > 0 {
            self.metrics.batch_lines_unrecognised(unrecognised as u64);
            tracing::warn!(lines = unrecognised, "result lines with an error code not known here: taken as not run");
        }
        let matched = batch::reconcile(&chunk.job_ids, lines);
        if matched.unknown + matched.repeated > 0 {
            tracing::warn!(
                unknown = matched.unknown,
                repeated = matched.repeated,
                "result lines naming no item of the batch, or repeated"
            );
        }
        let mut renewed = std::time::Instant::now();
        for (job_id, line) in matched.items {
            let started = tokio::time::Instant::now();
            self.apply_line(sweep, chunk, &job_id, line).await?;
            self.give_way(&mut renewed, started.elapsed()).await?;
        }
        Ok(())
    }

    /// Between two lines: while interactive reviews are about on this replica, waits
    /// `apply_gap` of what the line took and then until the interactive reviews in
    /// flight here have settled (at most `BETWEEN_AT_MOST`): results, and the deliveries
    /// that follow them, come at a bounded pace and between interactive reviews instead
    /// of all at once ahead of interactive findings; and renews the lead every third of its life, so that a long apply keeps it (one that
    /// lost it stops: the new lead applies the rest, and a line applied again changes
    /// nothing).
    async fn give_way(&self, renewed: &mut std::time::Instant, took: std::time::Duration) -> Result<(), RoundError> {
        if let Some(slots) = self.interactive.as_ref().filter(|s| s.interactive_within(INTERACTIVE_ABOUT)) {
            tokio::time::sleep(apply_gap(took)).await;
            slots.interactive_settled(BETWEEN_AT_MOST).await;
        }
        if renewed.elapsed() >= self.lead_ttl / 3 {
            self.still_leading().await?;
            *renewed = std::time::Instant::now();
        }
        Ok(())
    }

    /// A batch in which nothing ran: each item goes again (within its budget), but
    /// those in `refused` end `upstream_rejected`.
    pub(super) async fn resubmit_all(
        &self,
        sweep: &SweepRecord,
        chunk: &ChunkRecord,
        refused: &[String],
    ) -> Result<(), RoundError> {
        for job_id in &chunk.job_ids {
            let line = if refused.contains(job_id) {
                LineResult::Rejected { status: None }
            } else {
                LineResult::Retryable(batch::Retryable::Transient)
            };
            self.apply_line(sweep, chunk, job_id, line).await?;
        }
        Ok(())
    }

    /// A batch refused whole for the model's enqueued tokens: each item goes back to wait
    /// for a later batch without spending a resubmission (the refusal is counted on the
    /// congestion budget, which batch items do not otherwise use), or — a batch of one
    /// refused too often — ends `batch_token_limit`.
    pub(super) async fn refused_whole(
        &self,
        sweep: &SweepRecord,
        chunk: &ChunkRecord,
        refused: batch::Refused,
    ) -> Result<(), RoundError> {
        for job_id in &chunk.job_ids {
            let Some((rec, revision)) = self.jobs.get(job_id).await? else { continue };
            if rec.state != JobState::Running || !rec.owned_by(&Owner::ProviderBatch(chunk.chunk_id.clone())) {
                continue;
            }
            let read = (rec, revision);
            if refused == batch::Refused::End {
                self.end(sweep, read, TerminalReason::BatchTokenLimit, None).await?;
                continue;
            }
            let event = Event::RetryScheduled {
                generation: read.0.generation(),
                budget: Budget::Congestion,
                next_eligible_at_ms: self.clock.now_ms(),
                upstream_status: Some("batch".into()),
                invalid_output: None,
            };
            self.record(job_id, read, &event, None).await?;
        }
        Ok(())
    }

    /// One item's line, once: nothing when its job is no longer leased to the chunk.
    async fn apply_line(
        &self,
        sweep: &SweepRecord,
        chunk: &ChunkRecord,
        job_id: &str,
        line: LineResult,
    ) -> Result<(), RoundError> {
        let Some((rec, revision)) = self.jobs.get(job_id).await? else { return Ok(()) };
        if rec.state != JobState::Running || !rec.owned_by(&Owner::ProviderBatch(chunk.chunk_id.clone())) {
            return Ok(());
        }
        let generation = rec.generation();
        // Its batches so far, less those refused whole (not attempts of its own).
        let resubmitted = rec.attempts.leases.saturating_sub(1).saturating_sub(rec.attempts.congestion);
        let cancelled = sweep.state == SweepState::Cancelled;
        let read = (rec, revision);
        match batch::fate(line, resubmitted, self.settings.resubmissions, cancelled) {
            ItemFate::Validate { output, usage } => self.validated(sweep, read, &output, usage).await,
            ItemFate::Resubmit { .. } if read.0.deadline_ms.is_some_and(|d| self.clock.now_ms() >= d) => {
                self.end(sweep, read, TerminalReason::DeadlineExceeded, None).await
            }
            ItemFate::Resubmit { .. } if self.settings.resubmit_via == ResubmitVia::Lanes => {
                self.to_lanes(sweep, read).await
            }
            ItemFate::Resubmit { .. } => {
                let event = Event::RetryScheduled {
                    generation,
                    budget: Budget::Transient,
                    next_eligible_at_ms: self.clock.now_ms(),
                    upstream_status: Some("batch".into()),
                    invalid_output: None,
                };
                self.record(job_id, read, &event, None).await
            }
            ItemFate::Ended(reason) => self.end(sweep, read, reason, None).await,
        }
    }

    /// An item whose line did not run goes again through the batch lane: handed over
    /// (the chunk's lease ends, so no later provider batch takes it), then put there.
    /// Should the put fail (or the leader die first), the next cut finds it handed over
    /// and not on the lane, and puts it there.
    async fn to_lanes(&self, sweep: &SweepRecord, read: (JobRecord, u64)) -> Result<(), RoundError> {
        let job_id = read.0.job_id.clone();
        let Some(review) = self.review(&sweep.sweep_id, &job_id).await? else {
            return self.end(sweep, read, TerminalReason::Lost, None).await;
        };
        let event = Event::ToLanes { generation: read.0.generation() };
        match self.jobs.apply_charging(&job_id, Some(read), &event, None).await {
            Ok(_) => {}
            Err(StoreError::Transition(..)) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        self.put_on_lane(&review).await?;
        tracing::info!("sweep item sent again through the batch lane");
        Ok(())
    }

    /// A succeeded line: validated against the item's diff and kept, or — invalid —
    /// sent again within the schema budget (it was paid for either way).
    async fn validated(
        &self,
        sweep: &SweepRecord,
        read: (JobRecord, u64),
        output: &str,
        usage: Option<Tokens>,
    ) -> Result<(), RoundError> {
        let job_id = read.0.job_id.clone();
        let generation = read.0.generation();
        let charge = usage.map(|t| self.charge(t));
        let charge = charge.as_ref();
        if let Some(c) = charge {
            self.metrics.charged(c);
        }
        let Some(review) = self.review(&sweep.sweep_id, &job_id).await? else {
            return self.end(sweep, read, TerminalReason::Lost, charge).await;
        };
        let diff = review.parse_diff().unwrap_or(reviewlane_core::diff::Diff { files: Vec::new() });
        match reviewlane_core::findings::validate(&review.schema_version, output, &diff) {
            Ok(v) => {
                let (findings, quarantined) = (v.findings.len() as u32, v.quarantined.len() as u32);
                let result = FindingsMessage::of(&review, generation, &v, self.quarantine_raw_max);
                self.results.keep(&result, &async_nats::HeaderMap::new()).await?;
                let event = Event::Validated { generation, findings, quarantined, dropped: 0 };
                self.record(&job_id, read, &event, charge).await?;
                self.strip(sweep, &job_id).await;
                Ok(())
            }
            Err(invalid) => {
                tracing::warn!(reason = invalid.as_str(), "invalid provider output in a batch line");
                let schema_left = read.0.attempts.schema + 1 < self.budgets.schema;
                let batches = read.0.attempts.leases.saturating_sub(1).saturating_sub(read.0.attempts.congestion);
                let batches_left = batches < self.settings.resubmissions;
                if schema_left && batches_left {
                    let event = Event::RetryScheduled {
                        generation,
                        budget: Budget::Schema,
                        next_eligible_at_ms: self.clock.now_ms(),
                        upstream_status: Some("batch".into()),
                        invalid_output: Some(invalid.as_str().to_string()),
                    };
                    self.record(&job_id, read, &event, charge).await
                } else {
                    self.end(sweep, read, TerminalReason::InvalidOutput, charge).await
                }
            }
        }
    }

    /// The item ends with `reason`: its record says so (fenced by the chunk's lease), its
    /// review goes to the dead letters (as a lane job's would).
    async fn end(
        &self,
        sweep: &SweepRecord,
        read: (JobRecord, u64),
        reason: TerminalReason,
        charge: Option<&Charge>,
    ) -> Result<(), RoundError> {
        let job_id = read.0.job_id.clone();
        let event =
            Event::Terminate { reason, upstream_status: Some("batch".into()), generation: Some(read.0.generation()) };
        let attempts = read.0.attempts;
        if let Some(review) = self.review(&sweep.sweep_id, &job_id).await? {
            let payload = serde_json::to_vec(&review).expect("a review serializes");
            self.dead_letters.publish(&review, payload.into(), reason, attempts, self.clock.now_ms()).await?;
        }
        self.record(&job_id, read, &event, charge).await?;
        tracing::info!(reason = reason.as_str(), "sweep item ended");
        self.strip(sweep, &job_id).await;
        Ok(())
    }

    /// Applies `event` to the item's job from the record read (read again on a
    /// conflict); a refused transition means another writer got there first.
    async fn record(
        &self,
        job_id: &str,
        read: (JobRecord, u64),
        event: &Event,
        charge: Option<&Charge>,
    ) -> Result<(), RoundError> {
        match self.jobs.apply_charging(job_id, Some(read), event, charge).await {
            Ok(_) | Err(StoreError::Transition(..)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// A final item's review leaves the manifest (best effort: it only takes room).
    async fn strip(&self, sweep: &SweepRecord, job_id: &str) {
        if let Ok(Some(item)) = self.sweeps.item(&sweep.sweep_id, job_id).await
            && let Err(e) = self.sweeps.strip_item(&sweep.sweep_id, &item).await
        {
            tracing::warn!(kind = e.kind(), "stripping a final item's review from the manifest failed");
        }
    }

    /// A line's tokens as charged to its item: at the batch price, by the deployment
    /// whose batch API ran it.
    fn charge(&self, tokens: Tokens) -> Charge {
        let cost_micro_usd =
            self.price.map_or(0, |p| p.cost_micro_usd(tokens) * u64::from(self.settings.price_percent) / 100);
        Charge { tokens, cost_micro_usd, served_by: self.served_by.clone() }
    }
}

/// The gap after a result line that took `took` to apply, while interactive reviews are
/// about: `APPLY_SHARE` times that, at least `APPLY_GAP`. A line's writes take longer as
/// the store and the cores get busier, so results come slower exactly when they would
/// crowd interactive work, whatever the machine: applying takes at most one part in
/// `APPLY_SHARE + 1` of the time.
fn apply_gap(took: std::time::Duration) -> std::time::Duration {
    APPLY_GAP.max(took.saturating_mul(APPLY_SHARE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn results_are_applied_slower_as_each_line_takes_longer() {
        // A quick store: the floor, 100 lines a second.
        assert_eq!(apply_gap(Duration::from_micros(800)), Duration::from_millis(10));
        assert_eq!(apply_gap(Duration::from_millis(2)), Duration::from_millis(10));
        // A busy one: five times what the line took (about 43 lines a second at 4 ms).
        assert_eq!(apply_gap(Duration::from_millis(4)), Duration::from_millis(20));
        assert_eq!(apply_gap(Duration::from_millis(30)), Duration::from_millis(150));
    }
}
