//! reviewlane's common crate: what the ingress, extractor and publisher must agree on.
//!
//! Pure cores (diff parsing, findings validation, the job state machine, job ids) have
//! no I/O; `layout` is the one place that knows the NATS names of a region.

pub mod admin;
pub mod aggregate;
pub mod api;
pub mod chunk;
pub mod clock;
pub mod codec;
pub mod config;
pub mod content;
pub mod dead_letters;
pub mod diff;
pub mod faults;
pub mod findings;
pub mod job;
pub mod job_id;
pub mod job_index;
pub mod job_metrics;
pub mod job_store;
pub mod layout;
pub mod messages;
pub mod nats_client;
pub mod pull;
pub mod region;
pub mod result_cache;
pub mod results;
pub mod schema_dialect;
pub mod startup;
pub mod store;
pub mod store_health;
pub mod surfaces;
pub mod telemetry;
pub mod tenants;
#[cfg(feature = "testing")]
pub mod testing;

/// Generated gRPC types and the descriptor set for reflection.
pub mod proto {
    #![allow(clippy::all)]
    tonic::include_proto!("reviewlane.v1");
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/reviewlane_descriptor.bin"));
}

pub use region::{Lane, Region};
