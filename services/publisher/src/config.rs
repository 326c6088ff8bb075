//! Publisher configuration, read once and validated whole. The variables are listed in
//! `env.rs` and documented in `docs/configuration.md` ("Publisher").

use std::sync::Arc;
use std::time::Duration;

use crate::env;
use reviewlane_core::config::{ConfigErrors, Env, Reader};
use reviewlane_core::tenants::Tenants;
use reviewlane_shared::Region;

#[derive(Debug, Clone)]
pub struct PublisherConfig {
    pub region: Region,
    /// Admin HTTP: `/metrics`, `/healthz`, `/readyz`.
    pub admin_addr: std::net::SocketAddr,
    pub nats_url: String,
    pub tenants: Arc<Tenants>,
    pub concurrency: usize,
    pub sink_timeout: Duration,
    pub delivery_attempts: u32,
    pub delivery_backoff_base: Duration,
    pub delivery_backoff_cap: Duration,
    pub lease: Duration,
    pub shutdown_grace: Duration,
    /// Each lane's service window: bucket bounds of the submit-to-published histogram.
    pub lane_windows: [Duration; 2],
    pub telemetry: reviewlane_shared::telemetry::TelemetryConfig,
    /// Credentials and TLS for the region's NATS (`REVIEWLANE_NATS_*`).
    pub nats: reviewlane_shared::nats_client::NatsClientConfig,
    /// Variables set in the environment that the publisher no longer reads, with where
    /// they went (logged at start).
    pub notices: Vec<String>,
    /// Retries of the writes that record a delivery made (`REVIEWLANE_STORE_*`).
    pub store_retry: reviewlane_shared::store::StoreRetry,
    /// Fault hooks (tests only; no-ops in release builds).
    pub faults: reviewlane_shared::faults::Faults,
}

impl PublisherConfig {
    pub fn new(region: Region, nats_url: impl Into<String>, tenants: Arc<Tenants>) -> Self {
        PublisherConfig {
            region,
            admin_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 9466)),
            nats_url: nats_url.into(),
            tenants,
            concurrency: 16,
            sink_timeout: Duration::from_secs(10),
            delivery_attempts: 8,
            delivery_backoff_base: Duration::from_millis(500),
            delivery_backoff_cap: Duration::from_secs(60),
            lease: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(20),
            lane_windows: [Duration::from_secs(60), Duration::from_secs(3600)],
            telemetry: Default::default(),
            nats: Default::default(),
            notices: Vec::new(),
            store_retry: Default::default(),
            faults: Default::default(),
        }
    }

    pub fn from_env(env: &dyn Env) -> Result<Self, ConfigErrors> {
        let mut r = Reader::new(env);
        let region: Option<Region> = r.required(reviewlane_core::env::REGION, "`us` or `eu`");
        let nats_url: Option<String> = reviewlane_shared::nats_client::read_url(&mut r, reviewlane_core::env::NATS_URL);
        let tenants = r.tenants(reviewlane_core::env::TENANTS_FILE);
        let d = PublisherConfig::new(Region::Us, "", Arc::default());
        let admin_addr = r.or(reviewlane_core::env::ADMIN_ADDR, d.admin_addr, "host:port");
        let concurrency: usize = r.or(env::CONCURRENCY, d.concurrency, "a positive count");
        if concurrency == 0 {
            r.error("REVIEWLANE_CONCURRENCY must be positive");
        }
        let timeout: u64 = r.or(env::SINK_TIMEOUT_SECS, 10, "whole seconds");
        let attempts: u32 = r.or(env::DELIVERY_ATTEMPTS, d.delivery_attempts, "a count");
        if attempts == 0 {
            r.error("REVIEWLANE_DELIVERY_ATTEMPTS must be positive");
        }
        let cap: u64 = r.or(env::DELIVERY_BACKOFF_CAP_SECS, 60, "whole seconds");
        let grace: u64 = r.or(reviewlane_core::env::SHUTDOWN_GRACE_SECS, 20, "whole seconds");
        let lease: u64 = r.or(env::PUBLISH_LEASE_SECS, d.lease.as_secs(), "whole seconds");
        if lease <= timeout {
            r.error(
                "REVIEWLANE_PUBLISH_LEASE_SECS must exceed REVIEWLANE_SINK_TIMEOUT_SECS (a claim must outlive its delivery)",
            );
        }
        let lane_windows = r.lane_windows();
        let telemetry = reviewlane_shared::telemetry::TelemetryConfig::read(&mut r);
        let nats = reviewlane_shared::nats_client::NatsClientConfig::from_reader(&mut r, &[reviewlane_core::env::NATS]);
        let store_retry = reviewlane_shared::store::StoreRetry::from_reader(&mut r);
        let notices = r.retired_notices(&[]);
        r.finish()?;
        Ok(PublisherConfig {
            notices,
            region: region.expect("checked"),
            admin_addr,
            nats_url: nats_url.expect("checked"),
            tenants: Arc::new(tenants.expect("checked")),
            concurrency,
            sink_timeout: Duration::from_secs(timeout),
            delivery_attempts: attempts,
            delivery_backoff_cap: Duration::from_secs(cap),
            shutdown_grace: Duration::from_secs(grace),
            lease: Duration::from_secs(lease),
            lane_windows,
            telemetry,
            nats,
            store_retry,
            ..d
        })
    }
}
