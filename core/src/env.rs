//! The environment variable names more than one service reads, in one place; each
//! service's own are in its `env.rs`. A catalogue only: `config` reads the names, and
//! `env_check` holds the tables of `docs/configuration.md` to them.

use std::collections::BTreeSet;

pub const REGION: &str = "REVIEWLANE_REGION";
pub const NATS_URL: &str = "REVIEWLANE_NATS_URL";
pub const TENANTS_FILE: &str = "REVIEWLANE_TENANTS_FILE";
pub const ADMIN_ADDR: &str = "REVIEWLANE_ADMIN_ADDR";
pub const SHUTDOWN_GRACE_SECS: &str = "REVIEWLANE_SHUTDOWN_GRACE_SECS";
pub const LOG_FORMAT: &str = "REVIEWLANE_LOG_FORMAT";
pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub const INTERACTIVE_WINDOW_SECS: &str = "REVIEWLANE_INTERACTIVE_WINDOW_SECS";
pub const BATCH_WINDOW_SECS: &str = "REVIEWLANE_BATCH_WINDOW_SECS";
pub const STORE_RETRIES: &str = "REVIEWLANE_STORE_RETRIES";
/// The prefix of the NATS credentials (`REVIEWLANE_NATS_USER`, ...).
pub const NATS: &str = "REVIEWLANE_NATS";
/// What follows a NATS prefix: at most one kind of credentials, and TLS.
pub const NATS_CREDENTIALS: [&str; 10] = [
    "_USER",
    "_PASSWORD",
    "_PASSWORD_FILE",
    "_TOKEN",
    "_TOKEN_FILE",
    "_NKEY_SEED_FILE",
    "_CREDS_FILE",
    "_TLS_CA_FILE",
    "_TLS_CERT_FILE",
    "_TLS_KEY_FILE",
];

/// Read by the ingress, the extractor and the publisher alike.
pub const EVERY_SERVICE: [&str; 5] =
    [TENANTS_FILE, ADMIN_ADDR, SHUTDOWN_GRACE_SECS, LOG_FORMAT, OTEL_EXPORTER_OTLP_ENDPOINT];
/// Read by the services that serve one region (the extractor, the publisher).
pub const REGION_BOUND: [&str; 2] = [REGION, NATS_URL];
/// Each lane's service window.
pub const LANE_WINDOWS: [&str; 2] = [INTERACTIVE_WINDOW_SECS, BATCH_WINDOW_SECS];

/// The region's layout (sizes, retention, replicas of its streams and buckets): read by
/// `reviewlane-admin provision` alone, which owns the layout; the services open what it
/// laid out.
pub const LAYOUT: [&str; 13] = [
    "REVIEWLANE_STREAM_REPLICAS",
    "REVIEWLANE_LANE_MAX_MESSAGES",
    "REVIEWLANE_LANE_MAX_BYTES",
    "REVIEWLANE_LANE_MAX_AGE_SECS",
    "REVIEWLANE_MAX_MESSAGE_BYTES",
    "REVIEWLANE_JOBS_MAX_AGE_SECS",
    "REVIEWLANE_PUBLISHED_MAX_AGE_SECS",
    "REVIEWLANE_FINDINGS_MAX_AGE_SECS",
    "REVIEWLANE_FINDINGS_MAX_BYTES",
    "REVIEWLANE_DEADLETTER_MAX_AGE_SECS",
    "REVIEWLANE_DEADLETTER_CONTENT_MAX_AGE_SECS",
    "REVIEWLANE_QUOTA_MAX_AGE_SECS",
    "REVIEWLANE_CACHE_MAX_AGE_SECS",
];

/// Names a service used to read and no longer does, each with where it went.
pub type Retired = &'static [(&'static str, &'static str)];

/// Retired from every service that read them.
pub const EVERY_SERVICE_RETIRED: Retired = &[
    ("REVIEWLANE_STORE_BACKOFF_BASE_MS", "store writes back off from 100 ms"),
    ("REVIEWLANE_STORE_BACKOFF_CAP_MS", "store writes back off up to 4 s"),
];

/// Every name `retired` looks at for a service with its own `retired` list.
pub fn retired_names(retired: Retired) -> impl Iterator<Item = String> {
    LAYOUT.iter().copied().chain(EVERY_SERVICE_RETIRED.iter().chain(retired).map(|(n, _)| *n)).map(str::to_string)
}

/// Every credential name under each prefix.
pub fn nats_names(prefixes: &[&str]) -> Vec<String> {
    prefixes.iter().flat_map(|p| NATS_CREDENTIALS.iter().map(move |k| format!("{p}{k}"))).collect()
}

/// Every name a service of one region reads: its `own`, those every service reads, the
/// region and its NATS URL, the lane windows, the store retries and the NATS
/// credentials.
pub fn region_service(own: &[&str]) -> BTreeSet<String> {
    let shared = EVERY_SERVICE.iter().chain(&REGION_BOUND).chain(&LANE_WINDOWS).chain(&[STORE_RETRIES]);
    own.iter().chain(shared).map(|n| n.to_string()).chain(nats_names(&[NATS])).collect()
}
