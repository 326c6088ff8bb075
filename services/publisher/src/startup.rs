//! Building and running one region's publisher.

use std::future::Future;
use std::sync::Arc;

use async_nats::jetstream::consumer::PullConsumer;
use prometheus_client::registry::Registry;
use reviewlane_shared::admin::{Admin, nats_ready};
use reviewlane_shared::job_store::JobStore;
use reviewlane_shared::layout;
use reviewlane_shared::pull::{Puller, pull_loop};
use reviewlane_shared::startup::{StartError, connect_region, durable_consumer};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::config::PublisherConfig;
use crate::sink::Sinks;
use crate::worker::Worker;

pub const CONSUMER_NAME: &str = "publisher";

pub struct App {
    admin: Admin,
    registry: Arc<Registry>,
    client: async_nats::Client,
    worker: Arc<Worker>,
    consumer: PullConsumer,
    config: PublisherConfig,
}

pub async fn build(config: PublisherConfig) -> Result<App, StartError> {
    reviewlane_shared::startup::log_notices(&config.notices);
    let conn = connect_region(&config.nats_url, config.region, "reviewlane-publisher", &config.nats).await?;
    let consumer =
        durable_consumer(&conn.layout.js, &layout::findings_stream(config.region), CONSUMER_NAME, None, config.lease)
            .await?;
    let admin = Admin::bind(config.admin_addr).await.map_err(|e| StartError::Other(e.into()))?;
    let mut registry = Registry::default();
    let metrics = crate::metrics::Metrics::register(&mut registry, config.region, config.lane_windows);
    registry.register_collector(Box::new(reviewlane_shared::admin::NatsConnected(vec![(
        config.region,
        conn.client.clone(),
    )])));
    let github_metrics = metrics.github.clone();
    let health = reviewlane_shared::store_health::StoreHealth::register(
        &mut registry,
        &[config.region],
        reviewlane_core::clock::system(),
    );
    let worker = Arc::new(Worker {
        metrics,
        region: config.region,
        jobs: JobStore::new(conn.layout.jobs.clone(), conn.client.clone()),
        results: reviewlane_shared::results::Results::new(
            conn.layout.clone(),
            reviewlane_shared::results::message_max(&conn.client, &conn.layout),
        ),
        claims: crate::claim::Claims {
            me: format!("{:016x}", rand::random::<u64>()),
            lease_ms: config.lease.as_millis() as u64,
            clock: reviewlane_core::clock::system(),
        },
        tenants: config.tenants.clone(),
        sinks: Sinks::new(config.sink_timeout)
            .with_shared_pauses(conn.layout.published.clone())
            .with_github_metrics(github_metrics),
        delivery_attempts: config.delivery_attempts,
        backoff_base: config.delivery_backoff_base,
        backoff_cap: config.delivery_backoff_cap,
        store_retry: config.store_retry,
        health,
        faults: config.faults.clone(),
    });
    Ok(App { admin, registry: Arc::new(registry), client: conn.client, worker, consumer, config })
}

impl App {
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub fn admin_addr(&self) -> std::net::SocketAddr {
        self.admin.local_addr()
    }

    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let stop = CancellationToken::new();
        let nats = nats_ready(
            self.client.clone(),
            vec![
                layout::findings_stream(self.config.region),
                format!("KV_{}", layout::published_bucket(self.config.region)),
            ],
        );
        // Ready while NATS is and its store takes writes.
        let health = self.worker.health.clone();
        let ready: reviewlane_shared::admin::Ready = Arc::new(move || {
            let (nats, health) = (nats.clone(), health.clone());
            Box::pin(async move { health.ready() && nats().await })
        });
        let admin = tokio::spawn(self.admin.run(self.registry.clone(), ready, stop.clone()));
        let tasks = TaskTracker::new();
        let slots = Arc::new(Semaphore::new(self.config.concurrency));
        let worker = self.worker.clone();
        let handle = move |msg| {
            let worker = worker.clone();
            async move {
                worker.process_one(msg).await;
            }
        };
        let span = tracing::info_span!("pull_loop", region = %self.config.region);
        let puller = Puller::new(self.consumer, self.client.clone()).await?;
        let pulling = tokio::spawn(pull_loop(puller, slots, tasks.clone(), stop.clone(), handle).instrument(span));
        tracing::info!(region = %self.config.region, "publisher running");
        shutdown.await;
        tracing::info!("shutting down: no new pulls");
        stop.cancel();
        let _ = pulling.await;
        let _ = admin.await;
        tasks.close();
        if tokio::time::timeout(self.config.shutdown_grace, tasks.wait()).await.is_err() {
            tracing::warn!("grace period over with deliveries in flight; they will be redelivered");
        }
        self.client.drain().await?;
        tracing::info!("publisher stopped");
        Ok(())
    }
}
