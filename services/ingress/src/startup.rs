//! Building and running the ingress: connect to every configured region (identity
//! checked), serve gRPC (review service behind authentication, health, reflection),
//! and drain on shutdown.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;

use std::sync::Arc;

use prometheus_client::registry::Registry;
use reviewlane_api::proto::review_service_server::ReviewServiceServer;
use reviewlane_core::clock::SharedClock;
use reviewlane_core::region::{Lane, Region};
use reviewlane_shared::admin::{Admin, Ready, nats_ready};
use reviewlane_shared::layout;
use reviewlane_shared::startup::{StartError, connect_region};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::Sampler;
use crate::auth::{Authenticated, Authenticator};
use crate::config::IngressConfig;
use crate::service::{RegionHandle, ReviewApi};

pub struct App {
    listener: TcpListener,
    admin: Admin,
    registry: Arc<Registry>,
    api: ReviewApi,
    config: IngressConfig,
    clients: Vec<async_nats::Client>,
    shutdown: CancellationToken,
    health: reviewlane_shared::store_health::StoreHealth,
}

/// The largest request the server decodes for a diff limit: the diff, its metadata (at
/// most 4 KiB of fields) and protobuf framing, with room to spare.
pub fn request_limit(max_diff_bytes: usize) -> usize {
    max_diff_bytes.saturating_add(64 * 1024)
}

pub async fn build(config: IngressConfig) -> Result<App, StartError> {
    build_with_clock(config, reviewlane_core::clock::system()).await
}

/// `build`, with deadlines started from `clock`'s time (tests move it).
pub async fn build_with_clock(config: IngressConfig, clock: SharedClock) -> Result<App, StartError> {
    reviewlane_shared::startup::log_notices(&config.notices);
    reviewlane_core::findings::warm_up();
    let mut regions = BTreeMap::new();
    let mut clients = Vec::new();
    for (region, url) in &config.nats_urls {
        let conn =
            connect_region(url, *region, "reviewlane-ingress", &config.nats.get(region).cloned().unwrap_or_default())
                .await?;
        let max_payload = conn.client.server_info().max_payload;
        regions.insert(
            *region,
            RegionHandle {
                jobs: reviewlane_shared::job_store::JobStore::new(conn.layout.jobs.clone(), conn.client.clone()),
                results: reviewlane_shared::results::Results::new(
                    conn.layout.clone(),
                    reviewlane_shared::results::message_max(&conn.client, &conn.layout),
                ),
                layout: conn.layout,
                max_payload,
            },
        );
        clients.push(conn.client);
    }
    let listener = TcpListener::bind(config.grpc_addr).await.map_err(|e| StartError::Other(e.into()))?;
    let admin = Admin::bind(config.admin_addr).await.map_err(|e| StartError::Other(e.into()))?;
    let shutdown = CancellationToken::new();
    let sampler = Sampler::default();
    for (region, handle) in &regions {
        let tenants =
            config.tenants.iter().filter(|t| t.region == *region).map(|t| (t.id.clone(), t.splits_depth())).collect();
        let js = handle.layout.js.clone();
        tokio::spawn(sampler.clone().run(*region, js, tenants, config.admission_sample, shutdown.clone()));
    }
    let mut registry = Registry::default();
    let metrics = crate::rpc::Metrics::register(&mut registry);
    for region in regions.keys() {
        metrics.terminal.at_zero(*region);
    }
    let region_list: Vec<Region> = regions.keys().copied().collect();
    let health = reviewlane_shared::store_health::StoreHealth::register(
        &mut registry,
        &region_list,
        reviewlane_core::clock::system(),
    );
    let connections = config.nats_urls.keys().copied().zip(clients.iter().cloned()).collect();
    registry.register_collector(Box::new(reviewlane_shared::admin::NatsConnected(connections)));
    let api = ReviewApi::new(
        regions,
        config.max_diff_bytes,
        shutdown.clone(),
        sampler,
        [config.interactive, config.batch],
        Authenticator::new(config.tenants.clone()),
        metrics,
    )
    .with_faults(config.faults.clone())
    .with_store_health(health.clone())
    .with_limits(config.limits)
    .with_tenants(&config.tenants)
    .with_clock(clock);
    Ok(App { listener, admin, registry: Arc::new(registry), api, config, clients, shutdown, health })
}

impl App {
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr()
    }

    /// Serves until `shutdown` resolves, then stops accepting, lets in-flight calls
    /// finish within the grace period, and drains the NATS connections.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let (health_reporter, health_service) = tonic_health::server::health_reporter();
        health_reporter.set_serving::<ReviewServiceServer<ReviewApi>>().await;
        // Reflection in both versions: grpcurl and the Python client of any age.
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(reviewlane_api::proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let (reflection_v1, reflection_v1alpha) = (reflection().build_v1()?, reflection().build_v1alpha()?);
        // gRPC health follows the NATS connections: NOT_SERVING while any region's is
        // down, SERVING again once it is back (`/readyz` follows the same rule).
        let health_stop = CancellationToken::new();
        tokio::spawn(follow_nats(self.clients.clone(), health_reporter.clone(), health_stop.clone()));
        // Ready when every region's NATS is connected and its lanes exist.
        let checks: Vec<Ready> = self
            .config
            .nats_urls
            .keys()
            .zip(&self.clients)
            .map(|(region, client)| {
                let lanes = Lane::ALL.iter().map(|l| layout::lane_stream(*region, *l)).collect();
                nats_ready(client.clone(), lanes)
            })
            .collect();
        // And while some region's store takes writes (one full region's callers are
        // answered UNAVAILABLE; both full, nothing can be accepted).
        let health = self.health.clone();
        let ready: Ready = Arc::new(move || {
            let (checks, health) = (checks.clone(), health.clone());
            Box::pin(async move {
                if !health.any_ready() {
                    return false;
                }
                for c in &checks {
                    if !c().await {
                        return false;
                    }
                }
                true
            })
        });
        let admin_stop = self.shutdown.clone();
        let admin = tokio::spawn(self.admin.run(self.registry.clone(), ready, admin_stop));
        // tonic's decoding limit sits above every diff limit (with room for the rest of
        // the request), so callers meet our check, which names the limit.
        let largest =
            self.config.tenants.iter().filter_map(|t| t.max_diff_bytes).fold(self.config.max_diff_bytes, usize::max);
        let (auth, metrics) = (self.api.authenticator(), self.api.metrics());
        let limit = request_limit(largest);
        let service = Authenticated::new(
            crate::request_limit::DecodingLimit::new(
                ReviewServiceServer::new(self.api).max_decoding_message_size(limit).max_encoding_message_size(limit),
                limit,
                metrics.clone(),
            ),
            auth,
            metrics,
        );
        tracing::info!(addr = %self.listener.local_addr()?, regions = self.clients.len(), "ingress serving");

        let token = self.shutdown.clone();
        let grace = self.config.shutdown_grace;
        let stopping = async move {
            shutdown.await;
            tracing::info!("shutting down: no new calls");
            health_stop.cancel();
            health_reporter.set_not_serving::<ReviewServiceServer<ReviewApi>>().await;
            // End open watches so the server can finish.
            token.cancel();
        };
        let limits = self.config.limits;
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &self.config.grpc_tls {
            builder = builder.tls_config(server_tls(tls)?)?;
        }
        let server = builder
            .timeout(limits.request_timeout)
            .max_concurrent_streams(limits.max_streams_per_connection)
            .http2_keepalive_interval(Some(limits.http2_keepalive))
            .http2_keepalive_timeout(Some(limits.http2_keepalive))
            .trace_fn(crate::rpc::span_for)
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(service)
            // TCP_NODELAY: small gRPC answers must not wait for Nagle's algorithm (~40 ms).
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(self.listener).with_nodelay(Some(true)),
                stopping,
            );
        let token = self.shutdown.clone();
        tokio::select! {
            res = server => res?,
            _ = async { token.cancelled().await; tokio::time::sleep(grace).await } => {
                tracing::warn!("grace period over with calls still in flight");
            }
        }
        let _ = admin.await;
        for c in self.clients {
            let _ = c.drain().await;
        }
        tracing::info!("ingress stopped");
        Ok(())
    }
}

/// How often the health service looks at the NATS connections (a local read, no
/// round trip).
const HEALTH_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// Sets the review service `NOT_SERVING` while any region's NATS connection is down and
/// `SERVING` once all are up, until `stop`.
async fn follow_nats(
    clients: Vec<async_nats::Client>,
    reporter: tonic_health::server::HealthReporter,
    stop: CancellationToken,
) {
    use async_nats::connection::State;
    let mut serving = true;
    let mut every = tokio::time::interval(HEALTH_EVERY);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.cancelled() => return,
        }
        let up = clients.iter().all(|c| c.connection_state() == State::Connected);
        if up == serving {
            continue;
        }
        serving = up;
        if up {
            tracing::info!("every region's NATS is connected again: serving");
            reporter.set_serving::<ReviewServiceServer<ReviewApi>>().await;
        } else {
            tracing::warn!("a region's NATS connection is down: not serving");
            reporter.set_not_serving::<ReviewServiceServer<ReviewApi>>().await;
        }
    }
}

/// The listener's TLS from its PEM files: rustls, optionally requiring client
/// certificates signed by a CA.
fn server_tls(tls: &crate::config::GrpcTls) -> anyhow::Result<tonic::transport::ServerTlsConfig> {
    use anyhow::Context as _;
    let cert = std::fs::read(&tls.cert_file).context("reading REVIEWLANE_GRPC_TLS_CERT_FILE")?;
    let key = std::fs::read(&tls.key_file).context("reading REVIEWLANE_GRPC_TLS_KEY_FILE")?;
    let mut config = tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(cert, key));
    if let Some(ca) = &tls.client_ca_file {
        let ca = std::fs::read(ca).context("reading REVIEWLANE_GRPC_TLS_CLIENT_CA_FILE")?;
        config = config.client_ca_root(tonic::transport::Certificate::from_pem(ca));
    }
    Ok(config)
}
