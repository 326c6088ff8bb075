//! Every environment variable the publisher reads: its own names here, the ones it shares
//! with the other services in `reviewlane_core::env`. `all()` is the whole set; a test
//! holds the README's table for the publisher to it, and another that the config reads
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
    let shared = common::EVERY_SERVICE
        .iter()
        .chain(&common::REGION_BOUND)
        .chain(&common::LANE_WINDOWS)
        .chain(&[common::STORE_RETRIES]);
    let nats = common::nats_names(&[common::NATS]);
    OWN.iter().chain(shared).map(|n| n.to_string()).chain(nats).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readme_lists_exactly_what_publisher_reads() {
        let readme = include_str!("../../../README.md");
        let documented = common::documented(readme, &["every service", "publisher"]);
        let read = all();
        let undocumented: Vec<_> = read.difference(&documented).collect();
        let unread: Vec<_> = documented.difference(&read).collect();
        assert!(
            undocumented.is_empty() && unread.is_empty(),
            "README lacks {undocumented:?}; README has, unread: {unread:?}"
        );
    }

    #[test]
    fn the_config_reads_only_names_listed_here() {
        let asked = common::Recording::default();
        let _ = crate::config::PublisherConfig::from_env(&asked);
        assert!(asked.names().contains(CONCURRENCY), "the recording saw the config's reads");
        let known: BTreeSet<String> = all().into_iter().chain(common::retired_names(&[])).collect();
        let stray: Vec<_> = asked.names().difference(&known).cloned().collect();
        assert!(stray.is_empty(), "read but not in env.rs: {stray:?}");
    }
}
