//! Jobs written by hand into a region's stores, for tests that need a job in a state
//! the pipeline passes through too quickly to catch (validated and not yet delivered,
//! running with a dead holder).

use reviewlane_core::clock::SharedClock;
use reviewlane_core::job::{Event, JobRecord, JobState};
use reviewlane_core::job_id;
use reviewlane_core::messages::{FindingsMessage, ReviewMetadata};
use reviewlane_core::region::Region;
use reviewlane_shared::job_store::JobStore;
use reviewlane_shared::layout::{self, LayoutConfig, RegionLayout};
use reviewlane_shared::results::Results;

pub struct RegionStores {
    pub layout: RegionLayout,
    pub jobs: JobStore,
    pub results: Results,
}

pub async fn stores(url: &str, region: Region, clock: SharedClock) -> RegionStores {
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let layout = layout::ensure(&js, region, &LayoutConfig::default()).await.unwrap();
    let jobs = JobStore::new(layout.jobs.clone(), client).with_clock(clock);
    let results = Results::new(layout.clone(), 1024 * 1024);
    RegionStores { layout, jobs, results }
}

/// A `waiting` record of tenant `acme` (us) under idempotency key `key`.
pub fn record(key: &str, now_ms: u64) -> JobRecord {
    let id = job_id::derive(Region::Us, "acme", key);
    let rec = reviewlane_core::testing::record(&id, JobState::Waiting);
    JobRecord { tenant: "acme".into(), created_at_ms: now_ms, updated_at_ms: now_ms, ..rec }
}

/// A result with no findings for `rec` at `generation`.
pub fn result(rec: &JobRecord, generation: u32) -> FindingsMessage {
    FindingsMessage {
        job_id: rec.job_id.clone(),
        generation,
        stored_as: None,
        tenant: rec.tenant.clone(),
        region: rec.region,
        lane: rec.lane,
        schema_version: rec.schema_version.clone(),
        review_depth: rec.review_depth,
        metadata: ReviewMetadata::default(),
        findings: Vec::new(),
        quarantined: Vec::new(),
        submitted_at_ms: rec.created_at_ms,
        part: None,
        findings_dropped: 0,
        deeper_of: None,
        deeper_review: None,
    }
}

/// A job of `acme` under `key`, recorded `validated` at its first lease (generation 1),
/// with no result kept yet.
pub async fn validated(s: &RegionStores, key: &str, now_ms: u64) -> (JobRecord, u32) {
    let rec = record(key, now_ms);
    s.jobs.create(&rec).await.unwrap();
    let lease = Event::Leased { owner: "test".into(), lease_expires_at_ms: now_ms + 60_000 };
    let generation = s.jobs.apply(&rec.job_id, &lease).await.unwrap().generation();
    s.jobs.apply(&rec.job_id, &Event::Validated { generation, findings: 0, quarantined: 0, dropped: 0 }).await.unwrap();
    (rec, generation)
}
