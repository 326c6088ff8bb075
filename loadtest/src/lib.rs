//! reviewlane's load generator (`load`, `corpus`) and load scenarios (`scenarios`,
//! `chaos`, `replicas`, `large`, `tpm`, `sweep`, `gateway`, `quota_fleet`, `pool`), run by `cargo run --release -p loadtest -- <scenario>`.
//! What they run against — the stack, the simulated provider, the webhook receiver, the
//! fake GitHub — is the test kit (`reviewlane-testkit`), re-exported here by name.

pub mod chaos;
pub mod corpus;
pub mod gateway;
pub mod large;
pub mod load;
pub mod pool;
pub mod quota_fleet;
pub mod replicas;
pub mod scenarios;
pub mod sweep;
pub mod tpm;

pub use reviewlane_testkit::{fakegithub, http, procs, simmeter, simprovider, stack, webhook};
