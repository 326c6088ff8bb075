//! `ReviewService`: one dispatcher that authenticates, times and counts every call
//! (and answers `GetReview`), and one file per RPC family behind it: `submit`,
//! `reviews` (watch, cancel), `list`, `dead_letters`, `lanes` and `sweeps` (create, add
//! items, seal, get, list, list items, watch, cancel). A call works on the tenant's
//! region (submit, create, the listings) or on the one its id's prefix names (the
//! rest), and touches only that region's NATS. No call waits on a provider.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::Stream;
use reviewlane_api as api;
use reviewlane_api::proto::{
    self, AddSweepItemsRequest, AddSweepItemsResponse, CancelReviewRequest, CancelReviewResponse, CancelSweepRequest,
    CancelSweepResponse, CreateSweepRequest, CreateSweepResponse, GetDeadLetterRequest, GetDeadLetterResponse,
    GetReviewRequest, GetReviewResponse, GetSweepRequest, GetSweepResponse, ListDeadLettersRequest,
    ListDeadLettersResponse, ListDeploymentsRequest, ListDeploymentsResponse, ListLanesRequest, ListLanesResponse,
    ListReviewsRequest, ListReviewsResponse, ListSweepItemsRequest, ListSweepItemsResponse, ListSweepsRequest,
    ListSweepsResponse, ReplayDeadLetterRequest, ReplayDeadLetterResponse, SealSweepRequest, SealSweepResponse,
    SubmitReviewRequest, SubmitReviewResponse, WatchReviewRequest, WatchReviewResponse, WatchSweepRequest,
    review_service_server::ReviewService,
};
use reviewlane_core::clock::SharedClock;
use reviewlane_core::diff;
use reviewlane_core::findings::{self, Finding};
use reviewlane_core::job::{Event, JobRecord, JobState, ReviewDepth};
use reviewlane_core::job_id;
use reviewlane_core::messages::{DeadLetter, ReviewMessage, ReviewMetadata};
use reviewlane_core::region::Region;
use reviewlane_core::tenants::{Role, Tenant};
use reviewlane_shared::faults::{Faults, point};
use reviewlane_shared::job_index;
use reviewlane_shared::job_store::{Created, JobStore, StoreError};
use reviewlane_shared::layout::{self, RegionLayout};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{Instrument, instrument};

use crate::admission::{Decision, LanePolicy, Sampler, decide_for_tenant};
use crate::auth::Authenticator;
use crate::error::{ApiError, Reason};
use crate::rpc::Metrics;

mod dead_letters;
mod lanes;
mod list;
mod reviews;
mod submit;
mod sweep_reads;
mod sweeps;

/// The region's dead letters.
fn dead_letters(handle: &RegionHandle) -> reviewlane_shared::dead_letters::DeadLetters {
    reviewlane_shared::dead_letters::DeadLetters::new(handle.layout.js.clone(), handle.layout.region)
}

/// The region's job index.
fn index(handle: &RegionHandle) -> job_index::JobIndex {
    job_index::JobIndex::new(handle.layout.js.clone(), handle.layout.region)
}

/// One region as the ingress sees it.
#[derive(Clone)]
pub struct RegionHandle {
    pub layout: RegionLayout,
    pub jobs: JobStore,
    pub results: reviewlane_shared::results::Results,
    pub max_payload: usize,
}

#[derive(Clone)]
pub struct ReviewApi {
    regions: Arc<BTreeMap<Region, RegionHandle>>,
    max_diff_bytes: usize,
    shutdown: CancellationToken,
    sampler: Sampler,
    policies: Arc<[LanePolicy; 2]>,
    auth: Authenticator,
    metrics: Metrics,
    faults: Faults,
    /// Per region: each tenant's weight (for its share of the lane's throughput).
    weights: Arc<BTreeMap<Region, Vec<(String, u32)>>>,
    limits: crate::config::ServerLimits,
    /// Open `WatchReview` streams per tenant.
    watches: Arc<std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Semaphore>>>>,
    /// What the regions' stores refused (counted; readiness).
    health: reviewlane_shared::store_health::StoreHealth,
    /// The time submits and replays start their deadlines from.
    clock: SharedClock,
}

impl ReviewApi {
    pub fn new(
        regions: BTreeMap<Region, RegionHandle>,
        max_diff_bytes: usize,
        shutdown: CancellationToken,
        sampler: Sampler,
        policies: [LanePolicy; 2],
        auth: Authenticator,
        metrics: Metrics,
    ) -> Self {
        ReviewApi {
            regions: Arc::new(regions),
            max_diff_bytes,
            shutdown,
            sampler,
            policies: Arc::new(policies),
            auth,
            metrics,
            faults: Faults::default(),
            weights: Arc::default(),
            limits: Default::default(),
            watches: Arc::default(),
            health: reviewlane_shared::store_health::StoreHealth::register(
                &mut prometheus_client::registry::Registry::default(),
                &[],
                reviewlane_core::clock::system(),
            ),
            clock: reviewlane_core::clock::system(),
        }
    }

    /// Deadlines start from `clock`'s time (the system's unless a test sets one).
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Store refusals are counted in `health`.
    pub fn with_store_health(mut self, health: reviewlane_shared::store_health::StoreHealth) -> Self {
        self.health = health;
        self
    }

    /// A write a region's store refused, counted.
    fn note_store(&self, region: Region, e: &ApiError) {
        if let ApiError::Store(e) = e {
            self.health.refused(region, e);
        }
    }

    /// The limits a caller meets (watch keepalive, open watches per tenant).
    pub fn with_limits(mut self, limits: crate::config::ServerLimits) -> Self {
        self.limits = limits;
        self
    }

    /// A place among the tenant's open watches, or `RESOURCE_EXHAUSTED`.
    fn watch_permit(&self, tenant: &str) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
        let sem = self
            .watches
            .lock()
            .expect("watches lock")
            .entry(tenant.to_string())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.limits.max_watches_per_tenant)))
            .clone();
        sem.try_acquire_owned().map_err(|_| ApiError::ResourceExhausted {
            reason: Reason::TooManyWatches,
            what: "too many open watches for this tenant",
            retry_after: Duration::from_secs(5),
        })
    }

    /// The tenants whose shares of each lane admission weighs.
    pub fn with_tenants(mut self, tenants: &reviewlane_core::tenants::Tenants) -> Self {
        let mut weights: BTreeMap<Region, Vec<(String, u32)>> = BTreeMap::new();
        for t in tenants.iter() {
            weights.entry(t.region).or_default().push((t.id.clone(), t.weight));
        }
        self.weights = Arc::new(weights);
        self
    }

    /// The same API checking `faults` (tests; no-ops unless built with `fault-hooks`).
    pub fn with_faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// The tenant's admission on a lane: its own reviews waiting against its weighted
    /// share of the lane's throughput, and its share of the lane's bound.
    /// The admission decision for a submit now, and how long its review is predicted to
    /// wait before it is served (when there is a prediction).
    fn admission(&self, tenant: &Tenant, lane: reviewlane_shared::Lane) -> (Decision, Option<Duration>) {
        let region = tenant.region;
        let weights = self.weights.get(&region).map(Vec::as_slice).unwrap_or_default();
        let view = self.sampler.tenant(region, lane, &tenant.id, weights);
        let policy = &self.policies[usize::from(lane == reviewlane_shared::Lane::Batch)];
        let share = tenant.lane_share.unwrap_or(1.0 / weights.len().max(1) as f64);
        let bound = if view.lane_bound == u64::MAX { u64::MAX } else { (view.lane_bound as f64 * share) as u64 };
        let d = decide_for_tenant(
            view.waiting,
            bound.max(1),
            view.lane_per_sec,
            tenant.weight,
            view.others_active_weight + tenant.weight,
            policy,
        );
        let name = match d {
            Decision::Accept => "accept",
            Decision::Degrade => "degrade",
            Decision::Refuse { .. } => "refuse",
        };
        self.metrics.admission(region.as_str(), lane.as_str(), name);
        (d, crate::admission::predicted_wait(view.waiting, view.lane_per_sec, policy.min_waiting))
    }

    fn region(&self, r: Region) -> Result<&RegionHandle, ApiError> {
        // Configuration checks every tenant's region has a NATS; a job id naming another
        // region is simply not found here.
        self.regions.get(&r).ok_or(ApiError::NotFound)
    }

    /// The job a tenant may see: its own, in its own region.
    async fn owned_job(&self, tenant: &Tenant, id: &str) -> Result<(&RegionHandle, JobRecord), ApiError> {
        tracing::Span::current().record("job_id", span_id(id));
        let region = job_id::region_of(id).map_err(|e| ApiError::invalid("job_id", e.to_string()))?;
        if region != tenant.region {
            return Err(ApiError::NotFound);
        }
        let handle = self.region(region)?;
        match handle.jobs.get(id).await? {
            Some((rec, _)) if rec.tenant == tenant.id => Ok((handle, rec)),
            _ => Err(ApiError::NotFound),
        }
    }

    /// The API view with findings for a validated or published job.
    async fn view(&self, handle: &RegionHandle, rec: &JobRecord) -> Result<proto::Review, ApiError> {
        let findings = if matches!(rec.state, JobState::Validated | JobState::Published) {
            read_findings(handle, rec).await?
        } else {
            Vec::new()
        };
        Ok(api::review(rec, &findings))
    }

    pub fn authenticator(&self) -> Authenticator {
        self.auth.clone()
    }

    pub fn metrics(&self) -> Metrics {
        self.metrics.clone()
    }
}

async fn read_findings(handle: &RegionHandle, rec: &JobRecord) -> Result<Vec<Finding>, ApiError> {
    // The result of the generation the record validated, never a stale holder's.
    let kept = handle.results.read(&rec.tenant, &rec.job_id, rec.generation()).await?;
    Ok(kept.map(|m| m.findings).unwrap_or_default())
}

/// The items of a listing's page: `default` for 0, at most `max`, and a negative size
/// refused. Every listing reads its `page_size` here.
fn page_size(requested: i32, default: usize, max: usize) -> Result<usize, ApiError> {
    match requested {
        n if n < 0 => Err(ApiError::invalid("page_size", "must not be negative")),
        0 => Ok(default),
        n => Ok((n as usize).min(max)),
    }
}

/// A client-supplied id goes into a span only when it has the shape of a job id.
fn span_id(id: &str) -> &str {
    if job_id::region_of(id).is_ok() { id } else { "malformed" }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchReviewResponse, Status>> + Send>>;

impl ReviewApi {
    /// Every call of the service, once: authenticated, timed and counted, its error
    /// mapped to its status (`error.rs`). A watch counts when its stream is open.
    async fn call<Q, R, F, Fut>(&self, method: &'static str, req: Request<Q>, handle: F) -> Result<Response<R>, Status>
    where
        F: FnOnce(Arc<Tenant>, Q) -> Fut,
        Fut: std::future::Future<Output = Result<R, ApiError>>,
    {
        let started = Instant::now();
        let res = match self.auth.tenant(&req) {
            Ok(tenant) => handle(tenant, req.into_inner()).await,
            Err(e) => Err(e),
        };
        self.metrics.finish(method, started, res.map(Response::new).map_err(Status::from))
    }
}

#[tonic::async_trait]
impl ReviewService for ReviewApi {
    async fn submit_review(&self, req: Request<SubmitReviewRequest>) -> Result<Response<SubmitReviewResponse>, Status> {
        self.call("SubmitReview", req, |tenant, req| async move {
            let review = self.submit(&tenant, req).await.inspect_err(|e| self.note_store(tenant.region, e))?;
            Ok(SubmitReviewResponse { review: Some(review) })
        })
        .await
    }

    async fn get_review(&self, req: Request<GetReviewRequest>) -> Result<Response<GetReviewResponse>, Status> {
        self.call("GetReview", req, |tenant, req| async move {
            let (handle, rec) = self.owned_job(&tenant, &req.job_id).await?;
            Ok(GetReviewResponse { review: Some(self.view(handle, &rec).await?) })
        })
        .await
    }

    type WatchReviewStream = WatchStream;

    async fn watch_review(
        &self,
        req: Request<WatchReviewRequest>,
    ) -> Result<Response<Self::WatchReviewStream>, Status> {
        self.call("WatchReview", req, |tenant, req| self.watch(tenant, req.job_id)).await
    }

    async fn cancel_review(&self, req: Request<CancelReviewRequest>) -> Result<Response<CancelReviewResponse>, Status> {
        self.call("CancelReview", req, |tenant, req| async move {
            Ok(CancelReviewResponse { review: Some(self.cancel(&tenant, &req.job_id).await?) })
        })
        .await
    }

    async fn list_dead_letters(
        &self,
        req: Request<ListDeadLettersRequest>,
    ) -> Result<Response<ListDeadLettersResponse>, Status> {
        self.call("ListDeadLetters", req, |caller, req| async move { self.list_dead(&caller, req).await }).await
    }

    async fn get_dead_letter(
        &self,
        req: Request<GetDeadLetterRequest>,
    ) -> Result<Response<GetDeadLetterResponse>, Status> {
        self.call("GetDeadLetter", req, |caller, req| async move {
            let (handle, dead) = self.dead_letter(&caller, &req.job_id).await?;
            let kept = dead_letters(handle).content(&dead).await?.is_some();
            Ok(GetDeadLetterResponse { dead_letter: Some(api::dead_letter(&dead, kept)) })
        })
        .await
    }

    async fn replay_dead_letter(
        &self,
        req: Request<ReplayDeadLetterRequest>,
    ) -> Result<Response<ReplayDeadLetterResponse>, Status> {
        self.call("ReplayDeadLetter", req, |caller, req| async move {
            Ok(ReplayDeadLetterResponse { review: Some(self.replay(&caller, &req.job_id).await?) })
        })
        .await
    }

    async fn list_lanes(&self, req: Request<ListLanesRequest>) -> Result<Response<ListLanesResponse>, Status> {
        self.call("ListLanes", req, |caller, _| async move {
            operator_only(&caller, "listing lanes needs an operator key")?;
            Ok(ListLanesResponse { lanes: self.lanes(caller.region).await? })
        })
        .await
    }

    async fn list_deployments(
        &self,
        req: Request<ListDeploymentsRequest>,
    ) -> Result<Response<ListDeploymentsResponse>, Status> {
        self.call("ListDeployments", req, |caller, _| async move {
            operator_only(&caller, "listing the pool's deployments needs an operator key")?;
            Ok(ListDeploymentsResponse { deployments: self.deployments(caller.region).await? })
        })
        .await
    }

    async fn list_reviews(&self, req: Request<ListReviewsRequest>) -> Result<Response<ListReviewsResponse>, Status> {
        self.call("ListReviews", req, |tenant, req| async move { self.list(&tenant, req).await }).await
    }

    async fn create_sweep(&self, req: Request<CreateSweepRequest>) -> Result<Response<CreateSweepResponse>, Status> {
        self.call("CreateSweep", req, |tenant, req| async move {
            let sweep = self.create_sweep(&tenant, req).await.inspect_err(|e| self.note_store(tenant.region, e))?;
            Ok(CreateSweepResponse { sweep: Some(sweep) })
        })
        .await
    }

    async fn add_sweep_items(
        &self,
        req: Request<AddSweepItemsRequest>,
    ) -> Result<Response<AddSweepItemsResponse>, Status> {
        self.call("AddSweepItems", req, |tenant, req| async move {
            self.add_sweep_items(&tenant, req).await.inspect_err(|e| self.note_store(tenant.region, e))
        })
        .await
    }

    async fn seal_sweep(&self, req: Request<SealSweepRequest>) -> Result<Response<SealSweepResponse>, Status> {
        self.call("SealSweep", req, |tenant, req| async move {
            let sweep =
                self.seal_sweep(&tenant, &req.sweep_id).await.inspect_err(|e| self.note_store(tenant.region, e))?;
            Ok(SealSweepResponse { sweep: Some(sweep) })
        })
        .await
    }

    async fn get_sweep(&self, req: Request<GetSweepRequest>) -> Result<Response<GetSweepResponse>, Status> {
        self.call("GetSweep", req, |tenant, req| async move {
            Ok(GetSweepResponse { sweep: Some(self.get_sweep(&tenant, &req.sweep_id).await?) })
        })
        .await
    }

    async fn list_sweep_items(
        &self,
        req: Request<ListSweepItemsRequest>,
    ) -> Result<Response<ListSweepItemsResponse>, Status> {
        self.call("ListSweepItems", req, |tenant, req| async move { self.list_sweep_items(&tenant, req).await }).await
    }

    async fn list_sweeps(&self, req: Request<ListSweepsRequest>) -> Result<Response<ListSweepsResponse>, Status> {
        self.call("ListSweeps", req, |tenant, req| async move { self.list_sweeps(&tenant, req).await }).await
    }

    type WatchSweepStream = sweeps::SweepStream;

    async fn watch_sweep(&self, req: Request<WatchSweepRequest>) -> Result<Response<Self::WatchSweepStream>, Status> {
        self.call("WatchSweep", req, |tenant, req| self.watch_sweep(tenant, req.sweep_id)).await
    }

    async fn cancel_sweep(&self, req: Request<CancelSweepRequest>) -> Result<Response<CancelSweepResponse>, Status> {
        self.call("CancelSweep", req, |tenant, req| async move {
            Ok(CancelSweepResponse { sweep: Some(self.cancel_sweep(&tenant, &req.sweep_id).await?) })
        })
        .await
    }
}

/// `PERMISSION_DENIED` unless `caller` holds an operator key; `what` says what needs one.
fn operator_only(caller: &Tenant, what: &'static str) -> Result<(), ApiError> {
    if caller.role == Role::Operator {
        return Ok(());
    }
    Err(ApiError::PermissionDenied { reason: Reason::OperatorRoleRequired, what })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_size_of_zero_is_the_default_a_large_one_the_maximum_and_a_negative_one_refused() {
        assert_eq!(page_size(0, 20, 100).unwrap(), 20);
        assert_eq!(page_size(7, 20, 100).unwrap(), 7);
        assert_eq!(page_size(5_000, 20, 100).unwrap(), 100);
        assert!(matches!(page_size(-1, 20, 100), Err(ApiError::InvalidArgument { .. })));
    }
}
