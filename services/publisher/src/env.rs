//! Every environment variable the publisher reads: its own names here, the ones it shares
//! with the other services in `reviewlane_core::env`. `all()` is the whole set; a test
//! holds the table for the publisher in `docs/configuration.md` to it, and another that the config reads
//! nothing else.

use std::collections::BTreeSet;

use reviewlane_core::env as common;

pub const CONCURRENCY: &str = "REVIEWLANE_CONCURRENCY";
pub const SINK_TIMEOUT_SECS: &str = "REVIEWLANE_SINK_TIMEOUT_SECS";
pub const DELIVERY_ATTEMPTS: &str = "REVIEWLANE_DELIVERY_ATTEMPTS";
pub const DELIVERY_BACKOFF_CAP_SECS: &str = "REVIEWLANE_DELIVERY_BACKOFF_CAP_SECS";
pub const PUBLISH_LEASE_SECS: &str = "REVIEWLANE_PUBLISH_LEASE_SECS";

/// The names only the publisher reads.
pub const OWN: &[&str] =
    &[CONCURRENCY, SINK_TIMEOUT_SECS, DELIVERY_ATTEMPTS, DELIVERY_BACKOFF_CAP_SECS, PUBLISH_LEASE_SECS];

/// Every name the publisher reads.
pub fn all() -> BTreeSet<String> {
    common::region_service(OWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_doc_lists_exactly_what_publisher_reads() {
        let doc = include_str!("../../../docs/configuration.md");
        let mismatch = reviewlane_core::env_check::doc_mismatch(doc, &["Every service", "Publisher"], &all());
        assert!(mismatch.is_none(), "{}", mismatch.unwrap_or_default());
    }

    #[test]
    fn the_config_reads_only_names_listed_here() {
        let asked = reviewlane_core::env_check::Recording::default();
        let _ = crate::config::PublisherConfig::from_env(&asked);
        assert!(asked.names().contains(CONCURRENCY), "the recording saw the config's reads");
        let stray = reviewlane_core::env_check::stray(&asked, all(), &[]);
        assert!(stray.is_empty(), "read but not in env.rs: {stray:?}");
    }
}
