//! `ReviewService`: submit, get, watch and cancel reviews. Each call works on the
//! region named by the tenant's policy (submit) or by the job id's prefix (the rest),
//! and touches only that region's NATS. No call waits on a provider.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::Stream;
use reviewlane_shared::api;
use reviewlane_shared::diff;
use reviewlane_shared::faults::{Faults, point};
use reviewlane_shared::findings::{self, Finding};
use reviewlane_shared::job::{Event, JobRecord, JobState, ReviewDepth};
use reviewlane_shared::job_id;
use reviewlane_shared::job_index;
use reviewlane_shared::job_store::{Created, JobStore, StoreError};
use reviewlane_shared::layout::{self, RegionLayout};
use reviewlane_shared::messages::{DeadLetter, ReviewMessage, ReviewMetadata};
use reviewlane_shared::proto::{
    self, CancelReviewRequest, CancelReviewResponse, GetDeadLetterRequest, GetDeadLetterResponse, GetReviewRequest,
    GetReviewResponse, ListDeadLettersRequest, ListDeadLettersResponse, ListLanesRequest, ListLanesResponse,
    ListReviewsRequest, ListReviewsResponse, ReplayDeadLetterRequest, ReplayDeadLetterResponse, SubmitReviewRequest,
    SubmitReviewResponse, WatchReviewRequest, WatchReviewResponse, review_service_server::ReviewService,
};
use reviewlane_shared::region::Region;
use reviewlane_shared::telemetry::now_ms;
use reviewlane_shared::tenants::{Role, Tenant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{Instrument, instrument};

use crate::admission::{Decision, LanePolicy, Sampler, decide_for_tenant};
use crate::auth::Authenticator;
use crate::error::ApiError;
use crate::rpc::Metrics;

const MAX_IDEMPOTENCY_KEY: usize = 256;
const MAX_METADATA_FIELD: usize = 1024;
/// How long a client is told to wait when a lane is full.
const LANE_FULL_RETRY: Duration = Duration::from_secs(5);

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
                reviewlane_shared::clock::system(),
            ),
        }
    }

    /// Store refusals are counted in `health`.
    pub fn with_store_health(mut self, health: reviewlane_shared::store_health::StoreHealth) -> Self {
        self.health = health;
        self
    }

    /// A write a region's store refused, counted.
    fn note_store(&self, region: Region, e: &ApiError) {
        match e {
            ApiError::StoreFull => self.health.refused_kind(region, "full"),
            ApiError::Unavailable(_) => self.health.refused_kind(region, "unavailable"),
            _ => {}
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
            reason: "TOO_MANY_WATCHES",
            what: "too many open watches for this tenant",
            retry_after: Duration::from_secs(5),
        })
    }

    /// The tenants whose shares of each lane admission weighs.
    pub fn with_tenants(mut self, tenants: &reviewlane_shared::tenants::Tenants) -> Self {
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

    /// Each lane of `region` as it stands.
    async fn lanes(&self, region: Region) -> Result<Vec<proto::LaneStatus>, ApiError> {
        let handle = self.region(region)?;
        let mut out = Vec::new();
        for lane in reviewlane_shared::Lane::ALL {
            let mut stream = handle
                .layout
                .js
                .get_stream(layout::lane_stream(region, lane))
                .await
                .map_err(|e| ApiError::Unavailable(e.into()))?;
            let info = stream.info().await.map_err(|e| ApiError::Unavailable(e.into()))?;
            let depth = info.state.messages;
            let oldest_age = (depth > 0).then(|| {
                let age = time::OffsetDateTime::now_utc() - info.state.first_timestamp;
                let age = Duration::try_from(age).unwrap_or_default();
                prost_types::Duration { seconds: age.as_secs() as i64, nanos: age.subsec_nanos() as i32 }
            });
            let (_, per_sec) = self.sampler.get(region, lane);
            let policy = &self.policies[usize::from(lane == reviewlane_shared::Lane::Batch)];
            let wait = crate::admission::predicted_wait(depth, per_sec, policy.min_waiting);
            out.push(proto::LaneStatus {
                region: region.as_str().to_string(),
                lane: api::lane_to_proto(lane) as i32,
                depth,
                bound: u64::try_from(info.config.max_messages).unwrap_or(u64::MAX),
                oldest_age,
                per_second: per_sec.unwrap_or(0.0),
                predicted_wait: wait
                    .map(|w| prost_types::Duration { seconds: w.as_secs() as i64, nanos: w.subsec_nanos() as i32 }),
            });
        }
        Ok(out)
    }

    /// A page of dead letters the caller may see: its own, or an operator's region's.
    async fn list_dead(
        &self,
        caller: &Tenant,
        req: ListDeadLettersRequest,
    ) -> Result<ListDeadLettersResponse, ApiError> {
        let limit = match req.page_size {
            n if n < 0 => return Err(ApiError::invalid("page_size", "must not be negative")),
            0 => 20,
            n => (n as usize).min(100),
        };
        let start = reviewlane_shared::dead_letters::from_token(&req.page_token)
            .ok_or_else(|| ApiError::invalid("page_token", "not a token this service issued"))?;
        let handle = self.region(caller.region)?;
        let tenant = (caller.role != Role::Operator).then_some(caller.id.as_str());
        let page = dead_letters(handle).page(tenant, start, limit).await?;
        Ok(ListDeadLettersResponse {
            dead_letters: page.dead_letters.iter().map(|d| api::dead_letter(d, false)).collect(),
            next_page_token: page.next.unwrap_or_default(),
        })
    }

    /// A dead letter the caller may see: of its own job, or (operator) of its region.
    async fn dead_letter(&self, caller: &Tenant, id: &str) -> Result<(&RegionHandle, DeadLetter), ApiError> {
        tracing::Span::current().record("job_id", span_id(id));
        let region = job_id::region_of(id).map_err(|e| ApiError::invalid("job_id", e.to_string()))?;
        if region != caller.region {
            return Err(ApiError::NotFound);
        }
        let handle = self.region(region)?;
        let rec = match handle.jobs.get(id).await? {
            Some((rec, _)) if rec.tenant == caller.id || caller.role == Role::Operator => rec,
            _ => return Err(ApiError::NotFound),
        };
        let dead = dead_letters(handle).get(&rec.tenant, id).await?.ok_or(ApiError::NotFound)?;
        Ok((handle, dead))
    }

    /// Submits a dead letter's review again as a new job linked to the dead one (see
    /// the proto): idempotent per dead letter.
    async fn replay(&self, caller: &Tenant, id: &str) -> Result<proto::Review, ApiError> {
        let (handle, dead) = self.dead_letter(caller, id).await?;
        let new_id = job_id::derive(dead.region, &dead.tenant, &format!("replay:{id}"));
        if let Some((existing, _)) = handle.jobs.get(&new_id).await? {
            // A repeated replay: the new job as it stands, findings and all.
            return self.view(handle, &existing).await;
        }
        let Some(old) = dead_letters(handle).content(&dead).await? else {
            return Err(ApiError::FailedPrecondition {
                reason: "CONTENT_EXPIRED",
                what: "the dead letter's content is no longer kept (its retention ended); submit the review again",
            });
        };
        let now = now_ms();
        let lane_deadline = self.policies[usize::from(old.lane == reviewlane_shared::Lane::Batch)].deadline;
        let msg = ReviewMessage {
            job_id: new_id,
            submitted_at_ms: now,
            deadline_ms: Some(now + lane_deadline.as_millis() as u64),
            request_digest: job_id::sha256_hex(&[b"replay", id.as_bytes(), old.request_digest.as_bytes()]),
            replay_of: Some(id.to_string()),
            ..old
        };
        let rec = match self.write_job(handle, &msg).await? {
            Created::New(rec, _) => rec,
            Created::Exists(existing) => return self.view(handle, &existing).await,
        };
        tracing::info!(replay_of = id, "dead letter replayed as a new job");
        Ok(api::review(&rec, &[]))
    }

    /// A page of the tenant's reviews from the region's job index.
    async fn list(&self, tenant: &Tenant, req: ListReviewsRequest) -> Result<ListReviewsResponse, ApiError> {
        const DEFAULT_PAGE: usize = 20;
        const MAX_PAGE: usize = 100;
        let limit = match req.page_size {
            n if n < 0 => return Err(ApiError::invalid("page_size", "must not be negative")),
            0 => DEFAULT_PAGE,
            n => (n as usize).min(MAX_PAGE),
        };
        let mut states = Vec::new();
        for s in &req.states {
            let state = proto::JobState::try_from(*s)
                .ok()
                .and_then(api::state_from_proto)
                .ok_or_else(|| ApiError::invalid("states", "unknown job state"))?;
            states.push(state);
        }
        let lane = match proto::Lane::try_from(req.lane) {
            Ok(proto::Lane::Unspecified) => None,
            Ok(_) => api::lane_from_proto(req.lane),
            Err(_) => return Err(ApiError::invalid("lane", "unknown lane")),
        };
        let ms = |t: &prost_types::Timestamp| (t.seconds.max(0) as u64) * 1000 + (t.nanos.max(0) as u64) / 1_000_000;
        let query = job_index::Query {
            states,
            lane,
            repository: (!req.repository.is_empty()).then(|| job_index::repository_digest(&tenant.id, &req.repository)),
            created_after_ms: req.created_after.as_ref().map(ms),
            created_before_ms: req.created_before.as_ref().map(ms),
        };
        let cursor = job_index::Cursor::from_token(&req.page_token, &query)
            .map_err(|e| ApiError::invalid("page_token", e.to_string()))?;
        let handle = self.region(tenant.region)?;
        let index = job_index::JobIndex::new(handle.layout.js.clone(), tenant.region);
        let page = index.page(&handle.jobs, &tenant.id, &query, cursor, limit).await?;
        Ok(ListReviewsResponse {
            reviews: page.records.iter().map(|r| api::review(r, &[])).collect(),
            next_page_token: page.next.map(|c| c.token(&query)).unwrap_or_default(),
        })
    }

    /// Runs inside the RPC span (see `rpc::span_for`), which it fills in.
    async fn submit(&self, tenant: &Tenant, mut req: SubmitReviewRequest) -> Result<proto::Review, ApiError> {
        let lane = api::lane_from_proto(req.lane).ok_or_else(|| ApiError::invalid("lane", "unknown lane"))?;
        let schema_version = if req.schema_version.is_empty() {
            findings::LATEST_SCHEMA.to_string()
        } else if findings::is_known_schema(&req.schema_version) {
            req.schema_version.clone()
        } else {
            return Err(ApiError::invalid(
                "schema_version",
                format!("unknown findings schema version; known: {}", findings::known_schemas().join(", ")),
            ));
        };
        let limit = tenant.max_diff_bytes.unwrap_or(self.max_diff_bytes);
        let diff = SubmittedDiff::from_request(&mut req, limit)?.without_colours();
        diff::parse(&diff.text()).map_err(|e| ApiError::invalid("diff", e.to_string()))?;
        let submitted_at_ms = now_ms();
        let lane_deadline = self.policies[usize::from(lane == reviewlane_shared::Lane::Batch)].deadline;
        let deadline_ms = deadline_of(&req, submitted_at_ms, lane_deadline)?;
        if req.idempotency_key.len() > MAX_IDEMPOTENCY_KEY {
            return Err(ApiError::invalid("idempotency_key", format!("longer than {MAX_IDEMPOTENCY_KEY} bytes")));
        }
        let metadata = req.metadata.unwrap_or_default();
        for (field, v) in [
            ("metadata.repository", &metadata.repository),
            ("metadata.base_revision", &metadata.base_revision),
            ("metadata.head_revision", &metadata.head_revision),
        ] {
            if v.len() > MAX_METADATA_FIELD {
                return Err(ApiError::invalid(field, format!("longer than {MAX_METADATA_FIELD} bytes")));
            }
        }
        let idempotency_key =
            if req.idempotency_key.is_empty() { hex::encode(rand::random::<[u8; 16]>()) } else { req.idempotency_key };

        let region = tenant.region;
        let handle = self.region(region)?;
        let id = job_id::derive(region, &tenant.id, &idempotency_key);
        let span = tracing::Span::current();
        span.record("job_id", id.as_str())
            .record("lane", lane.as_str())
            .record("schema_version", schema_version.as_str());
        // The pull request counts only when set, so digests of requests without one are
        // what they always were.
        let pull_request = metadata.pull_request.to_be_bytes();
        let mut digested: Vec<&[u8]> = vec![
            lane.as_str().as_bytes(),
            schema_version.as_bytes(),
            diff.bytes(),
            metadata.repository.as_bytes(),
            metadata.base_revision.as_bytes(),
            metadata.head_revision.as_bytes(),
        ];
        if metadata.pull_request != 0 {
            digested.push(&pull_request);
        }
        let request_digest = job_id::sha256_hex(&digested);
        // Admission on predicted queue age; a retry of a job we hold is answered anyway.
        let (decision, predicted_wait) = self.admission(tenant, lane);
        let depth = match decision {
            Decision::Accept => ReviewDepth::Full,
            Decision::Degrade => ReviewDepth::ChangedHunks,
            Decision::Refuse { retry_after } => match handle.jobs.get(&id).await? {
                Some((existing, _)) if existing.request_digest == request_digest => {
                    return Ok(api::review(&existing, &[]));
                }
                _ => {
                    tracing::info!(retry_after_ms = retry_after.as_millis() as u64, "refused: lane over its window");
                    return Err(ApiError::ResourceExhausted {
                        reason: "LANE_OVER_WINDOW",
                        what: "the tenant's share of the lane is over its service window",
                        retry_after,
                    });
                }
            },
        };
        span.record("review_depth", depth.as_str());
        let wait_ms = predicted_wait.map_or(0, |w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX));
        let late = submitted_at_ms.saturating_add(wait_ms);
        let msg = ReviewMessage {
            job_id: id.clone(),
            tenant: tenant.id.clone(),
            region,
            lane,
            schema_version,
            review_depth: depth,
            metadata: ReviewMetadata {
                repository: metadata.repository,
                base_revision: metadata.base_revision,
                head_revision: metadata.head_revision,
                pull_request: metadata.pull_request,
            },
            input_digest: job_id::sha256_hex(&[diff.bytes()]),
            diff: diff.utf8,
            diff_bytes: diff.raw,
            submitted_at_ms,
            request_digest,
            deadline_ms: Some(deadline_ms),
            replay_of: None,
        };
        if late >= deadline_ms {
            return self.too_late(handle, &msg).await;
        }
        let rec = match self.write_job(handle, &msg).await? {
            Created::New(rec, _) => rec,
            // A retry of a request we hold, or a worker that created the record from the
            // message first: the job as it stands, with its findings once it has them.
            Created::Exists(existing) if existing.request_digest == msg.request_digest => {
                tracing::debug!(state = existing.state.as_str(), "idempotent retry");
                return self.view(handle, &existing).await;
            }
            Created::Exists(_) => return Err(ApiError::AlreadyExists),
        };
        tracing::info!(state = rec.state.as_str(), "review accepted");
        Ok(api::review(&rec, &[]))
    }

    /// Makes a job durable: its lane message, its record and its index entry, written
    /// at once (one round trip of waiting, not three). The answer waits for all three.
    ///
    /// Crash semantics (docs/round-trips.md, "Submit: three writes at once"):
    /// - the lane message without the record (the record write failed, or the ingress
    ///   died first): the extractor creates the record from the message, which carries
    ///   all of it;
    /// - the record without the lane message: when the lane refused (full, or NATS
    ///   failed), the record this request created is removed again, so the refusal
    ///   leaves nothing behind; if the ingress died before that, the record is stranded
    ///   and the reconciler ends it `lost` after its grace — unless the caller retries
    ///   first, which writes the message again and carries on with the same record;
    /// - the index entry without the record: listing skips it; a retry adds it again
    ///   (listing drops repeats).
    ///
    /// A same-key retry always writes the lane message again: the lane drops the copy by
    /// `Nats-Msg-Id` (= job id), and a later copy finds the job's state and is dropped.
    async fn write_job(&self, handle: &RegionHandle, msg: &ReviewMessage) -> Result<Created, ApiError> {
        let payload = encode(handle, msg)?;
        let record = msg.record();
        let index = index(handle);
        let lane = async {
            self.faults.check(point::INGRESS_LANE)?;
            enqueue(handle, msg, payload).await
        };
        let create = async {
            self.faults.check(point::INGRESS_RECORD)?;
            handle.jobs.create(&record).await
        };
        let (enqueued, created, indexed) = tokio::join!(lane, create, index.add(&record, &msg.metadata.repository));
        if let Err(refused) = enqueued {
            if let Ok(Created::New(_, revision)) = created {
                self.undo_record(handle, &record.job_id, revision).await;
            }
            return Err(refused);
        }
        let created = created?;
        indexed?;
        Ok(created)
    }

    /// Removes a record this request created, unless anything wrote to it since.
    async fn undo_record(&self, handle: &RegionHandle, job_id: &str, revision: u64) {
        let undone = match self.faults.check(point::INGRESS_UNDO_RECORD) {
            Ok(()) => handle.jobs.kv().delete_expect_revision(job_id, Some(revision)).await.map_err(StoreError::other),
            Err(e) => Err(e),
        };
        if let Err(e) = undone {
            tracing::warn!(
                kind = e.kind(),
                "removing the record of a refused submit failed (or something wrote to it since); a same-key retry carries it on, and the reconciler ends it if nothing drives it"
            );
        }
    }

    /// A review that cannot be served before its deadline (it is past, or the lane's
    /// predicted wait passes it) ends `deadline_exceeded` at once: its record says so,
    /// and nothing of its content is kept or sent anywhere.
    async fn too_late(&self, handle: &RegionHandle, msg: &ReviewMessage) -> Result<proto::Review, ApiError> {
        let rec = match handle.jobs.create(&msg.record()).await? {
            Created::New(rec, _) => rec,
            Created::Exists(existing) if existing.request_digest == msg.request_digest => {
                return self.view(handle, &existing).await;
            }
            Created::Exists(_) => return Err(ApiError::AlreadyExists),
        };
        index(handle).add(&rec, &msg.metadata.repository).await?;
        let ended = Event::Terminate {
            reason: reviewlane_shared::job::TerminalReason::DeadlineExceeded,
            upstream_status: None,
            generation: None,
        };
        let rec = match handle.jobs.apply(&rec.job_id, &ended).await {
            Ok(r) => {
                self.metrics.terminal.inc(r.region, r.lane, reviewlane_shared::job::TerminalReason::DeadlineExceeded);
                tracing::info!("deadline before the predicted wait ends: ended at admission");
                r
            }
            Err(StoreError::Transition(_, current)) => *current,
            Err(e) => return Err(e.into()),
        };
        Ok(api::review(&rec, &[]))
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
}

#[instrument(skip_all, fields(
    otel.kind = "producer",
    job_id = %msg.job_id,
    tenant = %msg.tenant,
    region = %msg.region,
    lane = msg.lane.as_str(),
    messaging.system = "nats",
    messaging.operation.type = "publish",
    messaging.destination.name = %layout::lane_subject(msg.region, msg.lane, &msg.tenant, &msg.job_id),
))]
async fn enqueue(handle: &RegionHandle, msg: &ReviewMessage, payload: Vec<u8>) -> Result<(), ApiError> {
    let subject = layout::lane_subject(msg.region, msg.lane, &msg.tenant, &msg.job_id);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, msg.job_id.as_str());
    reviewlane_shared::telemetry::inject_nats(&mut headers);
    let ack = handle
        .layout
        .js
        .publish_with_headers(subject, headers, payload.into())
        .await
        .map_err(|e| ApiError::Unavailable(e.into()))?
        .await;
    match ack {
        Ok(_) => Ok(()),
        Err(e) if is_stream_full(&e) => {
            Err(ApiError::ResourceExhausted { reason: "LANE_FULL", what: "lane is full", retry_after: LANE_FULL_RETRY })
        }
        // The server out of space is a full store, not a full lane.
        Err(e) => Err(StoreError::publish(e).into()),
    }
}

/// The lane message's bytes, refused before anything is written when the server would
/// not take it.
fn encode(handle: &RegionHandle, msg: &ReviewMessage) -> Result<Vec<u8>, ApiError> {
    let payload = serde_json::to_vec(msg).map_err(|e| ApiError::Internal(e.into()))?;
    if payload.len() > handle.max_payload {
        return Err(ApiError::invalid(
            "diff",
            format!("review is {} bytes once encoded, over the server's {} bytes", payload.len(), handle.max_payload),
        ));
    }
    Ok(payload)
}

/// A lane at its maximum backlog refuses new messages (discard new).
fn is_stream_full(e: &jetstream::context::PublishError) -> bool {
    std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>()).is_some_and(|j| {
        j.error_code() == jetstream::ErrorCode::STREAM_STORE_FAILED
            || j.error_code() == jetstream::ErrorCode::STREAM_MAX_STREAM_BYTES_EXCEEDED
    })
}

async fn read_findings(handle: &RegionHandle, rec: &JobRecord) -> Result<Vec<Finding>, ApiError> {
    // The result of the generation the record validated, never a stale holder's.
    let kept = handle.results.read(&rec.tenant, &rec.job_id, rec.generation()).await?;
    Ok(kept.map(|m| m.findings).unwrap_or_default())
}

/// The deadline a submit asks for (a timestamp, or a timeout from now), else the lane's
/// default, in ms since the epoch.
fn deadline_of(req: &SubmitReviewRequest, now_ms: u64, lane_default: Duration) -> Result<u64, ApiError> {
    match (&req.deadline, &req.timeout) {
        (Some(_), Some(_)) => Err(ApiError::invalid("deadline", "set one of `deadline` and `timeout`, not both")),
        (Some(t), None) => {
            let ms = i128::from(t.seconds) * 1000 + i128::from(t.nanos) / 1_000_000;
            u64::try_from(ms).map_err(|_| ApiError::invalid("deadline", "before 1970"))
        }
        (None, Some(d)) => {
            let d = Duration::try_from(*d).map_err(|_| ApiError::invalid("timeout", "negative or out of range"))?;
            Ok(now_ms.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
        }
        (None, None) => Ok(now_ms.saturating_add(u64::try_from(lane_default.as_millis()).unwrap_or(u64::MAX))),
    }
}

/// The diff of a submit, in whichever of the two forms the caller used.
struct SubmittedDiff {
    /// The diff when it is UTF-8 (sent as `diff`, or as `diff_bytes` that happen to be).
    utf8: String,
    /// The bytes of a `diff_bytes` that is not UTF-8, kept exactly as sent.
    raw: Option<Vec<u8>>,
}

impl SubmittedDiff {
    /// Takes the diff out of the request: exactly one form, within `limit` bytes.
    fn from_request(req: &mut SubmitReviewRequest, limit: usize) -> Result<Self, ApiError> {
        let (field, len) = match (req.diff.is_empty(), req.diff_bytes.is_empty()) {
            (false, false) => return Err(ApiError::invalid("diff", "set one of `diff` and `diff_bytes`, not both")),
            (true, false) => ("diff_bytes", req.diff_bytes.len()),
            _ => ("diff", req.diff.len()),
        };
        if len > limit {
            return Err(ApiError::invalid(field, format!("diff is {len} bytes, over the limit of {limit} bytes")));
        }
        if field == "diff" {
            return Ok(SubmittedDiff { utf8: std::mem::take(&mut req.diff), raw: None });
        }
        // Bytes that are UTF-8 are the same diff as the string form: same digests, same
        // job for the same idempotency key.
        Ok(match String::from_utf8(std::mem::take(&mut req.diff_bytes)) {
            Ok(utf8) => SubmittedDiff { utf8, raw: None },
            Err(e) => SubmittedDiff { utf8: String::new(), raw: Some(e.into_bytes()) },
        })
    }

    /// The diff without terminal colours (pasted from `git diff --color=always`): what
    /// is reviewed, stored and digested is the plain diff.
    fn without_colours(self) -> Self {
        let Some(plain) = diff::strip_colours(self.bytes()) else { return self };
        match String::from_utf8(plain) {
            Ok(utf8) => SubmittedDiff { utf8, raw: None },
            Err(e) => SubmittedDiff { utf8: String::new(), raw: Some(e.into_bytes()) },
        }
    }

    fn bytes(&self) -> &[u8] {
        self.raw.as_deref().unwrap_or(self.utf8.as_bytes())
    }

    fn text(&self) -> std::borrow::Cow<'_, str> {
        match &self.raw {
            Some(b) => String::from_utf8_lossy(b),
            None => std::borrow::Cow::Borrowed(&self.utf8),
        }
    }
}

/// A client-supplied id goes into a span only when it has the shape of a job id.
fn span_id(id: &str) -> &str {
    if job_id::region_of(id).is_ok() { id } else { "malformed" }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchReviewResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ReviewService for ReviewApi {
    async fn submit_review(&self, req: Request<SubmitReviewRequest>) -> Result<Response<SubmitReviewResponse>, Status> {
        let started = Instant::now();
        let res = async {
            let tenant = self.auth.tenant(&req)?;
            let review =
                self.submit(&tenant, req.into_inner()).await.inspect_err(|e| self.note_store(tenant.region, e))?;
            Ok(Response::new(SubmitReviewResponse { review: Some(review) }))
        }
        .await;
        self.metrics.finish("SubmitReview", started, res)
    }

    async fn get_review(&self, req: Request<GetReviewRequest>) -> Result<Response<GetReviewResponse>, Status> {
        let started = Instant::now();
        let res = async {
            let tenant = self.auth.tenant(&req)?;
            let (handle, rec) = self.owned_job(&tenant, &req.get_ref().job_id).await?;
            let review = self.view(handle, &rec).await?;
            Ok(Response::new(GetReviewResponse { review: Some(review) }))
        }
        .await;
        self.metrics.finish("GetReview", started, res)
    }

    type WatchReviewStream = WatchStream;

    async fn watch_review(
        &self,
        req: Request<WatchReviewRequest>,
    ) -> Result<Response<Self::WatchReviewStream>, Status> {
        let started = Instant::now();
        let res = self.watch(req).await;
        self.metrics.finish("WatchReview", started, res)
    }

    async fn cancel_review(&self, req: Request<CancelReviewRequest>) -> Result<Response<CancelReviewResponse>, Status> {
        let started = Instant::now();
        let res = self.cancel(req).await;
        self.metrics.finish("CancelReview", started, res)
    }

    async fn list_dead_letters(
        &self,
        req: Request<ListDeadLettersRequest>,
    ) -> Result<Response<ListDeadLettersResponse>, Status> {
        let started = Instant::now();
        let res = async {
            let caller = self.auth.tenant(&req)?;
            Ok(Response::new(self.list_dead(&caller, req.into_inner()).await?))
        }
        .await;
        self.metrics.finish("ListDeadLetters", started, res)
    }

    async fn get_dead_letter(
        &self,
        req: Request<GetDeadLetterRequest>,
    ) -> Result<Response<GetDeadLetterResponse>, Status> {
        let started = Instant::now();
        let res = async {
            let caller = self.auth.tenant(&req)?;
            let (handle, dead) = self.dead_letter(&caller, &req.get_ref().job_id).await?;
            let kept = dead_letters(handle).content(&dead).await.map_err(ApiError::from)?.is_some();
            Ok(Response::new(GetDeadLetterResponse { dead_letter: Some(api::dead_letter(&dead, kept)) }))
        }
        .await;
        self.metrics.finish("GetDeadLetter", started, res)
    }

    async fn replay_dead_letter(
        &self,
        req: Request<ReplayDeadLetterRequest>,
    ) -> Result<Response<ReplayDeadLetterResponse>, Status> {
        let started = Instant::now();
        let res = async {
            let caller = self.auth.tenant(&req)?;
            let review = self.replay(&caller, &req.get_ref().job_id).await?;
            Ok(Response::new(ReplayDeadLetterResponse { review: Some(review) }))
        }
        .await;
        self.metrics.finish("ReplayDeadLetter", started, res)
    }

    async fn list_lanes(&self, req: Request<ListLanesRequest>) -> Result<Response<ListLanesResponse>, Status> {
        let started = Instant::now();
        let res = async {
            let caller = self.auth.tenant(&req)?;
            if caller.role != Role::Operator {
                return Err(ApiError::PermissionDenied {
                    reason: "OPERATOR_ROLE_REQUIRED",
                    what: "listing lanes needs an operator key",
                }
                .into());
            }
            Ok(Response::new(ListLanesResponse { lanes: self.lanes(caller.region).await? }))
        }
        .await;
        self.metrics.finish("ListLanes", started, res)
    }

    async fn list_reviews(&self, req: Request<ListReviewsRequest>) -> Result<Response<ListReviewsResponse>, Status> {
        let started = Instant::now();
        let res = async {
            let tenant = self.auth.tenant(&req)?;
            Ok(Response::new(self.list(&tenant, req.into_inner()).await?))
        }
        .await;
        self.metrics.finish("ListReviews", started, res)
    }
}

impl ReviewApi {
    pub fn authenticator(&self) -> Authenticator {
        self.auth.clone()
    }

    pub fn metrics(&self) -> Metrics {
        self.metrics.clone()
    }

    async fn watch(&self, req: Request<WatchReviewRequest>) -> Result<Response<WatchStream>, Status> {
        let tenant = self.auth.tenant(&req)?;
        let id = req.into_inner().job_id;
        let (handle, _) = self.owned_job(&tenant, &id).await?;
        let permit = self.watch_permit(&tenant.id)?;
        // Read, then follow every later revision: nothing falls between the two.
        let (mut rec, last) = handle.jobs.get(&id).await.map_err(ApiError::from)?.ok_or(ApiError::NotFound)?;
        let mut changes = handle.jobs.changes_after(&id, last).await.map_err(ApiError::from)?;
        let (tx, rx) = mpsc::channel(8);
        let api = self.clone();
        let handle = handle.clone();
        let shutdown = self.shutdown.clone();
        let every = self.limits.watch_keepalive;
        tokio::spawn(
            async move {
                // Held while the stream is open.
                let _permit = permit;
                // Sends the review as it stands at least this often: callers and proxies
                // see the stream alive.
                let mut keepalive = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                loop {
                    let review = match api.view(&handle, &rec).await {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = tx.send(Err(e.into())).await;
                            return;
                        }
                    };
                    if tx.send(Ok(WatchReviewResponse { review: Some(review) })).await.is_err() || rec.state.is_final()
                    {
                        return;
                    }
                    // The next revision, or the review as it stands when the keepalive is due.
                    tokio::select! {
                        c = changes.next() => match c {
                            Some(Ok(Some((r, _)))) => rec = r,
                            // Removed under the watch (retention).
                            Some(Ok(None)) => {
                                let _ = tx.send(Err(ApiError::NotFound.into())).await;
                                return;
                            }
                            None => {
                                let lost = ApiError::StreamInterrupted {
                                    reason: "REGION_STORE_UNAVAILABLE",
                                    what: "region store connection lost; watch again",
                                };
                                let _ = tx.send(Err(lost.into())).await;
                                return;
                            }
                            Some(Err(e)) => {
                                let _ = tx.send(Err(ApiError::from(e).into())).await;
                                return;
                            }
                        },
                        _ = keepalive.tick() => {}
                        _ = shutdown.cancelled() => {
                            let down = ApiError::StreamInterrupted { reason: "SHUTTING_DOWN", what: "server shutting down; watch again" };
                            let _ = tx.send(Err(down.into())).await;
                            return;
                        }
                        _ = tx.closed() => return,
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn cancel(&self, req: Request<CancelReviewRequest>) -> Result<Response<CancelReviewResponse>, Status> {
        let tenant = self.auth.tenant(&req)?;
        let (handle, rec) = self.owned_job(&tenant, &req.get_ref().job_id).await?;
        let rec = match handle.jobs.apply(&rec.job_id, &Event::Cancel).await {
            Ok(r) => {
                tracing::info!("review cancelled");
                self.metrics.terminal.inc(r.region, r.lane, reviewlane_shared::job::TerminalReason::Cancelled);
                // A cancelled job keeps none of its content. If this fails, retention
                // removes it later; the cancel itself stands.
                if let Err(e) = reviewlane_shared::content::drop_content(&handle.layout, &r).await {
                    tracing::warn!(error = %e, kind = e.kind(), "dropping a cancelled job's content failed");
                }
                r
            }
            Err(StoreError::Transition(_, current)) => *current,
            Err(e) => return Err(ApiError::from(e).into()),
        };
        let review = self.view(handle, &rec).await?;
        Ok(Response::new(CancelReviewResponse { review: Some(review) }))
    }
}
