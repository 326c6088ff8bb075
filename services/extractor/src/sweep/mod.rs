//! The region's sweep coordinator: drives the sweeps that run through the provider's own
//! batch API. One replica of the region leads at a time (`Sweeps::lead`, a lease in
//! `SWEEPS_<R>`); its round, every `poll.first` at most:
//!
//! 1. **Cut.** A sealed sweep's items with no job yet (or waiting for a later batch) are
//!    cut into chunks within the provider's limits and the model's enqueued-token budget
//!    (`core::batch::Cut`); each chunk's record is created once (KV create), naming its
//!    items.
//! 2. **Lease.** Each item's job is leased to its chunk (created leased, or leased from
//!    `retry_scheduled`): the chunk owns it, and nothing else runs it.
//! 3. **Intent.** The leased items and the digest of their request lines are stored
//!    before anything is sent to the provider.
//! 4. **Send.** OpenAI: the input file is uploaded (its file id recorded), then the batch
//!    created with the chunk's id in its metadata; Anthropic: the batch created with the
//!    requests inline (`BatchApi::send`, a step at a time). The batch id is recorded
//!    right after. Neither provider makes a create idempotent, so a chunk this replica
//!    did not itself just take to that step (a crash, another leader) first looks for a
//!    batch it may have created (`BatchApi::find`) and creates one only when there is
//!    none.
//! 5. **Poll** with the backoff (`core::batch::PollBackoff`), keeping the live counts;
//!    a cancelled sweep's batches are cancelled at the provider.
//! 6. **Apply** each line to its item once (`apply`): the compare-and-set on the item's
//!    job, fenced by the chunk's lease, lets one apply through.
//!
//! A sweep whose items are all final is marked finished and looked at no more.

mod apply;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use reviewlane_core::batch::{self, BatchStep, ChunkError, ChunkEvent, ChunkRecord, ChunkStep, Cut, Triage};
use reviewlane_core::clock::SharedClock;
use reviewlane_core::job::{Event, JobRecord, JobState, Owner};
use reviewlane_core::messages::ReviewMessage;
use reviewlane_core::sweep::{SweepEvent, SweepMode, SweepRecord, SweepState};
use reviewlane_shared::job_store::{Created, JobStore, StoreError};
use reviewlane_shared::sweeps::{ApplyError, Sweeps};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::batch::{BatchApi, BatchApiError, Found, Sent};
use crate::config::BatchSettings;

/// Records read at once.
const AT_ONCE: usize = 32;

pub struct Coordinator {
    pub region: reviewlane_shared::Region,
    pub sweeps: Sweeps,
    pub jobs: JobStore,
    pub results: reviewlane_shared::results::Results,
    pub index: reviewlane_shared::job_index::JobIndex,
    pub dead_letters: reviewlane_shared::dead_letters::DeadLetters,
    pub client: Arc<dyn BatchApi>,
    pub settings: BatchSettings,
    pub clock: SharedClock,
    /// This replica, as the lead names it.
    pub owner: String,
    /// How long a lead lasts without being renewed.
    pub lead_ttl: Duration,
    /// The synchronous price of the model (the batch price is `settings.price_percent`).
    pub price: Option<crate::config::Price>,
    /// The deployment whose batch API runs the sweeps, and its class: what an item's
    /// record names as having answered it.
    pub served_by: reviewlane_core::job::ServedBy,
    pub budgets: crate::config::Budgets,
    pub quarantine_raw_max: usize,
    /// Tokens an item's call is metered for: its prompt's and the call's overhead.
    pub tokens_of: Arc<dyn Fn(&ReviewMessage) -> u64 + Send + Sync>,
    /// Whether an item is over one call's budget: a lane worker splits it into parts, a
    /// provider batch would send it whole. Such an item goes to the batch lane.
    pub too_large: Arc<dyn Fn(&ReviewMessage) -> bool + Send + Sync>,
    /// The region's JetStream, for the batch lane.
    pub js: async_nats::jetstream::Context,
    pub faults: reviewlane_shared::faults::Faults,
    pub metrics: crate::metrics::Metrics,
    /// This replica's call slots, once the scheduler runs: while interactive reviews
    /// are about, a provider batch's results are applied at a bounded pace.
    pub interactive: Option<Arc<crate::schedule::Slots>>,
    /// The provider key's shared quota: a 429 on any batch endpoint pauses the key's
    /// calls for its hint, for the fleet, as a lane call's does; no batch call is made
    /// while it is paused.
    pub quota: crate::quota::Quota,
    /// The KV key its lead is held under: one per class with a batch path
    /// (`reviewlane_shared::sweeps::lead_key`).
    pub lead_key: String,
    /// Whether it drives the provider-batch sweeps of a tenant: those whose batch
    /// reviews use its class.
    pub serves: Arc<dyn Fn(&str) -> bool + Send + Sync>,
}

/// What the leader remembers between rounds (all of it can be rebuilt from the store).
#[derive(Default)]
struct Memory {
    /// Sweeps whose items are to be cut again (seen first, or a chunk of theirs ended).
    to_cut: HashSet<String>,
    /// Chunks this leader took to their current step itself: no batch of theirs can
    /// exist unrecorded.
    fresh: HashSet<String>,
    /// Per chunk: polls so far and when the next is due.
    polls: HashMap<String, (u32, tokio::time::Instant)>,
    /// Per sweep: its batches refused for the model's enqueued tokens (cut smaller, a
    /// batch of one waiting longer each time).
    refusals: HashMap<String, batch::Refusals>,
    /// The enqueued-token budget believed since a refusal (the provider knows better
    /// than the configured one); `None`: the configured one.
    believed: Option<u64>,
    /// Enqueued tokens the region's live chunks held at the round's start.
    held: u64,
    seen: HashSet<String>,
    /// Batches that looked like a chunk's after a crash and whose results showed them
    /// another's: never looked at again.
    not_ours: HashSet<String>,
    /// Per sweep with no batch left: the items still open, which run on the lanes.
    /// Only they are read each round; once they are final the sweep is cut again (and
    /// finished).
    on_lanes: HashMap<String, Vec<String>>,
}

#[derive(Debug, thiserror::Error)]
enum RoundError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("batch endpoint: {0}")]
    Api(#[from] BatchApiError),
    #[error("another replica leads the provider batches now")]
    LeadLost,
    #[error(transparent)]
    Chunk(#[from] ChunkError),
}

impl From<ApplyError> for RoundError {
    fn from(e: ApplyError) -> Self {
        match e {
            ApplyError::Store(e) => RoundError::Store(e),
            ApplyError::Refused(r) => RoundError::Store(StoreError::other(r.to_string())),
        }
    }
}

impl Coordinator {
    /// Rounds until `stop`, every `poll.first` (within 250 ms and 1 s); the lead is
    /// renewed every third of its life and given up at the end.
    pub async fn run(self, stop: CancellationToken) {
        let every = self.settings.poll.first.clamp(Duration::from_millis(250), Duration::from_secs(1));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut memory = Memory::default();
        let mut led_at: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! { _ = tick.tick() => {}, _ = stop.cancelled() => break }
            if led_at.is_none_or(|at| at.elapsed() >= self.lead_ttl / 3) {
                let now = self.clock.now_ms();
                match self.sweeps.lead(&self.lead_key, &self.owner, now, self.lead_ttl.as_millis() as u64).await {
                    Ok(true) => {
                        if led_at.is_none() {
                            tracing::info!("leading the region's provider batches");
                            // What another leader (or this one before a crash) left is looked at anew.
                            memory = Memory::default();
                        }
                        led_at = Some(tokio::time::Instant::now());
                    }
                    Ok(false) => {
                        led_at = None;
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(kind = e.kind(), "reading the coordinator lead failed");
                        led_at = None;
                        continue;
                    }
                }
            }
            if self.quota.paused_for().is_some() {
                // A 429 (here or on a lane) paused the key: no batch call until it ends.
                continue;
            }
            match self.round(&mut memory, &stop).await {
                Err(RoundError::Api(BatchApiError::RateLimited { retry_after })) => {
                    self.rate_limited(retry_after).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a coordinator round stopped; the next one goes on from the store")
                }
                Ok(()) => {}
            }
        }
        let _ = self.sweeps.resign(&self.lead_key, &self.owner).await;
    }

    async fn round(&self, memory: &mut Memory, stop: &CancellationToken) -> Result<(), RoundError> {
        let sweeps: Vec<SweepRecord> = self
            .sweeps
            .all()
            .await?
            .into_iter()
            .filter(|s| s.runs_on == SweepMode::ProviderBatch && s.state != SweepState::Open && !s.finished)
            .filter(|s| (self.serves)(&s.tenant))
            .collect();
        let mut chunks = HashMap::new();
        for s in &sweeps {
            if memory.seen.insert(s.sweep_id.clone()) {
                memory.to_cut.insert(s.sweep_id.clone());
            }
            chunks.insert(s.sweep_id.clone(), self.sweeps.chunks(&s.sweep_id).await?);
        }
        let known: HashSet<String> = chunks.values().flatten().filter_map(|(c, _)| c.batch_id.clone()).collect();
        memory.held = chunks.values().flatten().filter(|(c, _)| c.holds_tokens()).map(|(c, _)| c.tokens).sum();
        for s in &sweeps {
            if stop.is_cancelled() {
                break;
            }
            let span = tracing::info_span!("sweep.round", job_id = %s.sweep_id, tenant = %s.tenant);
            let mine = chunks.remove(&s.sweep_id).unwrap_or_default();
            let held: Vec<ChunkRecord> = chunks.values().flatten().map(|(c, _)| c.clone()).collect();
            let after = self.drive(s, mine, &held, &known, memory).instrument(span).await?;
            chunks.insert(s.sweep_id.clone(), after);
        }
        Ok(())
    }

    /// One sweep's round: its live chunks moved on, its items cut again when something
    /// changed, and finished once all are final. Its chunks as they then stand.
    async fn drive(
        &self,
        sweep: &SweepRecord,
        mut chunks: Vec<(ChunkRecord, u64)>,
        others: &[ChunkRecord],
        known: &HashSet<String>,
        memory: &mut Memory,
    ) -> Result<Vec<(ChunkRecord, u64)>, RoundError> {
        for (chunk, revision) in chunks.iter_mut().filter(|(c, _)| c.step != ChunkStep::Applied) {
            self.advance(sweep, chunk, revision, known, memory).await?;
            if chunk.step == ChunkStep::Applied {
                memory.to_cut.insert(sweep.sweep_id.clone());
            }
        }
        if let Some(ids) = memory.on_lanes.remove(&sweep.sweep_id) {
            let mut left = Vec::new();
            for id in ids {
                match self.jobs.get(&id).await? {
                    Some((r, _)) if r.state.is_final() || r.state == JobState::Validated => {}
                    Some((r, _)) => {
                        self.keep_on_lane(sweep, &r).await?;
                        left.push(id);
                    }
                    None => left.push(id),
                }
            }
            if left.is_empty() {
                memory.to_cut.insert(sweep.sweep_id.clone());
            } else {
                memory.on_lanes.insert(sweep.sweep_id.clone(), left);
            }
        }
        if memory.to_cut.remove(&sweep.sweep_id) {
            let held: Vec<ChunkRecord> = others.iter().cloned().chain(chunks.iter().map(|(c, _)| c.clone())).collect();
            let cut = self.cut(sweep, &chunks, &held, memory).await?;
            for (mut chunk, mut revision) in cut {
                self.advance(sweep, &mut chunk, &mut revision, known, memory).await?;
                if chunk.step == ChunkStep::Applied {
                    // Ended as soon as it was sent (refused at once): what it held is cut again.
                    memory.to_cut.insert(sweep.sweep_id.clone());
                }
                chunks.push((chunk, revision));
            }
        }
        Ok(chunks)
    }

    /// Cuts the sweep's items that wait for a batch into new chunks (each record created
    /// once); ends those of a cancelled sweep; finishes a sweep with nothing left.
    async fn cut(
        &self,
        sweep: &SweepRecord,
        chunks: &[(ChunkRecord, u64)],
        held: &[ChunkRecord],
        memory: &mut Memory,
    ) -> Result<Vec<(ChunkRecord, u64)>, RoundError> {
        let (waiting, open) = self.triage(sweep, chunks).await?;
        let live = chunks.iter().any(|(c, _)| c.step != ChunkStep::Applied);
        if !live && open.is_empty() {
            self.finish(sweep).await?;
            return Ok(Vec::new());
        }
        if waiting.is_empty() {
            if !live {
                // What is left runs on the lanes: followed round by round, to finish it.
                memory.on_lanes.insert(sweep.sweep_id.clone(), open);
            }
            return Ok(Vec::new());
        }
        let refusals = memory.refusals.get(&sweep.sweep_id).copied().unwrap_or_default();
        if self.clock.now_ms() < refusals.not_before_ms {
            // A batch of one was refused: the next waits.
            memory.to_cut.insert(sweep.sweep_id.clone());
            return Ok(Vec::new());
        }
        let limits = refusals.limits(self.settings.limits(self.client.limits()));
        let room = batch::enqueued_room(held, memory.believed.or(self.settings.enqueued_tokens));
        let seq = chunks.iter().map(|(c, _)| c.seq).max().unwrap_or(0);
        let alone = !held.iter().any(ChunkRecord::holds_tokens);
        let (out, left) = self.cut_waiting(sweep, waiting, (limits, room, alone), seq).await?;
        if left {
            // The rest waits for a batch to end and give its tokens back.
            memory.to_cut.insert(sweep.sweep_id.clone());
        }
        Ok(out)
    }

    /// Reads every item's job and sorts the items (`batch::triage`): those waiting for a
    /// batch, and those not final (waiting included). Ends the waiting items of a
    /// cancelled sweep, and puts again on the lane an item handed there but not on it.
    async fn triage(
        &self,
        sweep: &SweepRecord,
        chunks: &[(ChunkRecord, u64)],
    ) -> Result<(Vec<String>, Vec<String>), RoundError> {
        let cancelled = sweep.state == SweepState::Cancelled;
        let mut ids = self.sweeps.item_ids(&sweep.sweep_id).await?;
        ids.sort();
        let in_chunks: HashSet<&String> =
            chunks.iter().filter(|(c, _)| c.step == ChunkStep::Leasing).flat_map(|(c, _)| &c.job_ids).collect();
        let mut read =
            futures::stream::iter(ids).map(|id| async move { (self.jobs.get(&id).await, id) }).buffered(AT_ONCE);
        let (mut waiting, mut open) = (Vec::new(), Vec::new());
        while let Some((job, id)) = read.next().await {
            let job = job?;
            if let Some((r, _)) = &job {
                self.keep_on_lane(sweep, r).await?;
            }
            match batch::triage(job.as_ref().map(|(r, _)| r), in_chunks.contains(&id), cancelled) {
                Triage::Done => {}
                Triage::Open => open.push(id),
                Triage::Waits => {
                    open.push(id.clone());
                    waiting.push(id);
                }
                Triage::Cancel => {
                    if let Some(read) = job {
                        self.end_cancelled(&id, read).await?;
                    }
                }
            }
        }
        Ok((waiting, open))
    }

    /// Cuts `waiting` into chunks after `seq`, within the limits and the enqueued-token
    /// `room` (`alone`: no chunk holds any), each record created once; an item over one
    /// call's budget goes to the batch lane instead. The chunks, and whether items are
    /// left for a later cut (no room now).
    async fn cut_waiting(
        &self,
        sweep: &SweepRecord,
        waiting: Vec<String>,
        (limits, mut room, alone): (batch::BatchLimits, Option<u64>, bool),
        mut seq: u32,
    ) -> Result<(Vec<(ChunkRecord, u64)>, bool), RoundError> {
        let mut out = Vec::new();
        let mut rest = waiting.into_iter().peekable();
        while rest.peek().is_some() {
            let mut cut = Cut::new(limits, room, alone && out.is_empty());
            let mut ids = Vec::new();
            while let Some(id) = rest.peek() {
                let Some(review) = self.review(&sweep.sweep_id, id).await? else {
                    rest.next();
                    continue;
                };
                if (self.too_large)(&review) {
                    self.large_to_lane(&review).await?;
                    rest.next();
                    continue;
                }
                let bytes = review.diff_text().len() + 2048;
                if !cut.take(bytes, (self.tokens_of)(&review)) {
                    break;
                }
                ids.push(rest.next().expect("peeked"));
            }
            if ids.is_empty() {
                return Ok((out, rest.peek().is_some()));
            }
            seq += 1;
            let mut chunk = ChunkRecord::new(&sweep.sweep_id, &sweep.tenant, seq, ids, self.clock.now_ms());
            chunk.tokens = cut.tokens;
            room = room.map(|r| r.saturating_sub(cut.tokens));
            let made = self.sweeps.create_chunk(&chunk).await?;
            tracing::info!(chunk = seq, items = made.0.job_ids.len(), tokens = made.0.tokens, "provider batch cut");
            out.push(made);
        }
        Ok((out, false))
    }

    /// An item handed to the lanes but not on the lane (the put failed, or a leader
    /// died between the hand-over and the put) is put there now.
    async fn keep_on_lane(&self, sweep: &SweepRecord, rec: &JobRecord) -> Result<(), RoundError> {
        if rec.state == JobState::RetryScheduled
            && rec.owned_by(&Owner::Lanes)
            && !reviewlane_shared::lanes::holds(&self.js, rec).await?
            && let Some(review) = self.review(&sweep.sweep_id, &rec.job_id).await?
        {
            self.put_on_lane(&review).await?;
            tracing::info!("sweep item handed to the lanes put there again");
        }
        Ok(())
    }

    /// An item over one call's budget, never in a provider batch: its review goes to the
    /// batch lane, where a worker splits it into parts, and its job is made (the lane
    /// worker makes it from the message too, whichever is first).
    async fn large_to_lane(&self, review: &ReviewMessage) -> Result<(), RoundError> {
        self.put_on_lane(review).await?;
        if let Created::New(rec, _) = self.jobs.create(&review.record()).await?
            && let Err(e) = self.index.add(&rec, &review.metadata.repository).await
        {
            tracing::warn!(kind = e.kind(), "indexing a sweep item for listings failed");
        }
        tracing::info!("sweep item over one call's budget: sent through the batch lane");
        Ok(())
    }

    /// Puts an item's review on the batch lane, as a submit does (the lane drops a copy
    /// by `Nats-Msg-Id`, and a worker a copy whose job has moved on).
    pub(super) async fn put_on_lane(&self, review: &ReviewMessage) -> Result<(), StoreError> {
        self.faults.check(reviewlane_shared::faults::point::COORDINATOR_LANE)?;
        let payload = serde_json::to_vec(review).map_err(StoreError::other)?;
        reviewlane_shared::lanes::put(&self.js, review, payload).await.map_err(StoreError::publish)
    }

    /// The review an item of the manifest keeps (until it is final).
    async fn review(&self, sweep_id: &str, job_id: &str) -> Result<Option<ReviewMessage>, StoreError> {
        Ok(self.sweeps.item(sweep_id, job_id).await?.and_then(|i| i.review))
    }

    /// Marks a sweep finished: every item final, no batch of it left.
    async fn finish(&self, sweep: &SweepRecord) -> Result<(), RoundError> {
        self.sweeps.apply(&sweep.tenant, &sweep.sweep_id, SweepEvent::Finished, self.clock.now_ms()).await?;
        tracing::info!("sweep finished: every item is final");
        Ok(())
    }

    /// Ends an item of a cancelled sweep that waits for a later batch.
    async fn end_cancelled(&self, job_id: &str, read: (JobRecord, u64)) -> Result<(), RoundError> {
        let generation = read.0.generation();
        let event = Event::Terminate {
            reason: reviewlane_core::job::TerminalReason::Cancelled,
            upstream_status: None,
            generation: Some(generation),
        };
        match self.jobs.apply_from(job_id, Some(read), &event).await {
            Ok(_) | Err(StoreError::Transition(..)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// A batch endpoint answered 429: the key pauses for its hint (the poll backoff's
    /// first step without one), for every replica.
    async fn rate_limited(&self, retry_after: Option<Duration>) {
        let pause = retry_after.unwrap_or(self.settings.poll.first);
        tracing::info!(pause_ms = pause.as_millis() as u64, "a batch endpoint answered 429: the key pauses");
        if let Err(e) = self.quota.pause(pause).await {
            tracing::warn!(error = %e, "recording the key's pause failed");
        }
    }

    /// Renews the lead before a step that must happen under it (anything sent to create
    /// a batch): a round that outlived its lead stops.
    async fn still_leading(&self) -> Result<(), RoundError> {
        let ttl = self.lead_ttl.as_millis() as u64;
        match self.sweeps.lead(&self.lead_key, &self.owner, self.clock.now_ms(), ttl).await? {
            true => Ok(()),
            false => Err(RoundError::LeadLost),
        }
    }

    /// Moves a chunk on as far as it goes now: lease, intent, send, poll, apply.
    async fn advance(
        &self,
        sweep: &SweepRecord,
        chunk: &mut ChunkRecord,
        revision: &mut u64,
        known: &HashSet<String>,
        memory: &mut Memory,
    ) -> Result<(), RoundError> {
        let span = tracing::info_span!("batch.chunk", chunk = chunk.seq, provider = self.client.provider());
        async {
            // The request lines built while leasing, sent at the intent that follows.
            let mut built = None;
            loop {
                let fresh = memory.fresh.contains(&chunk.chunk_id);
                match chunk.step {
                    ChunkStep::Leasing => {
                        let job_ids = self.lease(sweep, chunk).await?;
                        let (mut input_digest, mut newest_before) = (String::new(), None);
                        if !job_ids.is_empty() {
                            let lines;
                            (lines, input_digest) = digested(self.lines(sweep, &job_ids).await?).await;
                            built = Some(lines);
                            newest_before = self.client.mark().await?;
                        }
                        self.step(chunk, revision, ChunkEvent::Leased { job_ids, input_digest, newest_before }).await?;
                        memory.fresh.insert(chunk.chunk_id.clone());
                    }
                    ChunkStep::Intent | ChunkStep::Uploaded if !fresh => {
                        if !self.look_for_batch(chunk, revision, known, memory).await? {
                            return Ok(());
                        }
                    }
                    ChunkStep::Intent => {
                        self.still_leading().await?;
                        let lines = match built.take() {
                            Some(lines) => lines,
                            None => {
                                let (lines, now) = digested(self.lines(sweep, &chunk.job_ids).await?).await;
                                if chunk.input_digest.as_deref() != Some(now.as_str()) {
                                    tracing::warn!(
                                        "a chunk's request lines differ from its intent; sent as they now are"
                                    );
                                }
                                lines
                            }
                        };
                        let sent = self.client.send(chunk, &lines).await?;
                        self.sent(chunk, revision, sent).await?;
                    }
                    ChunkStep::Uploaded => {
                        self.still_leading().await?;
                        let sent = self.client.send(chunk, &[]).await?;
                        self.sent(chunk, revision, sent).await?;
                    }
                    ChunkStep::Created => {
                        if !self.poll(sweep, chunk, revision, memory).await? {
                            return Ok(());
                        }
                    }
                    ChunkStep::Applied => {
                        memory.polls.remove(&chunk.chunk_id);
                        memory.fresh.remove(&chunk.chunk_id);
                        return Ok(());
                    }
                }
            }
        }
        .instrument(span)
        .await
    }

    /// A chunk this leader did not itself take to its step (a crash, another leader): a
    /// batch may exist for it, so it is looked for before one is created — at the poll
    /// backoff's pace while one that may be its own still runs. Whether the chunk may
    /// move on now (its batch found and recorded, or none: it is sent).
    async fn look_for_batch(
        &self,
        chunk: &mut ChunkRecord,
        revision: &mut u64,
        known: &HashSet<String>,
        memory: &mut Memory,
    ) -> Result<bool, RoundError> {
        let now = tokio::time::Instant::now();
        let (looks, due) = memory.polls.get(&chunk.chunk_id).copied().unwrap_or((0, now));
        if now < due {
            return Ok(false);
        }
        match self.client.find(chunk, known, &mut memory.not_ours).await? {
            Found::Ours(found) => {
                tracing::info!("found the batch created before its id was recorded");
                self.sent(chunk, revision, Sent::Created { batch_id: found }).await?;
            }
            Found::Unproven => {
                // Looked at again later; never created a second time meanwhile.
                tracing::info!("a batch that may be this chunk's is still running: waiting for proof");
                let wait = self.settings.poll.delay(looks, None);
                memory.polls.insert(chunk.chunk_id.clone(), (looks + 1, now + wait));
                return Ok(false);
            }
            Found::None => {}
        }
        memory.fresh.insert(chunk.chunk_id.clone());
        memory.polls.remove(&chunk.chunk_id);
        Ok(true)
    }

    /// Records what a step of sending did: the uploaded input, or the created batch.
    async fn sent(&self, chunk: &mut ChunkRecord, revision: &mut u64, sent: Sent) -> Result<(), RoundError> {
        let event = match sent {
            Sent::Uploaded { file_id } => ChunkEvent::Uploaded { file_id },
            Sent::Created { batch_id } => ChunkEvent::Created { batch_id },
        };
        self.step(chunk, revision, event).await?;
        if chunk.step == ChunkStep::Created {
            tracing::info!(items = chunk.job_ids.len(), "provider batch created");
        }
        Ok(())
    }

    /// Moves the chunk on by `event` (`ChunkRecord::after`, where its step moves) and
    /// writes it.
    async fn step(&self, chunk: &mut ChunkRecord, revision: &mut u64, event: ChunkEvent) -> Result<(), RoundError> {
        *chunk = chunk.after(event, self.clock.now_ms())?;
        self.write(chunk, revision).await?;
        Ok(())
    }

    /// Writes the chunk's record from its revision.
    async fn write(&self, chunk: &ChunkRecord, revision: &mut u64) -> Result<(), StoreError> {
        *revision = self.sweeps.update_chunk(chunk, *revision).await?;
        Ok(())
    }

    /// Polls the chunk's batch when due; applies its lines once it ends. Whether the
    /// chunk moved on (else it waits for its next poll).
    async fn poll(
        &self,
        sweep: &SweepRecord,
        chunk: &mut ChunkRecord,
        revision: &mut u64,
        memory: &mut Memory,
    ) -> Result<bool, RoundError> {
        let now = tokio::time::Instant::now();
        let (polls, due) = memory.polls.get(&chunk.chunk_id).copied().unwrap_or((0, now));
        if now < due {
            return Ok(false);
        }
        let batch_id = chunk.batch_id.clone().expect("a created chunk has its batch id");
        if sweep.state == SweepState::Cancelled && !chunk.cancel_sent {
            match self.client.cancel(&batch_id).await {
                Ok(()) | Err(BatchApiError::Refused { .. }) => {
                    self.step(chunk, revision, ChunkEvent::CancelSent).await?;
                    tracing::info!("provider batch cancelled with its sweep");
                }
                Err(e) => return Err(e.into()),
            }
        }
        let polled = match self.client.get(&batch_id).await {
            Ok(p) => p,
            Err(BatchApiError::RateLimited { retry_after }) => {
                let wait = self.settings.poll.delay(polls, retry_after);
                memory.polls.insert(chunk.chunk_id.clone(), (polls + 1, now + wait));
                self.rate_limited(retry_after).await;
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        match batch::step(&polled.status) {
            BatchStep::Poll => {
                if (polled.succeeded, polled.failed) != (chunk.lines_succeeded, chunk.lines_failed) {
                    let counted = ChunkEvent::Counted { succeeded: polled.succeeded, failed: polled.failed };
                    self.step(chunk, revision, counted).await?;
                }
                let wait = self.settings.poll.delay(polls, None);
                memory.polls.insert(chunk.chunk_id.clone(), (polls + 1, now + wait));
                Ok(false)
            }
            BatchStep::Collect => {
                let lines = self.client.results(&polled).await?;
                self.apply_lines(sweep, chunk, lines).await?;
                self.ended(chunk, revision).await?;
                memory.refusals.entry(sweep.sweep_id.clone()).or_default().ran();
                Ok(true)
            }
            BatchStep::TokenLimit => {
                // Refused whole for the model's enqueued tokens: not an attempt of its items.
                let now = self.clock.now_ms();
                let refused = memory.refusals.entry(sweep.sweep_id.clone()).or_default().refused(
                    chunk.job_ids.len(),
                    now,
                    self.settings.poll,
                );
                let before = memory.believed.or(self.settings.enqueued_tokens);
                // What the round started with, or at least this batch (cut in this round).
                memory.believed = batch::believed_budget(before, memory.held.max(chunk.tokens), chunk.tokens);
                tracing::warn!(
                    items = chunk.job_ids.len(),
                    believed_budget = memory.believed,
                    "provider batch refused for the model's enqueued tokens; its items go again, in a smaller batch"
                );
                self.refused_whole(sweep, chunk, refused).await?;
                self.ended(chunk, revision).await?;
                Ok(true)
            }
            BatchStep::Reject { lines } => {
                tracing::warn!(lines = lines.len(), "provider batch input refused");
                let refused = if lines.is_empty() { chunk.job_ids.clone() } else { chunk.jobs_of_lines(&lines) };
                self.resubmit_all(sweep, chunk, &refused).await?;
                self.ended(chunk, revision).await?;
                Ok(true)
            }
        }
    }

    async fn ended(&self, chunk: &mut ChunkRecord, revision: &mut u64) -> Result<(), RoundError> {
        self.step(chunk, revision, ChunkEvent::Ended).await?;
        tracing::info!(turnaround_ms = chunk.turnaround_ms(), "provider batch applied");
        Ok(())
    }

    /// Leases each of the chunk's items to it: a new item's job is created leased (it
    /// is never without an owner), one waiting for a later batch is leased from there.
    /// The items now leased to it (an item that ended meanwhile, a cancelled one, is
    /// left out).
    async fn lease(&self, sweep: &SweepRecord, chunk: &ChunkRecord) -> Result<Vec<String>, RoundError> {
        let mut leased = Vec::new();
        for id in &chunk.job_ids {
            let Some(review) = self.review(&sweep.sweep_id, id).await? else { continue };
            let now = self.clock.now_ms();
            let owner = Owner::ProviderBatch(chunk.chunk_id.clone());
            let event =
                Event::Leased { owner: owner.clone(), lease_expires_at_ms: review.deadline_ms.unwrap_or(now).max(now) };
            let mine = |r: &JobRecord| r.state == JobState::Running && r.owned_by(&owner);
            let existing = match self.jobs.get(id).await? {
                Some(read) => read,
                None => {
                    let rec = reviewlane_core::job::transition(&review.record(), &event, now)
                        .expect("a new job can be leased");
                    match self.jobs.create(&rec).await? {
                        Created::New(rec, _) => {
                            if let Err(e) = self.index.add(&rec, &review.metadata.repository).await {
                                tracing::warn!(kind = e.kind(), "indexing a sweep item for listings failed");
                            }
                            leased.push(id.clone());
                            continue;
                        }
                        Created::Exists(_) => self.jobs.get(id).await?.ok_or(StoreError::NotFound)?,
                    }
                }
            };
            if mine(&existing.0) {
                leased.push(id.clone());
                continue;
            }
            if sweep.state == SweepState::Cancelled
                || !(existing.0.state == JobState::RetryScheduled && existing.0.in_provider_batch())
            {
                continue;
            }
            match self.jobs.apply_from(id, Some(existing), &event).await {
                Ok(_) => leased.push(id.clone()),
                Err(StoreError::Transition(_, current)) if mine(&current) => leased.push(id.clone()),
                Err(StoreError::Transition(..)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(leased)
    }

    /// The request lines of the items `job_ids`, in order, built from the manifest.
    async fn lines(&self, sweep: &SweepRecord, job_ids: &[String]) -> Result<Vec<serde_json::Value>, RoundError> {
        let mut out = Vec::with_capacity(job_ids.len());
        for id in job_ids {
            let review = self.review(&sweep.sweep_id, id).await?.ok_or(StoreError::NotFound)?;
            let text = review.diff_text();
            let diff = review.parse_diff().unwrap_or(reviewlane_core::diff::Diff { files: Vec::new() });
            let req = crate::provider::ProviderRequest {
                job_id: &review.job_id,
                region: review.region,
                schema_version: &review.schema_version,
                diff_text: &text,
                diff: &diff,
                review_depth: review.review_depth,
                part: None,
            };
            let custom = batch::custom_id(id).ok_or_else(|| StoreError::other("a job id that is no custom id"))?;
            out.push(self.client.line(custom, &req));
        }
        Ok(out)
    }
}

/// The lines with their digest, worked out on the blocking pool: a chunk's lines are
/// tens of MB of JSON, and the runtime's workers also pull and lease interactive
/// reviews.
async fn digested(lines: Vec<serde_json::Value>) -> (Vec<serde_json::Value>, String) {
    tokio::task::spawn_blocking(move || {
        let d = digest(&lines);
        (lines, d)
    })
    .await
    .expect("a digest does not panic")
}

/// The digest of a chunk's request lines, in order.
fn digest(lines: &[serde_json::Value]) -> String {
    let bytes: Vec<Vec<u8>> = lines.iter().map(|l| l.to_string().into_bytes()).collect();
    let parts: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    reviewlane_core::job_id::sha256_hex(&parts)
}

/// Why this region's sweeps cannot run through its provider's batch API, if they
/// cannot: said at start and to a caller asking for `provider_batch`.
pub fn why_no_batches(
    provider: &crate::config::ProviderConfig,
    region: reviewlane_shared::Region,
    settings: &BatchSettings,
) -> Option<String> {
    use crate::config::ProviderConfig;
    match provider {
        _ if !settings.enabled => {
            Some(format!("provider batches are off for region {region} (REVIEWLANE_PROVIDER_BATCH=off)"))
        }
        ProviderConfig::Builtin => Some("the built-in analyzer has no batch API".into()),
        ProviderConfig::Anthropic { .. } if region == reviewlane_shared::Region::Eu => Some(format!(
            "Anthropic's Message Batches API offers no EU processing location, so batch data could not stay in region {region}"
        )),
        ProviderConfig::AzureOpenAi(d) if d.batch_deployment.is_none() => Some(format!(
            "no Azure global batch deployment is configured for region {region} (REVIEWLANE_AZURE_BATCH_DEPLOYMENT)"
        )),
        ProviderConfig::OpenAi { .. } | ProviderConfig::Anthropic { .. } | ProviderConfig::AzureOpenAi(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProviderConfig;
    use reviewlane_shared::Region;

    #[test]
    fn batches_run_where_the_provider_has_a_batch_api_that_keeps_the_data_in_region() {
        let on = BatchSettings::default();
        let openai = |r| ProviderConfig::OpenAi {
            base_url: "http://127.0.0.1:1/v1".into(),
            model: "m".into(),
            api_key: None,
            endpoint_region: r,
            schema_dialect: Default::default(),
        };
        let anthropic = |r| ProviderConfig::Anthropic {
            base_url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            api_key: None,
            endpoint_region: r,
            max_tokens: 1024,
        };
        assert_eq!(why_no_batches(&openai(Region::Us), Region::Us, &on), None);
        assert_eq!(why_no_batches(&openai(Region::Eu), Region::Eu, &on), None);
        assert_eq!(why_no_batches(&anthropic(Region::Us), Region::Us, &on), None);
        let eu = why_no_batches(&anthropic(Region::Eu), Region::Eu, &on).expect("refused in the EU");
        assert!(eu.contains("no EU processing location"), "{eu}");
        assert!(why_no_batches(&ProviderConfig::Builtin, Region::Us, &on).is_some());
        let off = BatchSettings { enabled: false, ..on };
        assert!(why_no_batches(&openai(Region::Us), Region::Us, &off).unwrap().contains("off"));
        // Azure: through its global batch deployment, in the resource's own region.
        let azure = |batch_deployment: Option<&str>| {
            ProviderConfig::AzureOpenAi(crate::config::AzureDeployment {
                endpoint: "http://127.0.0.1:1".into(),
                deployment: "d".into(),
                model: "m".into(),
                api_version: "2024-10-21".into(),
                auth: crate::config::AzureAuth::ApiKey(None),
                endpoint_region: Region::Eu,
                schema_dialect: Default::default(),
                batch_deployment: batch_deployment.map(str::to_string),
            })
        };
        assert_eq!(why_no_batches(&azure(Some("d-batch")), Region::Eu, &on), None);
        let none = why_no_batches(&azure(None), Region::Eu, &on).expect("no batch deployment");
        assert!(none.contains("REVIEWLANE_AZURE_BATCH_DEPLOYMENT"), "{none}");
    }
}
