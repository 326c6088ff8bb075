//! reviewlane extractor, one per region: takes reviews off the region's lanes, asks the
//! region's provider, validates the answer against the schema and the diff, and
//! publishes the validated findings to `FINDINGS_<R>`.

pub mod batch;
pub mod config;
pub mod env;
pub mod metrics;
pub mod pool;
pub mod provider;
pub mod quota;
pub mod reconcile;
pub mod schedule;
pub mod startup;
pub mod sweep;
pub mod tokenizer;
pub mod upstream;
pub mod worker;

pub use config::ExtractorConfig;
pub use startup::{App, build, build_with_provider};
