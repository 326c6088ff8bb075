//! reviewlane publisher, one per region: delivers each job's validated findings to the
//! tenant's sink exactly once, claiming each delivery on the job record (KV `JOBS_<R>`).

pub mod claim;
pub mod config;
pub mod env;
pub mod gate;
pub mod github;
pub mod metrics;
pub mod outcome;
pub mod sink;
pub mod startup;
pub mod target;
pub mod worker;

pub use config::PublisherConfig;
pub use startup::{App, build};
