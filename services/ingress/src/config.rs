//! Ingress configuration, read once from the environment and validated whole. The
//! variables are listed in `env.rs` and documented in `docs/configuration.md`
//! ("Ingress").

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::env;
use reviewlane_core::region::Lane;
use reviewlane_shared::Region;

use crate::admission::LanePolicy;
use reviewlane_core::config::{ConfigErrors, Env, Reader};
use reviewlane_core::tenants::Tenants;

#[derive(Debug, Clone)]
pub struct IngressConfig {
    pub grpc_addr: SocketAddr,
    /// Admin HTTP: `/metrics`, `/healthz`, `/readyz`.
    pub admin_addr: SocketAddr,
    pub tenants: Arc<Tenants>,
    pub nats_urls: BTreeMap<Region, String>,
    pub max_diff_bytes: usize,
    pub shutdown_grace: Duration,
    pub telemetry: reviewlane_shared::telemetry::TelemetryConfig,
    pub interactive: LanePolicy,
    pub batch: LanePolicy,
    /// How often lane metadata is sampled for admission.
    pub admission_sample: Duration,
    /// Fault hooks for tests (no-ops unless built with `fault-hooks`).
    pub faults: reviewlane_shared::faults::Faults,
    pub limits: ServerLimits,
    /// TLS for the gRPC listener; plaintext when unset.
    pub grpc_tls: Option<GrpcTls>,
    /// Variables set in the environment that the ingress no longer reads, with where
    /// they went (logged at start).
    pub notices: Vec<String>,
    /// Credentials and TLS per region (`REVIEWLANE_NATS_<R>_*`, else `REVIEWLANE_NATS_*`);
    /// a region without an entry connects without.
    pub nats: BTreeMap<Region, reviewlane_shared::nats_client::NatsClientConfig>,
}

/// PEM files of the gRPC listener's TLS (read when the server starts).
#[derive(Debug, Clone, PartialEq)]
pub struct GrpcTls {
    pub cert_file: std::path::PathBuf,
    pub key_file: std::path::PathBuf,
    /// Client certificates must be signed by this CA.
    pub client_ca_file: Option<std::path::PathBuf>,
}

/// What one caller can hold of the server.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServerLimits {
    /// A `WatchReview` stream sends the review as it stands this often even without a
    /// change, so callers (and proxies) see it alive.
    pub watch_keepalive: Duration,
    /// Open `WatchReview` streams per tenant; more are `RESOURCE_EXHAUSTED`.
    pub max_watches_per_tenant: usize,
    /// A unary call's deadline on the server.
    pub request_timeout: Duration,
    /// Concurrent HTTP/2 streams per connection.
    pub max_streams_per_connection: u32,
    /// HTTP/2 keepalive pings.
    pub http2_keepalive: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            watch_keepalive: Duration::from_secs(15),
            max_watches_per_tenant: 16,
            request_timeout: Duration::from_secs(30),
            max_streams_per_connection: 100,
            http2_keepalive: Duration::from_secs(30),
        }
    }
}

impl IngressConfig {
    pub fn policy(&self, lane: Lane) -> &LanePolicy {
        match lane {
            Lane::Interactive => &self.interactive,
            Lane::Batch => &self.batch,
        }
    }

    /// Default admission policies: interactive 60 s window, batch 1 h, degrade up to 2x;
    /// default deadlines 15 min and 24 h.
    pub fn default_policies() -> (LanePolicy, LanePolicy) {
        (
            LanePolicy {
                window: Duration::from_secs(60),
                degrade_factor: 2.0,
                min_waiting: 16,
                deadline: Duration::from_secs(900),
            },
            LanePolicy {
                window: Duration::from_secs(3600),
                degrade_factor: 2.0,
                min_waiting: 16,
                deadline: Duration::from_secs(86_400),
            },
        )
    }
}

pub const DEFAULT_MAX_DIFF_BYTES: usize = 1024 * 1024;

impl IngressConfig {
    /// The whole config, read in sections: the listeners and tenants, the regions'
    /// NATS, the lanes' admission policies, the server's limits and gRPC TLS.
    pub fn from_env(env: &dyn Env) -> Result<Self, ConfigErrors> {
        let mut r = Reader::new(env);
        let grpc_addr = r.or(env::GRPC_ADDR, SocketAddr::from(([127, 0, 0, 1], 50051)), "host:port");
        let admin_addr = r.or(reviewlane_core::env::ADMIN_ADDR, SocketAddr::from(([127, 0, 0, 1], 9464)), "host:port");
        let tenants = r.tenants(reviewlane_core::env::TENANTS_FILE);
        let max_diff_bytes = r.or(env::MAX_DIFF_BYTES, DEFAULT_MAX_DIFF_BYTES, "a byte count");
        if max_diff_bytes == 0 {
            r.error("REVIEWLANE_MAX_DIFF_BYTES must be positive");
        }
        let grace: u64 = r.or(reviewlane_core::env::SHUTDOWN_GRACE_SECS, 20, "whole seconds");
        let telemetry = reviewlane_shared::telemetry::TelemetryConfig::read(&mut r);
        let (nats_urls, nats) = read_regions(&mut r, tenants.as_ref());
        let (interactive, batch) = read_policies(&mut r);
        let limits = ServerLimits::read(&mut r);
        let grpc_tls = read_grpc_tls(&mut r);
        let notices = r.retired_notices(env::RETIRED);
        r.finish()?;
        Ok(IngressConfig {
            notices,
            grpc_tls,
            nats,
            faults: Default::default(),
            grpc_addr,
            admin_addr,
            tenants: Arc::new(tenants.expect("checked by finish")),
            nats_urls,
            max_diff_bytes,
            shutdown_grace: Duration::from_secs(grace),
            telemetry,
            interactive,
            batch,
            admission_sample: Duration::from_secs(1),
            limits,
        })
    }
}

type RegionsNats = (BTreeMap<Region, String>, BTreeMap<Region, reviewlane_shared::nats_client::NatsClientConfig>);

/// Each region's NATS URL and credentials (its own prefix first); every tenant's
/// region needs a URL.
fn read_regions(r: &mut Reader<'_>, tenants: Option<&Tenants>) -> RegionsNats {
    let mut urls = BTreeMap::new();
    for region in Region::ALL {
        let key = env::nats_url(region);
        if let Some(url) = r.raw(key) {
            reviewlane_shared::nats_client::check_url(r, key, &url);
            urls.insert(region, url);
        }
    }
    if urls.is_empty() {
        r.error("REVIEWLANE_NATS_URL_US or REVIEWLANE_NATS_URL_EU is required");
    }
    for tenant in tenants.iter().flat_map(|t| t.iter()) {
        if !urls.contains_key(&tenant.region) && !urls.is_empty() {
            r.error(format!(
                "tenant `{}` lives in region `{}`, which has no {}",
                tenant.id,
                tenant.region,
                env::nats_url(tenant.region)
            ));
        }
    }
    let nats = urls
        .keys()
        .map(|region| {
            let prefixes = [env::nats_prefix(*region), reviewlane_core::env::NATS];
            (*region, reviewlane_shared::nats_client::NatsClientConfig::from_reader(r, &prefixes))
        })
        .collect();
    (urls, nats)
}

/// The lanes' admission policies: windows, degradation, and the default deadlines.
fn read_policies(r: &mut Reader<'_>) -> (LanePolicy, LanePolicy) {
    let (mut interactive, mut batch) = IngressConfig::default_policies();
    [interactive.window, batch.window] = r.lane_windows();
    let factor: f64 = r.or(env::DEGRADE_FACTOR, 2.0, "a number >= 1");
    if factor.is_nan() || factor < 1.0 {
        r.error("REVIEWLANE_DEGRADE_FACTOR must be at least 1");
    }
    let min_waiting: u64 = r.or(env::ADMISSION_MIN_WAITING, 16, "a count");
    for p in [&mut interactive, &mut batch] {
        p.degrade_factor = factor;
        p.min_waiting = min_waiting;
    }
    interactive.deadline =
        Duration::from_secs(r.or(env::INTERACTIVE_DEADLINE_SECS, interactive.deadline.as_secs(), "whole seconds"));
    batch.deadline = Duration::from_secs(r.or(env::BATCH_DEADLINE_SECS, batch.deadline.as_secs(), "whole seconds"));
    for (key, p) in [(env::INTERACTIVE_DEADLINE_SECS, &interactive), (env::BATCH_DEADLINE_SECS, &batch)] {
        if p.deadline.is_zero() {
            r.error(format!("{key} must be positive"));
        }
    }
    (interactive, batch)
}

impl ServerLimits {
    fn read(r: &mut Reader<'_>) -> Self {
        let d = ServerLimits::default();
        ServerLimits {
            watch_keepalive: Duration::from_secs(r.or(env::WATCH_KEEPALIVE_SECS, 15, "whole seconds").max(1)),
            max_watches_per_tenant: r.or(env::MAX_WATCHES_PER_TENANT, d.max_watches_per_tenant, "a count"),
            request_timeout: Duration::from_secs(r.or(env::REQUEST_TIMEOUT_SECS, 30, "whole seconds").max(1)),
            max_streams_per_connection: r.or(env::MAX_STREAMS_PER_CONNECTION, d.max_streams_per_connection, "a count"),
            http2_keepalive: Duration::from_secs(r.or(env::HTTP2_KEEPALIVE_SECS, 30, "whole seconds").max(1)),
        }
    }
}

/// gRPC over TLS: a certificate and key together, and optionally a client CA.
fn read_grpc_tls(r: &mut Reader<'_>) -> Option<GrpcTls> {
    let file = |r: &mut Reader<'_>, key: &str| {
        let p = std::path::PathBuf::from(r.raw(key)?);
        if !p.is_file() {
            r.error(format!("{key} names a file that does not exist"));
        }
        Some(p)
    };
    let (cert, key) = (file(r, env::GRPC_TLS_CERT_FILE), file(r, env::GRPC_TLS_KEY_FILE));
    let client_ca_file = file(r, env::GRPC_TLS_CLIENT_CA_FILE);
    match (cert, key) {
        (Some(cert_file), Some(key_file)) => Some(GrpcTls { cert_file, key_file, client_ca_file }),
        (None, None) => {
            if client_ca_file.is_some() {
                r.error("REVIEWLANE_GRPC_TLS_CLIENT_CA_FILE needs REVIEWLANE_GRPC_TLS_CERT_FILE and _KEY_FILE");
            }
            None
        }
        _ => {
            r.error("REVIEWLANE_GRPC_TLS_CERT_FILE and REVIEWLANE_GRPC_TLS_KEY_FILE go together");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn reports_all_problems_at_once() {
        let dir = tempfile_dir();
        let path = dir.join("tenants.toml");
        std::fs::write(&path, "[[tenants]]\nid = \"a\"\nregion = \"eu\"\n").unwrap();
        let env: HashMap<&str, String> = [
            (reviewlane_core::env::TENANTS_FILE, path.display().to_string()),
            (env::NATS_URL_US, "nats://127.0.0.1:1".to_string()),
            (env::MAX_DIFF_BYTES, "lots".to_string()),
            (env::GRPC_ADDR, "nowhere".to_string()),
        ]
        .into_iter()
        .collect();
        let errs = IngressConfig::from_env(&env).unwrap_err();
        assert_eq!(errs.0.len(), 3, "{errs}");
        assert!(errs.to_string().contains(env::NATS_URL_EU));
    }

    #[test]
    fn missing_everything() {
        let env: HashMap<&str, String> = HashMap::new();
        let errs = IngressConfig::from_env(&env).unwrap_err();
        assert_eq!(errs.0.len(), 2, "{errs}");
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("reviewlane-ingress-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
