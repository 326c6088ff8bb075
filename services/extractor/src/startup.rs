//! Building and running one region's extractor: verify the wiring, create the durable
//! pull consumers, pull only as many messages as there are free call slots, and drain
//! on shutdown.

use std::future::Future;
use std::sync::Arc;

use async_nats::jetstream::consumer::PullConsumer;
use reviewlane_shared::job_store::JobStore;
use reviewlane_shared::layout::{self, LayoutConfig};
use reviewlane_shared::pull::pull_loop;
use reviewlane_shared::region::Lane;
use reviewlane_shared::startup::{StartError, connect_region, durable_consumer};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::config::{ExtractorConfig, ProviderConfig};
use crate::provider::Provider;
use crate::provider::builtin::BuiltinAnalyzer;
use crate::provider::openai::OpenAiProvider;
use crate::worker::Worker;

pub struct App {
    client: async_nats::Client,
    worker: Arc<Worker>,
    consumers: Vec<(Lane, PullConsumer)>,
    config: ExtractorConfig,
}

pub fn consumer_name(lane: Lane) -> String {
    format!("extractor-{}", lane.as_str())
}

pub async fn build(config: ExtractorConfig) -> Result<App, StartError> {
    build_with_provider(config, None).await
}

/// As `build`, with a provider supplied by the caller (tests, embedding).
pub async fn build_with_provider(
    config: ExtractorConfig,
    provider: Option<Arc<dyn Provider>>,
) -> Result<App, StartError> {
    let provider: Arc<dyn Provider> = match (provider, &config.provider) {
        (Some(p), _) => p,
        (None, ProviderConfig::Builtin) => Arc::new(BuiltinAnalyzer::new(config.region)),
        (None, ProviderConfig::OpenAi { base_url, model, api_key, endpoint_region }) => Arc::new(OpenAiProvider::new(
            base_url,
            model.clone(),
            api_key.clone(),
            *endpoint_region,
            config.provider_timeout,
            config.hint_ceiling,
        )),
    };
    if provider.region() != config.region {
        return Err(StartError::Other(anyhow::anyhow!(
            "provider endpoint belongs to region `{}` but this extractor serves `{}`",
            provider.region(),
            config.region
        )));
    }
    let conn =
        connect_region(&config.nats_url, config.region, "reviewlane-extractor", &LayoutConfig::default()).await?;
    let mut consumers = Vec::new();
    for lane in Lane::ALL {
        let c = durable_consumer(
            &conn.layout.js,
            &layout::lane_stream(config.region, lane),
            &consumer_name(lane),
            config.lease,
        )
        .await?;
        consumers.push((lane, c));
    }
    let worker = Arc::new(Worker {
        region: config.region,
        jobs: JobStore::new(conn.layout.jobs.clone(), conn.client.clone()),
        layout: conn.layout,
        provider,
        budgets: config.budgets,
        backoff: config.backoff,
        lease: config.lease,
        provider_timeout: config.provider_timeout,
    });
    Ok(App { client: conn.client, worker, consumers, config })
}

impl App {
    pub fn worker(&self) -> Arc<Worker> {
        self.worker.clone()
    }

    /// Pulls and processes until `shutdown` resolves; then stops pulling, gives calls in
    /// flight the grace period, hands back what is left, and drains NATS.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let stop = CancellationToken::new();
        let abort = CancellationToken::new();
        let slots = Arc::new(Semaphore::new(self.config.concurrency));
        let tasks = TaskTracker::new();
        let mut loops = Vec::new();
        for (lane, consumer) in self.consumers {
            let span = tracing::info_span!("pull_loop", region = %self.config.region, lane = lane.as_str());
            let worker = self.worker.clone();
            let abort = abort.clone();
            let handle = move |msg| {
                let worker = worker.clone();
                let abort = abort.clone();
                async move {
                    worker.process_one(msg, &abort).await;
                }
            };
            loops.push(tokio::spawn(
                pull_loop(consumer, slots.clone(), tasks.clone(), stop.clone(), handle).instrument(span),
            ));
        }
        tracing::info!(region = %self.config.region, concurrency = self.config.concurrency, "extractor running");
        shutdown.await;
        tracing::info!("shutting down: no new pulls");
        stop.cancel();
        for l in loops {
            let _ = l.await;
        }
        tasks.close();
        if tokio::time::timeout(self.config.shutdown_grace, tasks.wait()).await.is_err() {
            tracing::warn!("grace period over; handing back unfinished work");
            abort.cancel();
            tasks.wait().await;
        }
        self.client.drain().await?;
        tracing::info!("extractor stopped");
        Ok(())
    }
}
