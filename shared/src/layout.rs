//! The NATS layout of one region: stream and bucket names, their idempotent creation,
//! and the region identity every service checks before it touches content.
//!
//! The identity (KV `REGION_<R>`, key `identity`) is written once, deliberately, by
//! provisioning (`reviewlane-admin provision`); services only verify it. A service
//! never claims an unprovisioned server, so a miswired URL cannot stamp the wrong
//! identity on it.

use std::time::Duration;

use async_nats::jetstream::{self, kv, object_store, stream};

use reviewlane_core::job::ReviewDepth;
use reviewlane_core::region::{Lane, Region};

pub const IDENTITY_KEY: &str = "identity";

pub fn lane_stream(r: Region, lane: Lane) -> String {
    format!("REVIEWS_{}_{}", r.upper(), lane.upper())
}
/// `reviews.<r>.<lane>.<tenant>.>`: one tenant's reviews on a lane (a consumer's filter).
pub fn lane_filter(r: Region, lane: Lane, tenant: &str) -> String {
    format!("reviews.{}.{}.{}.>", r.as_str(), lane.as_str(), tenant)
}
/// One tenant's reviews of one depth on a lane, for a tenant whose reviews at depth
/// `changed_hunks` have a model class of their own (`Tenant::splits_depth`): full
/// depth `reviews.<r>.<lane>.<tenant>.*`, the other `...<tenant>.changed_hunks.*`.
pub fn lane_depth_filter(r: Region, lane: Lane, tenant: &str, depth: ReviewDepth) -> String {
    match depth {
        ReviewDepth::Full => format!("reviews.{}.{}.{}.*", r.as_str(), lane.as_str(), tenant),
        ReviewDepth::ChangedHunks => format!("reviews.{}.{}.{}.changed_hunks.*", r.as_str(), lane.as_str(), tenant),
    }
}
/// `reviews.<r>.<lane>.<tenant>.<job id>` (`...<tenant>.changed_hunks.<job id>` for a
/// review admitted at that depth): one subject per job, so the reconciler can tell with
/// one look-up whether a job still has its message on the lane.
pub fn lane_subject(r: Region, lane: Lane, tenant: &str, depth: ReviewDepth, job_id: &str) -> String {
    match depth {
        ReviewDepth::Full => format!("reviews.{}.{}.{}.{}", r.as_str(), lane.as_str(), tenant, job_id),
        ReviewDepth::ChangedHunks => {
            format!("reviews.{}.{}.{}.changed_hunks.{}", r.as_str(), lane.as_str(), tenant, job_id)
        }
    }
}
/// The extractor's durable consumer of one tenant's reviews on a lane (of its full-depth
/// reviews where `lane_depth_consumer` takes the others); the ingress reads its counts
/// (waiting, in progress) for per-tenant admission.
pub fn lane_consumer(lane: Lane, tenant: &str) -> String {
    format!("extractor-{}-{}", lane.as_str(), tenant)
}
/// The extractor's durable consumer of one tenant's reviews at depth `changed_hunks` on a
/// lane, where they have a class of their own. Its second word is never a lane's, so it
/// never names another tenant's `lane_consumer`.
pub fn lane_depth_consumer(lane: Lane, tenant: &str) -> String {
    format!("extractor-changed_hunks-{}-{}", lane.as_str(), tenant)
}
pub fn findings_stream(r: Region) -> String {
    format!("FINDINGS_{}", r.upper())
}
/// `findings.<r>.<tenant>.<job id>.<generation>`: one subject per lease generation of a
/// job, so readers take exactly the result the job record validated (a holder that lost
/// its lease may still have written one for its own, stale generation).
pub fn findings_subject(r: Region, tenant: &str, job_id: &str, generation: u32) -> String {
    format!("findings.{}.{}.{}.{}", r.as_str(), tenant, job_id, generation)
}
/// The kept results of a split review's parts (see `chunk`): read back by the holder
/// that merges them, never delivered.
pub fn parts_stream(r: Region) -> String {
    format!("PARTS_{}", r.upper())
}
/// `parts.<r>.<tenant>.<job id>.<part index>`: one subject per part of a job.
pub fn parts_subject(r: Region, tenant: &str, job_id: &str, index: u32) -> String {
    format!("parts.{}.{}.{}.{}", r.as_str(), tenant, job_id, index)
}
/// The job index (see `job_index`): one entry per job, kept as long as job records.
pub fn index_stream(r: Region) -> String {
    format!("INDEX_{}", r.upper())
}
/// `index.<r>.<tenant>.<hour>`: a tenant's jobs created in one hour (hours since the
/// Unix epoch).
pub fn index_subject(r: Region, tenant: &str, hour: u64) -> String {
    format!("index.{}.{}.{}", r.as_str(), tenant, hour)
}
/// Object store of results too large for one message: `FINDINGS_<R>` (stream
/// `OBJ_FINDINGS_<R>`), object name `<job id>.<generation>`.
pub fn findings_objects(r: Region) -> String {
    format!("FINDINGS_{}", r.upper())
}
pub fn deadletter_stream(r: Region) -> String {
    format!("DEADLETTER_{}", r.upper())
}
/// `deadletter.<r>.<tenant>.<job id>`: the reference of a dead letter (what an
/// operator needs to decide and replay), kept `deadletter_max_age`.
pub fn deadletter_subject(r: Region, tenant: &str, job_id: &str) -> String {
    format!("deadletter.{}.{}.{}", r.as_str(), tenant, job_id)
}
/// Dead letters' content (the review with its diff), kept `deadletter_content_max_age`.
pub fn deadletter_content_stream(r: Region) -> String {
    format!("DEADLETTER_CONTENT_{}", r.upper())
}
/// `deadletter_content.<r>.<tenant>.<job id>`: the content a reference points to.
pub fn deadletter_content_subject(r: Region, tenant: &str, job_id: &str) -> String {
    format!("deadletter_content.{}.{}.{}", r.as_str(), tenant, job_id)
}
pub fn jobs_bucket(r: Region) -> String {
    format!("JOBS_{}", r.upper())
}
pub fn published_bucket(r: Region) -> String {
    format!("PUBLISHED_{}", r.upper())
}
pub fn quota_bucket(r: Region) -> String {
    format!("QUOTA_{}", r.upper())
}
pub fn cache_bucket(r: Region) -> String {
    format!("CACHE_{}", r.upper())
}

/// Sweeps and their manifests (`sweeps`).
pub fn sweeps_bucket(r: Region) -> String {
    format!("SWEEPS_{}", r.upper())
}

pub fn region_bucket(r: Region) -> String {
    format!("REGION_{}", r.upper())
}

/// Sizes, retention and replicas of the region's streams and buckets: provisioning's
/// config (`reviewlane-admin provision`, `REVIEWLANE_*` below), the defaults in
/// `docs/retention.md`. The services never read it: they open what was provisioned.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutConfig {
    /// Replicas of every stream and bucket (1 on a single server, 3 on a cluster).
    pub replicas: usize,
    /// Maximum messages waiting in one lane; publishing beyond is refused (discard new).
    pub lane_max_messages: i64,
    /// Maximum bytes waiting in one lane; publishing beyond is refused.
    pub lane_max_bytes: i64,
    /// How long a review may wait on its lane; one older is removed and its job ended
    /// `lost` by the reconciler.
    pub lane_max_age: Duration,
    /// Largest message (a review with its diff) a stream accepts.
    pub max_message_bytes: i32,
    /// Job records (and with them idempotency keys: a job id is derived from its key)
    /// are removed this long after their last change, which for a finished job is the
    /// change that finished it.
    pub jobs_max_age: Duration,
    /// What the region's publishers share besides the job records: the pacing of
    /// GitHub deliveries (and delivery claims written by releases that kept them here).
    pub published_max_age: Duration,
    /// Results (findings and quarantined findings, inline or as objects).
    pub findings_max_age: Duration,
    pub findings_max_bytes: i64,
    /// Dead-letter references (job, tenant, reason, attempts, digest).
    pub deadletter_max_age: Duration,
    /// The content (the review with its diff) of a dead letter.
    pub deadletter_content_max_age: Duration,
    /// Quota state (windows, pauses, circuits, replica heartbeats).
    pub quota_max_age: Duration,
    /// Cached validated results.
    pub cache_max_age: Duration,
}

const DAY: Duration = Duration::from_secs(24 * 3600);

impl Default for LayoutConfig {
    fn default() -> Self {
        LayoutConfig {
            replicas: 1,
            lane_max_messages: 100_000,
            lane_max_bytes: 8 * 1024 * 1024 * 1024,
            lane_max_age: 7 * DAY,
            max_message_bytes: 8 * 1024 * 1024,
            jobs_max_age: 30 * DAY,
            published_max_age: 30 * DAY,
            findings_max_age: 7 * DAY,
            findings_max_bytes: 8 * 1024 * 1024 * 1024,
            deadletter_max_age: 30 * DAY,
            deadletter_content_max_age: 7 * DAY,
            quota_max_age: DAY,
            cache_max_age: DAY,
        }
    }
}

impl LayoutConfig {
    /// Reads the layout from `REVIEWLANE_*` variables (each with its default) and checks
    /// the rules between them.
    pub fn from_reader(r: &mut reviewlane_core::config::Reader<'_>) -> LayoutConfig {
        let d = LayoutConfig::default();
        let days = |r: &mut reviewlane_core::config::Reader<'_>, key: &str, default: Duration| {
            Duration::from_secs(r.or(key, default.as_secs(), "whole seconds"))
        };
        let c = LayoutConfig {
            replicas: r.or("REVIEWLANE_STREAM_REPLICAS", d.replicas, "1 to 5"),
            lane_max_messages: r.or("REVIEWLANE_LANE_MAX_MESSAGES", d.lane_max_messages, "a count"),
            lane_max_bytes: r.or("REVIEWLANE_LANE_MAX_BYTES", d.lane_max_bytes, "bytes"),
            lane_max_age: days(r, "REVIEWLANE_LANE_MAX_AGE_SECS", d.lane_max_age),
            max_message_bytes: r.or("REVIEWLANE_MAX_MESSAGE_BYTES", d.max_message_bytes, "bytes"),
            jobs_max_age: days(r, "REVIEWLANE_JOBS_MAX_AGE_SECS", d.jobs_max_age),
            published_max_age: days(r, "REVIEWLANE_PUBLISHED_MAX_AGE_SECS", d.published_max_age),
            findings_max_age: days(r, "REVIEWLANE_FINDINGS_MAX_AGE_SECS", d.findings_max_age),
            findings_max_bytes: r.or("REVIEWLANE_FINDINGS_MAX_BYTES", d.findings_max_bytes, "bytes"),
            deadletter_max_age: days(r, "REVIEWLANE_DEADLETTER_MAX_AGE_SECS", d.deadletter_max_age),
            deadletter_content_max_age: days(
                r,
                "REVIEWLANE_DEADLETTER_CONTENT_MAX_AGE_SECS",
                d.deadletter_content_max_age,
            ),
            quota_max_age: days(r, "REVIEWLANE_QUOTA_MAX_AGE_SECS", d.quota_max_age),
            cache_max_age: days(r, "REVIEWLANE_CACHE_MAX_AGE_SECS", d.cache_max_age),
        };
        for problem in c.problems() {
            r.error(problem);
        }
        c
    }

    /// The rules between the values, as config errors.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !(1..=5).contains(&self.replicas) {
            out.push("REVIEWLANE_STREAM_REPLICAS must be 1 to 5".to_string());
        }
        for (key, v) in [
            ("REVIEWLANE_LANE_MAX_MESSAGES", self.lane_max_messages),
            ("REVIEWLANE_LANE_MAX_BYTES", self.lane_max_bytes),
            ("REVIEWLANE_FINDINGS_MAX_BYTES", self.findings_max_bytes),
            ("REVIEWLANE_MAX_MESSAGE_BYTES", i64::from(self.max_message_bytes)),
        ] {
            if v <= 0 {
                out.push(format!("{key} must be positive"));
            }
        }
        for (key, v) in [
            ("REVIEWLANE_LANE_MAX_AGE_SECS", self.lane_max_age),
            ("REVIEWLANE_JOBS_MAX_AGE_SECS", self.jobs_max_age),
            ("REVIEWLANE_PUBLISHED_MAX_AGE_SECS", self.published_max_age),
            ("REVIEWLANE_FINDINGS_MAX_AGE_SECS", self.findings_max_age),
            ("REVIEWLANE_DEADLETTER_MAX_AGE_SECS", self.deadletter_max_age),
            ("REVIEWLANE_DEADLETTER_CONTENT_MAX_AGE_SECS", self.deadletter_content_max_age),
            ("REVIEWLANE_QUOTA_MAX_AGE_SECS", self.quota_max_age),
            ("REVIEWLANE_CACHE_MAX_AGE_SECS", self.cache_max_age),
        ] {
            if v.is_zero() {
                out.push(format!("{key} must be positive"));
            }
        }
        // A result outliving its job record (which holds the delivery claim and the
        // `published` state) would be delivered for a job nobody can look up.
        if self.jobs_max_age < self.findings_max_age {
            out.push("REVIEWLANE_JOBS_MAX_AGE_SECS must be at least REVIEWLANE_FINDINGS_MAX_AGE_SECS".into());
        }
        if self.jobs_max_age < self.lane_max_age {
            out.push("REVIEWLANE_JOBS_MAX_AGE_SECS must be at least REVIEWLANE_LANE_MAX_AGE_SECS".into());
        }
        if self.deadletter_content_max_age > self.deadletter_max_age {
            out.push("REVIEWLANE_DEADLETTER_CONTENT_MAX_AGE_SECS must not exceed REVIEWLANE_DEADLETTER_MAX_AGE_SECS (content without its reference)".into());
        }
        out
    }
}

/// Handles on one region's streams and buckets.
#[derive(Clone)]
pub struct RegionLayout {
    pub region: Region,
    pub js: jetstream::Context,
    /// The largest message every lane stream accepts, as provisioned (the server's
    /// `max_payload` bounds it too: see `results::message_max`).
    pub max_message_bytes: Option<usize>,
    pub jobs: kv::Store,
    pub published: kv::Store,
    pub quota: kv::Store,
    pub cache: kv::Store,
    pub sweeps: kv::Store,
    /// Results too large for one message.
    pub objects: object_store::ObjectStore,
}

#[derive(Debug, thiserror::Error)]
pub enum WiringError {
    #[error(
        "configured for region `{configured}` but the NATS server at {url} carries region identity `{found}`; refusing to start"
    )]
    Mismatch { configured: Region, found: Region, url: String },
    #[error(
        "the NATS server at {url} carries no region identity; provision it first (`reviewlane-admin provision --region {configured} --nats-url {url}`)"
    )]
    Unprovisioned { configured: Region, url: String },
    #[error("the NATS server at {url} carries conflicting region identities")]
    Conflicting { url: String },
    #[error(
        "the NATS server at {url} lacks {missing} of region {configured}; provision it (`reviewlane-admin provision --region {configured} --nats-url {url}`)"
    )]
    NotLaidOut { configured: Region, url: String, missing: String },
    #[error("NATS error while checking the region identity at {url}: {source}")]
    Nats { url: String, source: async_nats::Error },
}

/// The identity recorded on the server, if any.
pub async fn read_identity(js: &jetstream::Context, url: &str) -> Result<Option<Region>, WiringError> {
    let nats = |e: async_nats::Error| WiringError::Nats { url: url.to_string(), source: e };
    let mut found = None;
    for r in Region::ALL {
        if !stream_exists(js, &format!("KV_{}", region_bucket(r))).await.map_err(nats)? {
            continue;
        }
        let store = js.get_key_value(region_bucket(r)).await.map_err(|e| nats(e.into()))?;
        let Some(v) = store.get(IDENTITY_KEY).await.map_err(|e| nats(e.into()))? else {
            continue;
        };
        let id: Region = std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| WiringError::Conflicting { url: url.to_string() })?;
        if id != r || found.is_some_and(|f| f != id) {
            return Err(WiringError::Conflicting { url: url.to_string() });
        }
        found = Some(id);
    }
    Ok(found)
}

/// Refuses unless the server is provisioned for `configured`.
pub async fn verify_identity(js: &jetstream::Context, configured: Region, url: &str) -> Result<(), WiringError> {
    match read_identity(js, url).await? {
        Some(found) if found == configured => Ok(()),
        Some(found) => Err(WiringError::Mismatch { configured, found, url: url.to_string() }),
        None => Err(WiringError::Unprovisioned { configured, url: url.to_string() }),
    }
}

/// Records `region` as the server's identity, unless it already carries another.
pub async fn provision_identity(js: &jetstream::Context, region: Region, url: &str) -> Result<(), WiringError> {
    let nats = |e: async_nats::Error| WiringError::Nats { url: url.to_string(), source: e };
    match read_identity(js, url).await? {
        Some(found) if found == region => return Ok(()),
        Some(found) => return Err(WiringError::Mismatch { configured: region, found, url: url.to_string() }),
        None => {}
    }
    let store = get_or_create_kv(js, kv::Config { bucket: region_bucket(region), history: 1, ..Default::default() })
        .await
        .map_err(nats)?;
    match store.create(IDENTITY_KEY, region.as_str().into()).await {
        Ok(_) => {}
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
        Err(e) => return Err(nats(e.into())),
    }
    verify_identity(js, region, url).await
}

pub async fn stream_exists(js: &jetstream::Context, name: &str) -> Result<bool, async_nats::Error> {
    match js.get_stream(name).await {
        Ok(_) => Ok(true),
        Err(e) => match e.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(false)
            }
            _ => Err(e.into()),
        },
    }
}

async fn get_or_create_kv(js: &jetstream::Context, config: kv::Config) -> Result<kv::Store, async_nats::Error> {
    if stream_exists(js, &format!("KV_{}", config.bucket)).await? {
        return Ok(js.get_key_value(config.bucket).await?);
    }
    Ok(js.create_key_value(config).await?)
}

/// What reviewlane sets, and so checks, of one stream's config (a KV bucket and an
/// object store are streams too: `KV_<bucket>`, `OBJ_<bucket>`).
#[derive(Debug, Clone, PartialEq)]
struct Managed {
    retention: stream::RetentionPolicy,
    storage: stream::StorageType,
    discard: stream::DiscardPolicy,
    max_messages: i64,
    max_bytes: i64,
    max_age: Duration,
    max_message_size: i32,
    max_messages_per_subject: i64,
    num_replicas: usize,
}

impl Managed {
    fn of(c: &stream::Config) -> Managed {
        // The server stores "unlimited" as -1 whatever was sent for it.
        let limit = |v: i64| if v <= 0 { -1 } else { v };
        Managed {
            retention: c.retention,
            storage: c.storage,
            discard: c.discard,
            max_messages: limit(c.max_messages),
            max_bytes: limit(c.max_bytes),
            max_age: c.max_age,
            max_message_size: if c.max_message_size <= 0 { -1 } else { c.max_message_size },
            max_messages_per_subject: limit(c.max_messages_per_subject),
            num_replicas: c.num_replicas.max(1),
        }
    }

    /// (field, have, want, whether the server lets it change in place).
    fn diff(&self, want: &Managed) -> Vec<(&'static str, String, String, bool)> {
        let mut out = Vec::new();
        let mut check = |field, have: String, want: String, mutable| {
            if have != want {
                out.push((field, have, want, mutable));
            }
        };
        check("retention", format!("{:?}", self.retention), format!("{:?}", want.retention), false);
        check("storage", format!("{:?}", self.storage), format!("{:?}", want.storage), false);
        check("discard", format!("{:?}", self.discard), format!("{:?}", want.discard), true);
        check("max_messages", self.max_messages.to_string(), want.max_messages.to_string(), true);
        check("max_bytes", self.max_bytes.to_string(), want.max_bytes.to_string(), true);
        check("max_age", format!("{:?}", self.max_age), format!("{:?}", want.max_age), true);
        check("max_message_size", self.max_message_size.to_string(), want.max_message_size.to_string(), true);
        check(
            "max_messages_per_subject",
            self.max_messages_per_subject.to_string(),
            want.max_messages_per_subject.to_string(),
            true,
        );
        check("num_replicas", self.num_replicas.to_string(), want.num_replicas.to_string(), true);
        out
    }

    fn apply(&self, c: &mut stream::Config) {
        c.discard = self.discard;
        c.max_messages = self.max_messages;
        c.max_bytes = self.max_bytes;
        c.max_age = self.max_age;
        c.max_message_size = self.max_message_size;
        c.max_messages_per_subject = self.max_messages_per_subject;
        c.num_replicas = self.num_replicas;
    }
}

/// How one stream or bucket is created.
enum Create {
    Stream(stream::Config),
    Kv(kv::Config),
    Objects(object_store::Config),
}

/// One stream or bucket of the region: its stream name, how to create it, and what of
/// its config must match.
struct Spec {
    stream: String,
    create: Create,
    managed: Managed,
}

fn specs(region: Region, cfg: &LayoutConfig) -> Vec<Spec> {
    let mut out = Vec::new();
    let stream_spec = |name: String, subjects: Vec<String>, m: Managed| Spec {
        stream: name.clone(),
        create: Create::Stream(stream::Config {
            name,
            subjects,
            retention: m.retention,
            storage: m.storage,
            discard: m.discard,
            max_messages: m.max_messages,
            max_bytes: m.max_bytes,
            max_age: m.max_age,
            max_message_size: m.max_message_size,
            num_replicas: m.num_replicas,
            ..Default::default()
        }),
        managed: m,
    };
    let base = Managed {
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        discard: stream::DiscardPolicy::Old,
        max_messages: -1,
        max_bytes: -1,
        max_age: Duration::ZERO,
        max_message_size: cfg.max_message_bytes,
        max_messages_per_subject: -1,
        num_replicas: cfg.replicas,
    };
    for lane in Lane::ALL {
        out.push(stream_spec(
            lane_stream(region, lane),
            vec![format!("reviews.{}.{}.>", region.as_str(), lane.as_str())],
            Managed {
                retention: stream::RetentionPolicy::WorkQueue,
                discard: stream::DiscardPolicy::New,
                max_messages: cfg.lane_max_messages,
                max_bytes: cfg.lane_max_bytes,
                max_age: cfg.lane_max_age,
                ..base.clone()
            },
        ));
    }
    out.push(stream_spec(
        findings_stream(region),
        vec![format!("findings.{}.>", region.as_str())],
        Managed { max_age: cfg.findings_max_age, max_bytes: cfg.findings_max_bytes, ..base.clone() },
    ));
    out.push(stream_spec(
        index_stream(region),
        vec![format!("index.{}.>", region.as_str())],
        Managed { max_age: cfg.jobs_max_age, ..base.clone() },
    ));
    // Bounded by age only, like the dead letters: a byte limit is reserved on the
    // server's disk up front, and parts are read back within minutes of being kept.
    out.push(stream_spec(
        parts_stream(region),
        vec![format!("parts.{}.>", region.as_str())],
        Managed { max_age: cfg.findings_max_age, ..base.clone() },
    ));
    out.push(stream_spec(
        deadletter_stream(region),
        vec![format!("deadletter.{}.>", region.as_str())],
        Managed { max_age: cfg.deadletter_max_age, ..base.clone() },
    ));
    out.push(stream_spec(
        deadletter_content_stream(region),
        vec![format!("deadletter_content.{}.>", region.as_str())],
        Managed { max_age: cfg.deadletter_content_max_age, ..base.clone() },
    ));
    let kv_spec = |bucket: String, max_age: Duration| Spec {
        stream: format!("KV_{bucket}"),
        create: Create::Kv(kv::Config {
            bucket,
            history: 1,
            max_age,
            storage: stream::StorageType::File,
            num_replicas: cfg.replicas,
            ..Default::default()
        }),
        managed: Managed {
            discard: stream::DiscardPolicy::New,
            max_age,
            max_message_size: -1,
            max_messages_per_subject: 1,
            ..base.clone()
        },
    };
    out.push(kv_spec(jobs_bucket(region), cfg.jobs_max_age));
    out.push(kv_spec(published_bucket(region), cfg.published_max_age));
    out.push(kv_spec(quota_bucket(region), cfg.quota_max_age));
    out.push(kv_spec(cache_bucket(region), cfg.cache_max_age));
    // A sweep lives as long as the jobs its items became.
    out.push(kv_spec(sweeps_bucket(region), cfg.jobs_max_age));
    out.push(Spec {
        stream: format!("OBJ_{}", findings_objects(region)),
        create: Create::Objects(object_store::Config {
            bucket: findings_objects(region),
            max_age: cfg.findings_max_age,
            max_bytes: cfg.findings_max_bytes,
            storage: stream::StorageType::File,
            num_replicas: cfg.replicas,
            ..Default::default()
        }),
        managed: Managed {
            discard: stream::DiscardPolicy::New,
            max_age: cfg.findings_max_age,
            max_bytes: cfg.findings_max_bytes,
            max_message_size: -1,
            ..base.clone()
        },
    });
    out
}

/// Creates what is missing; leaves what exists as it is (`reconcile` corrects it).
async fn create_missing(js: &jetstream::Context, spec: &Spec) -> Result<bool, async_nats::Error> {
    if stream_exists(js, &spec.stream).await? {
        return Ok(false);
    }
    let created = match &spec.create {
        Create::Stream(c) => js.create_stream(c.clone()).await.map(|_| ()).map_err(async_nats::Error::from),
        Create::Kv(c) => js.create_key_value(c.clone()).await.map(|_| ()).map_err(async_nats::Error::from),
        Create::Objects(c) => js.create_object_store(c.clone()).await.map(|_| ()).map_err(async_nats::Error::from),
    };
    match created {
        Ok(()) => Ok(true),
        // Another service created it meanwhile.
        Err(_) if stream_exists(js, &spec.stream).await? => Ok(false),
        Err(e) => Err(e),
    }
}

/// Creates (idempotently) every stream and bucket of the region and returns handles:
/// what provisioning (and a test's stack) does. Call only after `verify_identity`.
pub async fn ensure(
    js: &jetstream::Context,
    region: Region,
    cfg: &LayoutConfig,
) -> Result<RegionLayout, async_nats::Error> {
    for spec in specs(region, cfg) {
        create_missing(js, &spec).await?;
    }
    handles(js, region).await
}

/// The streams (and the streams behind the buckets and the object store) of a region.
pub fn stream_names(region: Region) -> Vec<String> {
    specs(region, &LayoutConfig::default()).into_iter().map(|s| s.stream).collect()
}

/// Handles on a region's layout as provisioning laid it out: what a service does at
/// start. Provisioning owns names, limits, retention and replicas; a service only checks
/// that everything it uses exists, and a server missing any of it is a wiring error
/// (exit 78) that names what is missing. Call only after `verify_identity`.
pub async fn open(js: &jetstream::Context, region: Region, url: &str) -> Result<RegionLayout, WiringError> {
    let nats = |e: async_nats::Error| WiringError::Nats { url: url.to_string(), source: e };
    let mut missing = Vec::new();
    for name in stream_names(region) {
        if !stream_exists(js, &name).await.map_err(nats)? {
            missing.push(name);
        }
    }
    if !missing.is_empty() {
        return Err(WiringError::NotLaidOut { configured: region, url: url.to_string(), missing: missing.join(", ") });
    }
    handles(js, region).await.map_err(nats)
}

async fn handles(js: &jetstream::Context, region: Region) -> Result<RegionLayout, async_nats::Error> {
    let mut max_message_bytes: Option<usize> = None;
    for lane in Lane::ALL {
        let size = js.get_stream(lane_stream(region, lane)).await?.cached_info().config.max_message_size;
        if let Ok(size) = usize::try_from(size) {
            max_message_bytes = Some(max_message_bytes.map_or(size, |m| m.min(size)));
        }
    }
    Ok(RegionLayout {
        region,
        js: js.clone(),
        max_message_bytes,
        jobs: js.get_key_value(jobs_bucket(region)).await?,
        published: js.get_key_value(published_bucket(region)).await?,
        quota: js.get_key_value(quota_bucket(region)).await?,
        cache: js.get_key_value(cache_bucket(region)).await?,
        sweeps: js.get_key_value(sweeps_bucket(region)).await?,
        objects: js.get_object_store(findings_objects(region)).await?,
    })
}

/// One difference between a stream as it is and as the config wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drift {
    pub stream: String,
    pub field: &'static str,
    pub have: String,
    pub want: String,
    /// `None`: corrected in place. `Some(why)`: left as it is.
    pub unfixed: Option<String>,
}

/// What `reconcile` found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reconciled {
    pub created: Vec<String>,
    pub drift: Vec<Drift>,
}

impl Reconciled {
    /// Drift that is still there.
    pub fn unfixed(&self) -> impl Iterator<Item = &Drift> {
        self.drift.iter().filter(|d| d.unfixed.is_some())
    }
}

/// Brings every stream and bucket of the region to the config: creates what is
/// missing, updates what NATS lets change in place (limits, retention ages, replicas),
/// and reports what it cannot (retention policy, storage type) or what the server
/// refused.
pub async fn reconcile(
    js: &jetstream::Context,
    region: Region,
    cfg: &LayoutConfig,
) -> Result<Reconciled, async_nats::Error> {
    let mut out = Reconciled::default();
    for spec in specs(region, cfg) {
        if create_missing(js, &spec).await? {
            out.created.push(spec.stream.clone());
            continue;
        }
        let mut config = js.get_stream(&spec.stream).await?.cached_info().config.clone();
        let diff = Managed::of(&config).diff(&spec.managed);
        if diff.is_empty() {
            continue;
        }
        let fixable = diff.iter().any(|(_, _, _, mutable)| *mutable);
        let refused = if fixable {
            spec.managed.apply(&mut config);
            js.update_stream(&config).await.err().map(|e| format!("the server refused the update: {e}"))
        } else {
            None
        };
        for (field, have, want, mutable) in diff {
            let unfixed = if !mutable {
                Some("NATS cannot change this in place; recreate the stream (its messages are lost) or change the config".to_string())
            } else {
                refused.clone()
            };
            out.drift.push(Drift { stream: spec.stream.clone(), field, have, want, unfixed });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provisioning_reads_the_layout_names_and_the_docs_list_them() {
        use reviewlane_core::env::LAYOUT;
        use reviewlane_core::env_check::{Recording, documented};
        let asked = Recording::default();
        let mut r = reviewlane_core::config::Reader::new(&asked);
        let _ = LayoutConfig::from_reader(&mut r);
        let layout: std::collections::BTreeSet<String> = LAYOUT.iter().map(|n| n.to_string()).collect();
        assert_eq!(asked.names(), layout, "the layout config reads exactly `LAYOUT`");
        let listed = documented(include_str!("../../docs/configuration.md"), &["reviewlane-admin"]);
        assert_eq!(listed, layout, "the reviewlane-admin table of docs/configuration.md lists the layout");
    }

    #[test]
    fn names_follow_the_design() {
        assert_eq!(lane_stream(Region::Eu, Lane::Interactive), "REVIEWS_EU_INTERACTIVE");
        assert_eq!(lane_filter(Region::Us, Lane::Batch, "acme"), "reviews.us.batch.acme.>");
        assert_eq!(
            lane_subject(Region::Us, Lane::Batch, "acme", ReviewDepth::Full, "us_1"),
            "reviews.us.batch.acme.us_1"
        );
        assert_eq!(
            lane_subject(Region::Us, Lane::Batch, "acme", ReviewDepth::ChangedHunks, "us_1"),
            "reviews.us.batch.acme.changed_hunks.us_1"
        );
        assert_eq!(lane_depth_filter(Region::Us, Lane::Batch, "acme", ReviewDepth::Full), "reviews.us.batch.acme.*");
        assert_eq!(
            lane_depth_filter(Region::Us, Lane::Batch, "acme", ReviewDepth::ChangedHunks),
            "reviews.us.batch.acme.changed_hunks.*"
        );
        assert_eq!(lane_consumer(Lane::Batch, "acme"), "extractor-batch-acme");
        assert_eq!(lane_depth_consumer(Lane::Batch, "acme"), "extractor-changed_hunks-batch-acme");
        assert_eq!(findings_subject(Region::Eu, "t", "eu_1", 2), "findings.eu.t.eu_1.2");
        assert_eq!(parts_subject(Region::Us, "t", "us_1", 3), "parts.us.t.us_1.3");
        assert_eq!(jobs_bucket(Region::Us), "JOBS_US");
        assert_eq!(region_bucket(Region::Eu), "REGION_EU");
    }
}
