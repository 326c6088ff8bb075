//! The sweeps' reads: `GetSweep`, `ListSweeps`, `ListSweepItems` and `WatchSweep`, all
//! with one view of a sweep (`view`: its items' counts, its running provider batches
//! and the one estimate). A watch is one stream: the sweep's progress read whole once,
//! then again where its KV signals say it changed — its items' job records, its own
//! record, items added, its provider batches — with no polling of records that did not
//! change, at most once a second, until every item is final (`SweepWatch::run`).

use futures::StreamExt;
use reviewlane_api::proto::{ListSweepItemsRequest, ListSweepItemsResponse, SweepItemStatus};
use reviewlane_core::batch::ChunkRecord;
use reviewlane_core::sweep::{ItemJob, ItemState, RunningBatches, SweepCounts, SweepMode, SweepRecord, SweepState};
use reviewlane_shared::sweeps::Sweeps;

use super::sweeps::{AT_ONCE, SweepStream, sweeps};
use super::*;

/// The sweep's provider batches (none for a sweep on the lanes).
pub(super) async fn chunks(store: &Sweeps, rec: &SweepRecord) -> Result<Vec<ChunkRecord>, ApiError> {
    if rec.runs_on != SweepMode::ProviderBatch {
        return Ok(Vec::new());
    }
    Ok(store.chunks(&rec.sweep_id).await?.into_iter().map(|(c, _)| c).collect())
}

/// The API view of a sweep: its items' counts, its running batches as the provider
/// reports them, and the one estimate (`sweep::estimate`) every read shows.
pub(super) fn view(rec: &SweepRecord, counts: &SweepCounts, chunks: &[ChunkRecord], now_ms: u64) -> proto::Sweep {
    let running = RunningBatches::of(chunks);
    api::sweep(rec, counts, &running, reviewlane_core::sweep::estimate(rec, counts, chunks, now_ms))
}

/// Where a page of a sweep listing starts: its `page_token` (empty: the first).
fn offset(page_token: &str) -> Result<usize, ApiError> {
    if page_token.is_empty() {
        return Ok(0);
    }
    page_token.parse().map_err(|_| ApiError::invalid("page_token", "not a token of this listing"))
}

/// A watched sweep's changes are read again at most this often.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// One `WatchSweep` stream: the sweep it follows, the signals it follows it by
/// (subscribed before the first read, so nothing falls between the two), and where its
/// views go.
pub(super) struct SweepWatch {
    api: ReviewApi,
    handle: RegionHandle,
    tenant: String,
    id: String,
    /// Every job record's changes in the region (only the sweep's items are kept).
    jobs: async_nats::Subscriber,
    /// The sweep's own record.
    own: async_nats::Subscriber,
    /// Items added to the manifest.
    added: async_nats::Subscriber,
    /// The sweep's provider batches.
    batches: async_nats::Subscriber,
    tx: mpsc::Sender<Result<proto::WatchSweepResponse, Status>>,
}

/// What changed since the sweep's progress was last read.
#[derive(Default)]
struct Changes {
    own: bool,
    batches: bool,
    jobs: std::collections::HashSet<String>,
}

impl Changes {
    fn any(&self) -> bool {
        self.own || self.batches || !self.jobs.is_empty()
    }
}

impl SweepWatch {
    /// Subscribes to the sweep's signals.
    pub(super) async fn subscribe(
        api: ReviewApi,
        handle: RegionHandle,
        tenant: String,
        id: String,
        tx: mpsc::Sender<Result<proto::WatchSweepResponse, Status>>,
    ) -> Result<SweepWatch, ApiError> {
        let store = sweeps(&handle);
        let jobs = handle.jobs.all_signals().await?;
        let own = store.signals(&tenant, &id).await?;
        let added = store.item_signals(&id).await?;
        let batches = store.chunk_signals(&id).await?;
        Ok(SweepWatch { api, handle, tenant, id, jobs, own, added, batches, tx })
    }

    /// Sends the sweep's view now, then again after each change, until every item is
    /// final or the caller goes; an error (the server shutting down included) ends the
    /// stream with its status.
    pub(super) async fn run(mut self) {
        if let Err(e) = self.follow().await {
            let _ = self.tx.send(Err(e.into())).await;
        }
    }

    async fn follow(&mut self) -> Result<(), ApiError> {
        let mut progress = Progress::read(&self.handle, &self.tenant, &self.id).await?;
        let mut changes = Changes::default();
        let mut tick = tokio::time::interval(WATCH_EVERY);
        loop {
            if changes.any() {
                progress.refresh(&self.handle, &self.tenant, &self.id, &mut changes).await?;
            }
            let view = progress.view(self.api.clock.now_ms());
            let done = view.percent_done >= 100.0 && progress.rec.state != SweepState::Open;
            if self.tx.send(Ok(proto::WatchSweepResponse { sweep: Some(view) })).await.is_err() || done {
                return Ok(());
            }
            if !self.gather(&progress, &mut changes, &mut tick).await? {
                return Ok(());
            }
        }
    }

    /// Gathers the changes until the next tick that has some: one view for all of
    /// them. `Ok(false)` when the caller went away.
    async fn gather(
        &mut self,
        progress: &Progress,
        changes: &mut Changes,
        tick: &mut tokio::time::Interval,
    ) -> Result<bool, ApiError> {
        loop {
            tokio::select! {
                Some(m) = self.jobs.next() => {
                    if let Some(job) = self.handle.jobs.signalled(&m.subject) && progress.follows(job) {
                        changes.jobs.insert(job.to_string());
                    }
                }
                Some(m) = self.added.next() => {
                    if let Some(job) = m.subject.rsplit('.').next() {
                        changes.jobs.insert(job.to_string());
                    }
                }
                Some(_) = self.own.next() => changes.own = true,
                Some(_) = self.batches.next() => changes.batches = true,
                _ = tick.tick() => if changes.any() { return Ok(true) },
                _ = self.api.shutdown.cancelled() => {
                    return Err(ApiError::StreamInterrupted { reason: Reason::ShuttingDown, what: "server shutting down; watch again" });
                }
                _ = self.tx.closed() => return Ok(false),
            }
        }
    }
}

/// A watched sweep: its record, each item's job and its provider batches as last read.
struct Progress {
    rec: SweepRecord,
    jobs: std::collections::HashMap<String, Option<ItemJob>>,
    chunks: Vec<ChunkRecord>,
}

async fn item_job(handle: &RegionHandle, job: &str) -> Result<Option<ItemJob>, ApiError> {
    Ok(handle.jobs.get(job).await?.map(|(r, _)| ItemJob::of(&r)))
}

impl Progress {
    async fn read(handle: &RegionHandle, tenant: &str, id: &str) -> Result<Progress, ApiError> {
        let store = sweeps(handle);
        let (rec, _) = store.get(tenant, id).await?.ok_or(ApiError::SweepNotFound)?;
        let mut jobs = std::collections::HashMap::new();
        let ids = store.item_ids(id).await?;
        let mut read =
            futures::stream::iter(ids).map(|job| async move { (item_job(handle, &job).await, job) }).buffered(AT_ONCE);
        while let Some((state, job)) = read.next().await {
            jobs.insert(job, state?);
        }
        let chunks = chunks(&store, &rec).await?;
        Ok(Progress { rec, jobs, chunks })
    }

    fn follows(&self, job: &str) -> bool {
        self.jobs.contains_key(job)
    }

    /// Reads again what `changes` names: the sweep's record, its provider batches and
    /// the jobs that changed (or were added); `changes` is left empty.
    async fn refresh(
        &mut self,
        handle: &RegionHandle,
        tenant: &str,
        id: &str,
        changes: &mut Changes,
    ) -> Result<(), ApiError> {
        let store = sweeps(handle);
        if std::mem::take(&mut changes.own) {
            self.rec = store.get(tenant, id).await?.ok_or(ApiError::SweepNotFound)?.0;
        }
        if std::mem::take(&mut changes.batches) {
            self.chunks = chunks(&store, &self.rec).await?;
        }
        let changed: Vec<String> = changes.jobs.drain().collect();
        let mut read = futures::stream::iter(changed)
            .map(|job| async move { (item_job(handle, &job).await, job) })
            .buffered(AT_ONCE);
        while let Some((state, job)) = read.next().await {
            self.jobs.insert(job, state?);
        }
        Ok(())
    }

    fn view(&self, now_ms: u64) -> proto::Sweep {
        let mut counts = SweepCounts::default();
        for job in self.jobs.values() {
            counts.add(job.as_ref(), self.rec.state == SweepState::Cancelled);
        }
        view(&self.rec, &counts, &self.chunks, now_ms)
    }
}

impl ReviewApi {
    pub(super) async fn list_sweeps(
        &self,
        tenant: &Tenant,
        req: proto::ListSweepsRequest,
    ) -> Result<proto::ListSweepsResponse, ApiError> {
        let handle = self.region(tenant.region)?;
        let page_size = page_size(req.page_size, 20, 100)?;
        let start = offset(&req.page_token)?;
        let all = sweeps(handle).list(&tenant.id).await?;
        let mut out = Vec::new();
        for rec in all.iter().skip(start).take(page_size) {
            out.push(self.sweep_view(handle, &tenant.id, &rec.sweep_id).await?);
        }
        let next = start + out.len();
        let next_page_token = if next < all.len() { next.to_string() } else { String::new() };
        Ok(proto::ListSweepsResponse { sweeps: out, next_page_token })
    }

    /// The sweep's progress now, then again whenever it changes (`SweepWatch`).
    pub(super) async fn watch_sweep(&self, tenant: Arc<Tenant>, id: String) -> Result<SweepStream, ApiError> {
        let (handle, _) = self.owned_sweep(&tenant, &id).await?;
        let permit = self.watch_permit(&tenant.id)?;
        let (tx, rx) = mpsc::channel(8);
        let watch = SweepWatch::subscribe(self.clone(), handle.clone(), tenant.id.clone(), id, tx).await?;
        tokio::spawn(
            async move {
                let _permit = permit;
                watch.run().await
            }
            .in_current_span(),
        );
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    pub(super) async fn get_sweep(&self, tenant: &Tenant, id: &str) -> Result<proto::Sweep, ApiError> {
        let (handle, _) = self.owned_sweep(tenant, id).await?;
        self.sweep_view(handle, &tenant.id, id).await
    }

    /// The sweep with its progress, read from its items' jobs.
    pub(super) async fn sweep_view(
        &self,
        handle: &RegionHandle,
        tenant: &str,
        id: &str,
    ) -> Result<proto::Sweep, ApiError> {
        let store = sweeps(handle);
        let (rec, _) = store.get(tenant, id).await?.ok_or(ApiError::SweepNotFound)?;
        let ids = store.item_ids(id).await?;
        let mut counts = SweepCounts::default();
        let mut read =
            futures::stream::iter(ids).map(|job| async move { handle.jobs.get(&job).await }).buffered(AT_ONCE);
        while let Some(job) = read.next().await {
            let job = job?.map(|(r, _)| ItemJob::of(&r));
            counts.add(job.as_ref(), rec.state == SweepState::Cancelled);
        }
        let chunks = chunks(&store, &rec).await?;
        Ok(view(&rec, &counts, &chunks, self.clock.now_ms()))
    }

    pub(super) async fn list_sweep_items(
        &self,
        tenant: &Tenant,
        req: ListSweepItemsRequest,
    ) -> Result<ListSweepItemsResponse, ApiError> {
        let (handle, rec) = self.owned_sweep(tenant, &req.sweep_id).await?;
        let cancelled = rec.state == SweepState::Cancelled;
        let page_size = page_size(req.page_size, 100, 1000)?;
        let start = offset(&req.page_token)?;
        let states: Vec<ItemState> = req.states.iter().filter_map(|s| api::item_state_from_proto(*s)).collect();
        let reasons: Vec<_> = req.reasons.iter().filter_map(|r| api::reason_from_proto(*r)).collect();
        let items = sweeps(handle).items(&req.sweep_id).await?;
        let mut out = Vec::new();
        let mut next = None;
        let mut read = futures::stream::iter(items.into_iter().enumerate().skip(start))
            .map(|(i, item)| async move { (i, handle.jobs.get(&item.job_id).await, item) })
            .buffered(AT_ONCE);
        while let Some((i, job, item)) = read.next().await {
            if out.len() == page_size {
                next = Some(i);
                break;
            }
            let job = job?.map(|(r, _)| r);
            let state = ItemState::of(job.as_ref().map(ItemJob::of).as_ref(), cancelled);
            let reason = job.as_ref().and_then(|r| r.reason).filter(|_| state == ItemState::Failed);
            if (!states.is_empty() && !states.contains(&state))
                || (!reasons.is_empty() && !reason.is_some_and(|r| reasons.contains(&r)))
            {
                continue;
            }
            out.push(SweepItemStatus {
                item_key: item.item_key,
                job_id: item.job_id,
                state: api::item_state_to_proto(state) as i32,
                terminal_reason: reason.map_or(proto::TerminalReason::Unspecified, api::reason_to_proto) as i32,
            });
        }
        Ok(ListSweepItemsResponse { items: out, next_page_token: next.map(|n| n.to_string()).unwrap_or_default() })
    }
}
