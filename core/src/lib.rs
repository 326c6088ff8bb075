//! reviewlane's pure core: what the services decide, with no NATS, no async runtime and
//! no network. The diff parser, findings validation against the versioned schemas, the
//! job state machine, splitting a review into parts and merging them, regions and tenants, the schema dialects
//! the providers accept, the messages on the lanes, the SARIF and rdjson surfaces, the
//! typed environment reader, the providers' retry hints and the rules of provider batch
//! processing (`batch`).
//!
//! `reviewctl` and the fuzz targets depend on this crate alone; the services reach it
//! through `reviewlane-shared`, which adds the NATS stores and telemetry (the gRPC API
//! is `reviewlane-api`).

pub mod aggregate;
pub mod batch;
pub mod clock;
pub mod config;
pub mod diff;
pub mod env;
pub mod env_check;
pub mod findings;
pub mod job;
pub mod job_id;
pub mod messages;
pub mod meter;
pub mod parts;
pub mod pool_status;
pub mod region;
pub mod retry_hint;
pub mod schema_dialect;
pub mod surfaces;
pub mod sweep;
pub mod tenants;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use region::{Lane, Region};
