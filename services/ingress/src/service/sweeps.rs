//! Sweeps, the writes: `CreateSweep`, `AddSweepItems`, `SealSweep`, `CancelSweep`, and
//! the deeper pass of a degraded review (a sweep of one); the reads are in
//! `sweep_reads`. A sweep and its manifest live in its region's `SWEEPS_<R>`
//! (`reviewlane_shared::sweeps`); each item is checked as a submit is (`submit::check`)
//! and, when the sweep is sealed, becomes a job of the batch lane linked to its sweep —
//! or is left to the region's sweep coordinator, for the provider's batch API.
//! Its job id is derived from the sweep and the item's key, so a page added twice, a
//! seal repeated or a seal racing an add hands each item over once.

use futures::StreamExt;
use reviewlane_api::proto::{AddSweepItemsRequest, AddSweepItemsResponse, CreateSweepRequest, SubmitReviewRequest};
use reviewlane_core::sweep::{
    self, DeeperIds, ItemEntry, RunningBatches, SweepCounts, SweepEvent, SweepMode, SweepRecord, SweepState,
};
use reviewlane_shared::sweeps::{ApplyError, Made, Sweeps};

use super::submit::{CheckedSubmit, Limits, check};
use super::*;

/// A sweep's completion window unless the request sets one.
const DEFAULT_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// The longest completion window (the batch lane keeps a review at most a week).
const MAX_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
/// Items of one `AddSweepItems` page at most.
const MAX_PAGE_ITEMS: usize = 1000;
/// Items a sweep holds at most.
const MAX_ITEMS: usize = 100_000;
/// Items handed over, or records read, at once.
pub(super) const AT_ONCE: usize = 32;
const MAX_KEY: usize = 256;

pub(super) type SweepStream = Pin<Box<dyn Stream<Item = Result<proto::WatchSweepResponse, Status>> + Send>>;

pub(super) fn sweeps(handle: &RegionHandle) -> Sweeps {
    Sweeps::new(handle.layout.js.clone(), handle.layout.sweeps.clone())
}

impl From<ApplyError> for ApiError {
    fn from(e: ApplyError) -> Self {
        match e {
            ApplyError::Refused(reviewlane_core::sweep::SweepError::NotOpen(_)) => ApiError::FailedPrecondition {
                reason: Reason::SweepNotOpen,
                what: "the sweep is sealed or cancelled and takes no more items".into(),
            },
            ApplyError::Refused(reviewlane_core::sweep::SweepError::Cancelled) => {
                ApiError::FailedPrecondition { reason: Reason::SweepNotOpen, what: "the sweep is cancelled".into() }
            }
            ApplyError::Store(StoreError::NotFound) => ApiError::SweepNotFound,
            ApplyError::Store(e) => e.into(),
        }
    }
}

impl ReviewApi {
    pub(super) async fn create_sweep(
        &self,
        tenant: &Tenant,
        req: CreateSweepRequest,
    ) -> Result<proto::Sweep, ApiError> {
        if req.idempotency_key.is_empty() {
            return Err(ApiError::invalid("idempotency_key", "required for a sweep"));
        }
        if req.idempotency_key.len() > MAX_KEY {
            return Err(ApiError::invalid("idempotency_key", format!("longer than {MAX_KEY} bytes")));
        }
        let mode = api::sweep_mode_from_proto(req.mode).ok_or_else(|| ApiError::invalid("mode", "unknown mode"))?;
        let window = match req.completion_window {
            None => DEFAULT_WINDOW,
            Some(d) if d.seconds > 0 && d.nanos >= 0 && (d.seconds as u64) <= MAX_WINDOW.as_secs() => {
                Duration::new(d.seconds as u64, d.nanos as u32)
            }
            Some(_) => {
                return Err(ApiError::invalid("completion_window", "must be positive and at most 7 days"));
            }
        };
        let handle = self.region(tenant.region)?;
        let rec = self.open_sweep(tenant, handle, &req.idempotency_key, mode, window).await?;
        Ok(api::sweep(&rec, &SweepCounts::default(), &RunningBatches::default(), None))
    }

    /// Opens the tenant's sweep of key `key` (or finds it, when the same sweep was
    /// asked for before): where it runs follows from the region's announced batch path.
    async fn open_sweep(
        &self,
        tenant: &Tenant,
        handle: &RegionHandle,
        key: &str,
        mode: SweepMode,
        window: Duration,
    ) -> Result<SweepRecord, ApiError> {
        let region = tenant.region;
        // Where it runs: the provider's batch API when the region's extractor announced
        // one it may use, else the lanes (`provider_batch` asked for is refused, with why).
        // A tenant whose batch reviews use another model class than the batch path's
        // has its sweeps run on the lanes, by the deployments of its class.
        let capability = sweeps(handle).capability().await?;
        let class = tenant.class_for(reviewlane_core::region::Lane::Batch, ReviewDepth::Full);
        let runs_on = match (mode, &capability) {
            (SweepMode::Lanes, _) => SweepMode::Lanes,
            (_, Some(c)) if c.serves(class) => SweepMode::ProviderBatch,
            (SweepMode::Auto, _) => SweepMode::Lanes,
            (_, _) => {
                let why = match capability {
                    Some(c) => c.why_not_for(class),
                    None => "no extractor of the region has announced a batch path".into(),
                };
                return Err(ApiError::FailedPrecondition {
                    reason: Reason::ProviderBatchUnavailable,
                    what: why.into(),
                });
            }
        };
        let sweep_id = sweep::sweep_id(tenant.region, &tenant.id, key);
        tracing::Span::current().record("job_id", sweep_id.as_str());
        let window_ms = window.as_millis() as u64;
        let rec = SweepRecord {
            sweep_id: sweep_id.clone(),
            tenant: tenant.id.clone(),
            region,
            mode,
            runs_on,
            completion_window_ms: window_ms,
            request_digest: job_id::sha256_hex(&[mode.as_str().as_bytes(), &window_ms.to_be_bytes()]),
            state: SweepState::Open,
            created_at_ms: self.clock.now_ms(),
            sealed_at_ms: None,
            cancelled_at_ms: None,
            started: false,
            items_added: 0,
            finished: false,
        };
        match sweeps(handle).create(&rec).await? {
            Made::New(rec) => {
                tracing::info!(mode = mode.as_str(), "sweep created");
                Ok(rec)
            }
            Made::Exists(existing) if existing.request_digest == rec.request_digest => Ok(existing),
            Made::Exists(_) => Err(ApiError::AlreadyExists),
        }
    }

    /// The full-depth review that follows `first`, a review admitted at `changed_hunks`
    /// for a tenant with `deeper_pass`: a sweep of one item, opened, filled and sealed
    /// here (each step idempotent, so a same-key retry of the submit carries on where a
    /// failed one stopped). It runs through the provider's batch API where the region
    /// has one, else through the batch lane, and is delivered as its own review.
    pub(super) async fn deeper_pass(
        &self,
        tenant: &Tenant,
        handle: &RegionHandle,
        first: &ReviewMessage,
    ) -> Result<(), ApiError> {
        let ids = DeeperIds::of(tenant.region, &tenant.id, &first.job_id);
        let store = sweeps(handle);
        if let Some((rec, _)) = store.get(&tenant.id, &ids.sweep_id).await?
            && rec.started
        {
            return Ok(());
        }
        let rec = self.open_sweep(tenant, handle, &ids.key, SweepMode::Auto, DEFAULT_WINDOW).await?;
        let now = self.clock.now_ms();
        let request_digest = job_id::sha256_hex(&[first.request_digest.as_bytes(), b"full"]);
        let review = ReviewMessage {
            job_id: ids.job_id.clone(),
            lane: reviewlane_shared::Lane::Batch,
            review_depth: ReviewDepth::Full,
            submitted_at_ms: now,
            request_digest: request_digest.clone(),
            deadline_ms: Some(rec.items_deadline_ms(now)),
            sweep_id: Some(rec.sweep_id.clone()),
            deeper_of: Some(first.job_id.clone()),
            deeper_review: None,
            ..first.clone()
        };
        let entry = ItemEntry {
            job_id: ids.job_id,
            item_key: first.job_id.clone(),
            request_digest,
            added_at_ms: now,
            position: 0,
            review: Some(review),
        };
        match store.add_item(&rec.sweep_id, &entry).await? {
            Made::New(_) => match store.apply(&tenant.id, &rec.sweep_id, SweepEvent::Added(1), now).await {
                Ok(_) | Err(ApplyError::Refused(_)) => {}
                Err(ApplyError::Store(e)) => return Err(e.into()),
            },
            Made::Exists(_) => {}
        }
        match self.seal(handle, &tenant.id, &rec.sweep_id).await {
            Ok(()) => {
                tracing::info!(runs_on = rec.runs_on.as_str(), "deeper pass queued");
                Ok(())
            }
            // The interactive answer does not wait on the batch lane: the sealed sweep
            // hands its item over at the next seal, which a same-key retry makes.
            Err(ApiError::ResourceExhausted { reason: Reason::LaneFull, .. }) => {
                tracing::warn!("batch lane full: the deeper pass waits for a same-key retry of the submit");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// The sweep a tenant may see: its own, in its own region.
    pub(super) async fn owned_sweep(
        &self,
        tenant: &Tenant,
        id: &str,
    ) -> Result<(&RegionHandle, SweepRecord), ApiError> {
        tracing::Span::current().record("job_id", span_id(id));
        let region = job_id::region_of(id).map_err(|e| ApiError::invalid("sweep_id", e.to_string()))?;
        if region != tenant.region {
            return Err(ApiError::SweepNotFound);
        }
        let handle = self.region(region)?;
        match sweeps(handle).get(&tenant.id, id).await? {
            Some((rec, _)) if rec.tenant == tenant.id => Ok((handle, rec)),
            _ => Err(ApiError::SweepNotFound),
        }
    }

    pub(super) async fn add_sweep_items(
        &self,
        tenant: &Tenant,
        req: AddSweepItemsRequest,
    ) -> Result<AddSweepItemsResponse, ApiError> {
        let (handle, rec) = self.owned_sweep(tenant, &req.sweep_id).await?;
        if req.items.len() > MAX_PAGE_ITEMS {
            return Err(ApiError::invalid("items", format!("more than {MAX_PAGE_ITEMS} in one page")));
        }
        let store = sweeps(handle);
        let limits = Limits {
            max_diff_bytes: tenant.max_diff_bytes.unwrap_or(self.max_diff_bytes),
            deadlines: [self.policies[0].deadline, self.policies[1].deadline],
        };
        let now = self.clock.now_ms();
        let mut entries = Vec::with_capacity(req.items.len());
        for (position, item) in (0u32..).zip(req.items) {
            if item.item_key.is_empty() || item.item_key.len() > MAX_KEY {
                return Err(ApiError::invalid("items.item_key", format!("required, at most {MAX_KEY} bytes")));
            }
            entries.push(self.item_entry(tenant, handle, &rec, (position, item), &limits, now)?);
        }
        let (mut added, mut present) = (0u32, 0u32);
        // A sealed or cancelled sweep takes no item; a page it has already (a retry) is
        // answered as it stands.
        if let Err(refused) = rec.may_add() {
            for entry in &entries {
                match store.item(&rec.sweep_id, &entry.job_id).await? {
                    Some(existing) if existing.request_digest == entry.request_digest => present += 1,
                    Some(_) => return Err(ApiError::AlreadyExists),
                    None => return Err(ApplyError::Refused(refused).into()),
                }
            }
            return Ok(AddSweepItemsResponse { added, already_present: present });
        }
        if rec.items_added as usize + entries.len() > MAX_ITEMS {
            return Err(ApiError::invalid("items", format!("a sweep holds at most {MAX_ITEMS} items")));
        }
        let mut new = Vec::new();
        for entry in entries {
            match store.add_item(&rec.sweep_id, &entry).await? {
                Made::New(entry) => {
                    added += 1;
                    new.push(entry);
                }
                Made::Exists(existing) if existing.request_digest == entry.request_digest => present += 1,
                Made::Exists(_) => return Err(ApiError::AlreadyExists),
            }
        }
        // Counted for the size limit; a sweep sealed meanwhile takes no count.
        match store.apply(&rec.tenant, &rec.sweep_id, SweepEvent::Added(u64::from(added)), now).await {
            Ok(_) | Err(ApplyError::Refused(_)) => {}
            Err(ApplyError::Store(e)) => return Err(e.into()),
        }
        // A seal that raced this page may have listed the manifest before these items:
        // hand them over here (each once, whoever is first).
        if added > 0
            && rec.runs_on == SweepMode::Lanes
            && let Some((now_rec, _)) = store.get(&rec.tenant, &rec.sweep_id).await?
            && now_rec.state == SweepState::Sealed
        {
            self.hand_over(handle, &now_rec, new).await?;
        }
        tracing::info!(added, already_present = present, "sweep items added");
        Ok(AddSweepItemsResponse { added, already_present: present })
    }

    /// An item checked as a submit is, as the manifest keeps it until its sweep starts.
    fn item_entry(
        &self,
        tenant: &Tenant,
        handle: &RegionHandle,
        rec: &SweepRecord,
        (position, item): (u32, proto::SweepItem),
        limits: &Limits,
        now: u64,
    ) -> Result<ItemEntry, ApiError> {
        let req = SubmitReviewRequest {
            idempotency_key: String::new(),
            lane: proto::Lane::Batch as i32,
            diff: item.diff,
            schema_version: item.schema_version,
            metadata: item.metadata,
            diff_bytes: item.diff_bytes,
            deadline: None,
            timeout: None,
        };
        let CheckedSubmit { lane, schema_version, diff, submitted_at_ms, metadata, request_digest, .. } =
            check(req, limits, now)?;
        let job_id = sweep::item_job_id(tenant.region, &tenant.id, &rec.sweep_id, &item.item_key);
        let review = ReviewMessage {
            job_id: job_id.clone(),
            tenant: tenant.id.clone(),
            region: tenant.region,
            lane,
            schema_version,
            review_depth: ReviewDepth::Full,
            metadata,
            input_digest: job_id::sha256_hex(&[diff.bytes()]),
            diff: diff.utf8,
            diff_bytes: diff.raw,
            submitted_at_ms,
            request_digest: request_digest.clone(),
            deadline_ms: Some(rec.items_deadline_ms(now)),
            replay_of: None,
            sweep_id: Some(rec.sweep_id.clone()),
            deeper_of: None,
            deeper_review: None,
        };
        // Refused now, not at the seal, when the lane would not take it.
        super::submit::encode(handle, &review)?;
        Ok(ItemEntry {
            job_id,
            item_key: item.item_key,
            request_digest,
            added_at_ms: now,
            position,
            review: Some(review),
        })
    }

    /// Seals the sweep and hands every item not yet handed over to the batch lane.
    pub(super) async fn seal_sweep(&self, tenant: &Tenant, id: &str) -> Result<proto::Sweep, ApiError> {
        let (handle, _) = self.owned_sweep(tenant, id).await?;
        self.seal(handle, &tenant.id, id).await?;
        self.sweep_view(handle, &tenant.id, id).await
    }

    /// Seals the sweep; then the region's coordinator cuts it into provider batches, or
    /// its items not yet handed over go to the batch lane now.
    async fn seal(&self, handle: &RegionHandle, tenant: &str, id: &str) -> Result<(), ApiError> {
        let store = sweeps(handle);
        let rec = store.apply(tenant, id, SweepEvent::Seal, self.clock.now_ms()).await?;
        if !rec.started && rec.runs_on == SweepMode::ProviderBatch {
            store.apply(tenant, id, SweepEvent::Started, self.clock.now_ms()).await?;
            tracing::info!(items = rec.items_added, "sweep sealed for provider batches");
        } else if !rec.started {
            let items = store.items(id).await?;
            let waiting: Vec<ItemEntry> = items.into_iter().filter(|i| i.review.is_some()).collect();
            let n = waiting.len();
            self.hand_over(handle, &rec, waiting).await?;
            store.apply(tenant, id, SweepEvent::Started, self.clock.now_ms()).await?;
            tracing::info!(items = n, "sweep sealed and started");
        }
        Ok(())
    }

    /// Makes each item's job durable on the batch lane (as a submit does), its deadline
    /// the sweep's completion window from the seal, then keeps only its key in the
    /// manifest. A full lane stops it: sealing again goes on from there.
    async fn hand_over(&self, handle: &RegionHandle, rec: &SweepRecord, items: Vec<ItemEntry>) -> Result<(), ApiError> {
        let store = sweeps(handle);
        let deadline = rec.items_deadline_ms(self.clock.now_ms());
        let mut handed = futures::stream::iter(items)
            .map(|item| {
                let store = &store;
                async move {
                    let Some(mut review) = item.review.clone() else { return Ok(()) };
                    review.deadline_ms = Some(deadline);
                    match self.write_job(handle, &review).await? {
                        Created::New(..) => {}
                        Created::Exists(existing) if existing.request_digest == review.request_digest => {}
                        Created::Exists(_) => return Err(ApiError::AlreadyExists),
                    }
                    store.strip_item(&rec.sweep_id, &item).await?;
                    Ok::<(), ApiError>(())
                }
            })
            .buffer_unordered(AT_ONCE);
        while let Some(done) = handed.next().await {
            done?;
        }
        Ok(())
    }

    /// Cancels the sweep: items not yet handed over never run, and those waiting for a
    /// call end `cancelled`. An item being called finishes: what is paid for is
    /// delivered.
    pub(super) async fn cancel_sweep(&self, tenant: &Tenant, id: &str) -> Result<proto::Sweep, ApiError> {
        let (handle, _) = self.owned_sweep(tenant, id).await?;
        let store = sweeps(handle);
        store.apply(&tenant.id, id, SweepEvent::Cancel, self.clock.now_ms()).await?;
        let ids = store.item_ids(id).await?;
        let mut cancelled = futures::stream::iter(ids)
            .map(|job| async move {
                match handle.jobs.get(&job).await? {
                    Some((rec, _))
                        if matches!(rec.state, JobState::Accepted | JobState::Waiting | JobState::RetryScheduled) =>
                    {
                        match handle.jobs.apply(&job, &Event::Cancel).await {
                            Ok(_) | Err(StoreError::Transition(..)) => Ok(()),
                            Err(e) => Err(e),
                        }
                    }
                    _ => Ok(()),
                }
            })
            .buffer_unordered(AT_ONCE);
        while let Some(done) = cancelled.next().await {
            done?;
        }
        tracing::info!("sweep cancelled");
        self.sweep_view(handle, &tenant.id, id).await
    }
}
