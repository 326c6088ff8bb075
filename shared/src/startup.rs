//! What every service does at start and stop: connect to its region's NATS and check
//! the wiring, map start-up failures to exit codes, and wait for SIGTERM/SIGINT.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};

use crate::layout::{self, RegionLayout, WiringError};
use crate::nats_client::{NatsClientConfig, redact};
use reviewlane_core::config::{ConfigErrors, EXIT_CONFIG, EXIT_NATS_AUTH, EXIT_WIRING};
use reviewlane_core::region::Region;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    #[error("{0}")]
    Wiring(#[from] WiringError),
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect { url: String, source: async_nats::ConnectError },
    /// The server refused the credentials (or the TLS handshake).
    #[error("NATS at {url} refused the connection's credentials: {source}; check REVIEWLANE_NATS_* (see docs)")]
    Auth { url: String, source: async_nats::ConnectError },
    #[error("{0}")]
    Other(#[from] anyhow::Error),
}

impl StartError {
    /// 64 for configuration, 78 for wiring, 77 for credentials NATS refused, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            StartError::Config(_) => EXIT_CONFIG,
            StartError::Wiring(_) => EXIT_WIRING,
            StartError::Auth { .. } => EXIT_NATS_AUTH,
            _ => 1,
        }
    }
}

/// Logs each configuration notice (a variable set that the service no longer reads);
/// notices name variables, never values.
pub fn log_notices(notices: &[String]) {
    for notice in notices {
        tracing::warn!(notice = %notice, "configuration");
    }
}

/// A durable pull consumer with explicit acks whose ack wait is the lease. Delivery is
/// unlimited (`max_deliver` -1): retry budgets live in the job record, and naks must
/// not run into a cap. One that exists with another filter is given this one in place
/// (its messages and their deliveries stay).
pub async fn durable_consumer(
    js: &jetstream::Context,
    stream: &str,
    name: &str,
    filter_subject: Option<String>,
    lease: Duration,
) -> Result<consumer::PullConsumer, StartError> {
    let stream = js.get_stream_no_info(stream).await.map_err(|e| StartError::Other(e.into()))?;
    let config = consumer::pull::Config {
        durable_name: Some(name.to_string()),
        filter_subject: filter_subject.unwrap_or_default(),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: lease,
        max_deliver: -1,
        max_ack_pending: 10_000,
        ..Default::default()
    };
    let found: consumer::PullConsumer =
        stream.get_or_create_consumer(name, config.clone()).await.map_err(|e| StartError::Other(e.into()))?;
    if found.cached_info().config.filter_subject == config.filter_subject {
        return Ok(found);
    }
    // Without an action, the server creates or updates: an update here.
    stream.create_consumer(config).await.map_err(|e| StartError::Other(e.into()))
}

/// A connection to one region's NATS, its identity verified and its layout in place.
pub struct RegionConnection {
    pub client: async_nats::Client,
    pub layout: RegionLayout,
}

pub async fn connect_region(
    url: &str,
    region: Region,
    name: &str,
    client_cfg: &NatsClientConfig,
) -> Result<RegionConnection, StartError> {
    let shown = redact(url);
    let options =
        client_cfg.options(name).await.map_err(|e| StartError::Other(anyhow::anyhow!("NATS credentials: {e}")))?;
    let addrs = crate::nats_client::server_addrs(url)
        .map_err(|e| StartError::Other(anyhow::anyhow!("NATS URL {shown} does not parse: {e}")))?;
    let client = options.connect(addrs).await.map_err(|source| match source.kind() {
        async_nats::ConnectErrorKind::AuthorizationViolation
        | async_nats::ConnectErrorKind::Authentication
        | async_nats::ConnectErrorKind::Tls => StartError::Auth { url: shown.clone(), source },
        _ => StartError::Connect { url: shown.clone(), source },
    })?;
    let js = jetstream::new(client.clone());
    layout::verify_identity(&js, region, &shown).await?;
    let layout = layout::open(&js, region, &shown).await?;
    Ok(RegionConnection { client, layout })
}

/// The whole `main` of a service: read the configuration (exit 64 on errors, before
/// binding anything; with `--check-config`, stop there with 0), start logging, build (exit 78 on wiring errors), run until
/// SIGTERM/SIGINT, exit 0 after a clean drain.
pub async fn run_service<C, A, B, R>(
    name: &str,
    config: Result<C, ConfigErrors>,
    telemetry: impl FnOnce(&C) -> crate::telemetry::TelemetryConfig,
    build: impl FnOnce(C) -> B,
    run: impl FnOnce(A, std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> R,
) -> std::process::ExitCode
where
    B: Future<Output = Result<A, StartError>>,
    R: Future<Output = anyhow::Result<()>>,
{
    use std::process::ExitCode;
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    // `--check-config`: the whole config loaded and validated (files read), nothing
    // bound, nothing connected.
    if std::env::args().any(|a| a == "--check-config") {
        println!("{name}: configuration is valid");
        return ExitCode::SUCCESS;
    }
    let telemetry = crate::telemetry::init(service_name(name), &telemetry(&config));
    let app = match build(config).await {
        Ok(app) => app,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            eprintln!("{name}: {e}");
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    let code = match run(app, Box::pin(shutdown_signal())).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "stopped with an error");
            ExitCode::FAILURE
        }
    };
    telemetry.shutdown();
    code
}

/// The OpenTelemetry `service.name` of a binary.
fn service_name(name: &str) -> &'static str {
    match name {
        "reviewlane-ingress" => "reviewlane-ingress",
        "reviewlane-extractor" => "reviewlane-extractor",
        "reviewlane-publisher" => "reviewlane-publisher",
        _ => "reviewlane",
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
