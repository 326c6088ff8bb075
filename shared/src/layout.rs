//! The NATS layout of one region: stream and bucket names, their idempotent creation,
//! and the region identity every service checks before it touches content.
//!
//! The identity (KV `REGION_<R>`, key `identity`) is written once, deliberately, by
//! provisioning (`reviewlane-admin provision`); services only verify it. A service
//! never claims an unprovisioned server, so a miswired URL cannot stamp the wrong
//! identity on it.

use std::time::Duration;

use async_nats::jetstream::{self, kv, object_store, stream};

use crate::region::{Lane, Region};

pub const IDENTITY_KEY: &str = "identity";

pub fn lane_stream(r: Region, lane: Lane) -> String {
    format!("REVIEWS_{}_{}", r.upper(), lane.upper())
}
/// `reviews.<r>.<lane>.<tenant>.>`: one tenant's reviews on a lane (a consumer's filter).
pub fn lane_filter(r: Region, lane: Lane, tenant: &str) -> String {
    format!("reviews.{}.{}.{}.>", r.as_str(), lane.as_str(), tenant)
}
/// `reviews.<r>.<lane>.<tenant>.<job id>`: one subject per job, so the reconciler can
/// tell with one look-up whether a job still has its message on the lane.
pub fn lane_subject(r: Region, lane: Lane, tenant: &str, job_id: &str) -> String {
    format!("reviews.{}.{}.{}.{}", r.as_str(), lane.as_str(), tenant, job_id)
}
/// The extractor's durable consumer of one tenant's reviews on a lane; the ingress reads
/// its counts (waiting, in progress) for per-tenant admission.
pub fn lane_consumer(lane: Lane, tenant: &str) -> String {
    format!("extractor-{}-{}", lane.as_str(), tenant)
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
/// Object store of results too large for one message: `FINDINGS_<R>` (stream
/// `OBJ_FINDINGS_<R>`), object name `<job id>.<generation>`.
pub fn findings_objects(r: Region) -> String {
    format!("FINDINGS_{}", r.upper())
}
pub fn deadletter_stream(r: Region) -> String {
    format!("DEADLETTER_{}", r.upper())
}
pub fn deadletter_subject(r: Region, tenant: &str, job_id: &str) -> String {
    format!("deadletter.{}.{}.{}", r.as_str(), tenant, job_id)
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
pub fn region_bucket(r: Region) -> String {
    format!("REGION_{}", r.upper())
}

/// Sizes of the region's streams and buckets.
#[derive(Debug, Clone)]
pub struct LayoutConfig {
    /// Maximum messages waiting in one lane; publishing beyond is refused (discard new).
    pub lane_max_messages: i64,
    /// Largest message (a review with its diff) a lane accepts.
    pub max_message_bytes: i32,
    /// How long findings (and quarantined findings) stay in the region.
    pub findings_max_age: Duration,
    /// How long dead letters stay: the retention policy for failed diffs.
    pub deadletter_max_age: Duration,
    pub cache_max_age: Duration,
}

impl Default for LayoutConfig {
    fn default() -> Self {
        LayoutConfig {
            lane_max_messages: 100_000,
            max_message_bytes: 8 * 1024 * 1024,
            findings_max_age: Duration::from_secs(7 * 24 * 3600),
            deadletter_max_age: Duration::from_secs(14 * 24 * 3600),
            cache_max_age: Duration::from_secs(24 * 3600),
        }
    }
}

/// Handles on one region's streams and buckets.
#[derive(Clone)]
pub struct RegionLayout {
    pub region: Region,
    pub js: jetstream::Context,
    pub jobs: kv::Store,
    pub published: kv::Store,
    pub quota: kv::Store,
    pub cache: kv::Store,
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

/// Creates (idempotently) every stream and bucket of the region and returns handles.
/// Call only after `verify_identity`.
pub async fn ensure(
    js: &jetstream::Context,
    region: Region,
    cfg: &LayoutConfig,
) -> Result<RegionLayout, async_nats::Error> {
    for lane in Lane::ALL {
        js.get_or_create_stream(stream::Config {
            name: lane_stream(region, lane),
            subjects: vec![format!("reviews.{}.{}.>", region.as_str(), lane.as_str())],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            discard: stream::DiscardPolicy::New,
            max_messages: cfg.lane_max_messages,
            max_message_size: cfg.max_message_bytes,
            ..Default::default()
        })
        .await?;
    }
    js.get_or_create_stream(stream::Config {
        name: findings_stream(region),
        subjects: vec![format!("findings.{}.>", region.as_str())],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        max_age: cfg.findings_max_age,
        max_message_size: cfg.max_message_bytes,
        ..Default::default()
    })
    .await?;
    js.get_or_create_stream(stream::Config {
        name: deadletter_stream(region),
        subjects: vec![format!("deadletter.{}.>", region.as_str())],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        max_age: cfg.deadletter_max_age,
        max_message_size: cfg.max_message_bytes,
        ..Default::default()
    })
    .await?;
    let kv_cfg = |bucket: String, history: i64, max_age: Duration| kv::Config {
        bucket,
        history,
        max_age,
        storage: stream::StorageType::File,
        ..Default::default()
    };
    let jobs = get_or_create_kv(js, kv_cfg(jobs_bucket(region), 1, Duration::ZERO)).await?;
    let published = get_or_create_kv(js, kv_cfg(published_bucket(region), 1, Duration::ZERO)).await?;
    let quota = get_or_create_kv(js, kv_cfg(quota_bucket(region), 1, Duration::ZERO)).await?;
    let cache = get_or_create_kv(js, kv_cfg(cache_bucket(region), 1, cfg.cache_max_age)).await?;
    let objects = if stream_exists(js, &format!("OBJ_{}", findings_objects(region))).await? {
        js.get_object_store(findings_objects(region)).await?
    } else {
        js.create_object_store(object_store::Config {
            bucket: findings_objects(region),
            max_age: cfg.findings_max_age,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await?
    };
    Ok(RegionLayout { region, js: js.clone(), jobs, published, quota, cache, objects })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_design() {
        assert_eq!(lane_stream(Region::Eu, Lane::Interactive), "REVIEWS_EU_INTERACTIVE");
        assert_eq!(lane_filter(Region::Us, Lane::Batch, "acme"), "reviews.us.batch.acme.>");
        assert_eq!(lane_subject(Region::Us, Lane::Batch, "acme", "us_1"), "reviews.us.batch.acme.us_1");
        assert_eq!(findings_subject(Region::Eu, "t", "eu_1", 2), "findings.eu.t.eu_1.2");
        assert_eq!(jobs_bucket(Region::Us), "JOBS_US");
        assert_eq!(region_bucket(Region::Eu), "REGION_EU");
    }
}
