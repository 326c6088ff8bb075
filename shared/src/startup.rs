//! What every service does at start and stop: connect to its region's NATS and check
//! the wiring, map start-up failures to exit codes, and wait for SIGTERM/SIGINT.

use async_nats::jetstream;

use crate::config::{ConfigErrors, EXIT_CONFIG, EXIT_WIRING};
use crate::layout::{self, LayoutConfig, RegionLayout, WiringError};
use crate::region::Region;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    #[error("{0}")]
    Wiring(#[from] WiringError),
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect { url: String, source: async_nats::ConnectError },
    #[error("cannot set up streams and buckets at {url}: {source}")]
    Layout { url: String, source: async_nats::Error },
    #[error("{0}")]
    Other(#[from] anyhow::Error),
}

impl StartError {
    /// 64 for configuration, 78 for wiring, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            StartError::Config(_) => EXIT_CONFIG,
            StartError::Wiring(_) => EXIT_WIRING,
            _ => 1,
        }
    }
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
    layout_cfg: &LayoutConfig,
) -> Result<RegionConnection, StartError> {
    let client = async_nats::ConnectOptions::new()
        .name(name)
        .max_reconnects(None)
        .connect(url)
        .await
        .map_err(|source| StartError::Connect { url: url.to_string(), source })?;
    let js = jetstream::new(client.clone());
    layout::verify_identity(&js, region, url).await?;
    let layout = layout::ensure(&js, region, layout_cfg)
        .await
        .map_err(|source| StartError::Layout { url: url.to_string(), source })?;
    Ok(RegionConnection { client, layout })
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
