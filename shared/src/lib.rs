//! reviewlane's common crate: what the ingress, extractor and publisher share beyond
//! the pure core (`reviewlane-core`) and the API (`reviewlane-api`): the NATS client,
//! the region's layout, the job, result and dead-letter stores, telemetry, the admin
//! server and startup checks. `layout` is the one place that knows the NATS names of a
//! region.

pub mod admin;
pub mod content;
pub mod dead_letters;
pub mod faults;
pub mod job_index;
pub mod job_metrics;
pub mod job_store;
pub mod kv_listing;
pub mod lanes;
pub mod layout;
pub mod nats_client;
pub mod pool_status;
pub mod pull;
pub mod result_cache;
pub mod results;
pub mod startup;
pub mod store;
pub mod store_health;
pub mod sweeps;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;

pub use reviewlane_core::{Lane, Region};
