//! Every environment variable the ingress reads: its own names here, the ones it shares
//! with the other services in `reviewlane_core::env`. `all()` is the whole set; a test
//! holds the table for the ingress in `docs/configuration.md` to it, and another that the config reads
//! nothing else.

use std::collections::BTreeSet;

use reviewlane_core::env as common;

/// Prefixes of the per-region NATS credentials, read before `REVIEWLANE_NATS_*`.
pub const NATS_US: &str = "REVIEWLANE_NATS_US";
pub const NATS_EU: &str = "REVIEWLANE_NATS_EU";

pub const GRPC_ADDR: &str = "REVIEWLANE_GRPC_ADDR";
pub const MAX_DIFF_BYTES: &str = "REVIEWLANE_MAX_DIFF_BYTES";
pub const DEGRADE_FACTOR: &str = "REVIEWLANE_DEGRADE_FACTOR";
pub const ADMISSION_MIN_WAITING: &str = "REVIEWLANE_ADMISSION_MIN_WAITING";
pub const INTERACTIVE_DEADLINE_SECS: &str = "REVIEWLANE_INTERACTIVE_DEADLINE_SECS";
pub const BATCH_DEADLINE_SECS: &str = "REVIEWLANE_BATCH_DEADLINE_SECS";
pub const WATCH_KEEPALIVE_SECS: &str = "REVIEWLANE_WATCH_KEEPALIVE_SECS";
pub const MAX_WATCHES_PER_TENANT: &str = "REVIEWLANE_MAX_WATCHES_PER_TENANT";
pub const REQUEST_TIMEOUT_SECS: &str = "REVIEWLANE_REQUEST_TIMEOUT_SECS";
pub const MAX_STREAMS_PER_CONNECTION: &str = "REVIEWLANE_MAX_STREAMS_PER_CONNECTION";
pub const HTTP2_KEEPALIVE_SECS: &str = "REVIEWLANE_HTTP2_KEEPALIVE_SECS";
pub const GRPC_TLS_CERT_FILE: &str = "REVIEWLANE_GRPC_TLS_CERT_FILE";
pub const GRPC_TLS_KEY_FILE: &str = "REVIEWLANE_GRPC_TLS_KEY_FILE";
pub const GRPC_TLS_CLIENT_CA_FILE: &str = "REVIEWLANE_GRPC_TLS_CLIENT_CA_FILE";
pub const NATS_URL_US: &str = "REVIEWLANE_NATS_URL_US";
pub const NATS_URL_EU: &str = "REVIEWLANE_NATS_URL_EU";

/// The NATS URL variable of `region`.
pub fn nats_url(region: reviewlane_shared::Region) -> &'static str {
    match region {
        reviewlane_shared::Region::Us => NATS_URL_US,
        reviewlane_shared::Region::Eu => NATS_URL_EU,
    }
}

/// The prefix of `region`'s own NATS credentials.
pub fn nats_prefix(region: reviewlane_shared::Region) -> &'static str {
    match region {
        reviewlane_shared::Region::Us => NATS_US,
        reviewlane_shared::Region::Eu => NATS_EU,
    }
}

/// Names the ingress read before and no longer does, with where they went.
pub const RETIRED: common::Retired = &[("REVIEWLANE_ADMISSION_SAMPLE_MS", "lanes are sampled every second")];

/// The names only the ingress reads.
pub const OWN: &[&str] = &[
    GRPC_ADDR,
    MAX_DIFF_BYTES,
    DEGRADE_FACTOR,
    ADMISSION_MIN_WAITING,
    INTERACTIVE_DEADLINE_SECS,
    BATCH_DEADLINE_SECS,
    WATCH_KEEPALIVE_SECS,
    MAX_WATCHES_PER_TENANT,
    REQUEST_TIMEOUT_SECS,
    MAX_STREAMS_PER_CONNECTION,
    HTTP2_KEEPALIVE_SECS,
    GRPC_TLS_CERT_FILE,
    GRPC_TLS_KEY_FILE,
    GRPC_TLS_CLIENT_CA_FILE,
    NATS_URL_US,
    NATS_URL_EU,
];

/// Every name the ingress reads.
pub fn all() -> BTreeSet<String> {
    let shared = common::EVERY_SERVICE.iter().chain(&common::LANE_WINDOWS);
    let nats = common::nats_names(&[NATS_US, NATS_EU, common::NATS]);
    OWN.iter().chain(shared).map(|n| n.to_string()).chain(nats).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_doc_lists_exactly_what_ingress_reads() {
        let doc = include_str!("../../../docs/configuration.md");
        let mismatch = reviewlane_core::env_check::doc_mismatch(doc, &["Every service", "Ingress"], &all());
        assert!(mismatch.is_none(), "{}", mismatch.unwrap_or_default());
    }

    #[test]
    fn the_config_reads_only_names_listed_here() {
        let asked = reviewlane_core::env_check::Recording::default();
        let _ = crate::config::IngressConfig::from_env(&asked);
        assert!(asked.names().contains(GRPC_ADDR), "the recording saw the config's reads");
        let stray = reviewlane_core::env_check::stray(&asked, all(), RETIRED);
        assert!(stray.is_empty(), "read but not in env.rs: {stray:?}");
    }
}
