//! A whole reviewlane deployment in one process, for tests and load scenarios: two regional nats-servers (real
//! processes), per region a simulated provider, an extractor and a publisher, one
//! ingress, and a real webhook receiver. Everything binds 127.0.0.1 port 0.

pub use reviewlane_extractor::config::Price;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::simprovider::{SimConfig, SimProvider};
use crate::webhook::WebhookReceiver;
use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_api::proto::{self, GetReviewRequest, SubmitReviewRequest, WatchReviewRequest};
use reviewlane_core::region::Region;
use reviewlane_core::tenants::{Tenants, hash_api_key};
use reviewlane_extractor::config::{ExtractorConfig, ProviderConfig};
use reviewlane_ingress::IngressConfig;
use reviewlane_publisher::PublisherConfig;
use reviewlane_shared::testing::NatsServer;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

pub const US_KEY: &str = "key-acme-us";
pub const US2_KEY: &str = "key-beta-us";
pub const EU_KEY: &str = "key-euro-eu";
/// Tenant `gamma` (us), whose loopback webhook is refused: no `allow_private_webhook`.
pub const STRICT_KEY: &str = "key-gamma-us";
/// The US operator's key (tenant `gamma`, `role = "operator"`).
pub const OPERATOR_KEY: &str = STRICT_KEY;
pub const US_SECRET: &str = "whsec-acme";
pub const EU_SECRET: &str = "whsec-euro";

pub struct RegionStack {
    /// The region's nats-server; in a clustered region, its first node.
    pub nats: NatsServer,
    /// The other nodes of a clustered region (`StackOptions::us_cluster`).
    pub peers: Vec<NatsServer>,
    pub provider: SimProvider,
    /// Stream and bucket replicas of this region.
    pub replicas: usize,
}

impl RegionStack {
    /// A single-server region.
    pub fn single(nats: NatsServer, provider: SimProvider) -> RegionStack {
        RegionStack { nats, peers: Vec::new(), provider, replicas: 1 }
    }

    /// What services are given: every node's URL.
    pub fn url(&self) -> String {
        std::iter::once(self.nats.url()).chain(self.peers.iter().map(|p| p.url())).collect::<Vec<_>>().join(",")
    }
}

pub struct Stack {
    pub us: RegionStack,
    pub eu: RegionStack,
    pub webhook: WebhookReceiver,
    pub ingress: SocketAddr,
    pub tenants: Arc<Tenants>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
    /// Per running extractor: region, its own stop, its task.
    extractors: Vec<(Region, CancellationToken, JoinHandle<anyhow::Result<()>>)>,
    /// Admin (`/metrics`, `/healthz`, `/readyz`) address of each extractor started.
    pub extractor_admin: Vec<(Region, SocketAddr)>,
    pub publisher_admin: Vec<(Region, SocketAddr)>,
    pub ingress_admin: SocketAddr,
    opts: ExtractorKnobs,
}

#[derive(Clone)]
struct ExtractorKnobs {
    lease: Duration,
    concurrency: usize,
    key_limit: u32,
    key_budgets: Vec<(reviewlane_core::meter::Dimension, u64)>,
    heartbeat: Duration,
    grace: Duration,
    faults: reviewlane_shared::faults::Faults,
    result_inline_max: Option<usize>,
    interactive_wait_limit: Duration,
    schema_dialect: reviewlane_core::schema_dialect::SchemaDialect,
    prices: std::collections::HashMap<String, reviewlane_extractor::config::Price>,
    anthropic: bool,
    context_tokens: Option<usize>,
    provider_batch: String,
}

pub struct StackOptions {
    pub us_provider: SimConfig,
    pub eu_provider: SimConfig,
    /// The US region on a three-node JetStream cluster, every stream and bucket with
    /// three replicas.
    pub us_cluster: bool,
    /// TLS for the ingress's gRPC listener.
    pub grpc_tls: Option<reviewlane_ingress::config::GrpcTls>,
    /// The extractors call the simulated provider through the Anthropic Messages adapter.
    pub anthropic: bool,
    /// The extractors' price table (`REVIEWLANE_MODEL_PRICES`); the simulated model is `sim`.
    pub model_prices: std::collections::HashMap<String, reviewlane_extractor::config::Price>,
    /// Sizes and retention of every region's streams and buckets.
    pub layout: reviewlane_shared::layout::LayoutConfig,
    /// The schema dialect the extractors send.
    pub schema_dialect: reviewlane_core::schema_dialect::SchemaDialect,
    pub canaries: Vec<String>,
    pub max_diff_bytes: usize,
    /// The extractors' `REVIEWLANE_CONTEXT_TOKENS` (`None`: the default).
    pub context_tokens: Option<usize>,
    /// More `[[tenants]]` entries, appended to the test tenants; `{webhook_url}` in them
    /// is the test webhook receiver's address.
    pub extra_tenants: String,
    pub extractor_concurrency: usize,
    /// The extractor's lease (consumer ack wait).
    pub lease: Duration,
    /// Lane size, set on the servers before the services start.
    pub lane_max_messages: Option<i64>,
    /// Extractor replicas per region (0: start none).
    pub extractors: usize,
    /// Calls in flight per quota scope, summed over replicas.
    pub key_limit: u32,
    /// The key's configured budgets (`REVIEWLANE_KEY_BUDGETS`).
    pub key_budgets: Vec<(reviewlane_core::meter::Dimension, u64)>,
    pub heartbeat: Duration,
    pub shutdown_grace: Duration,
    /// Admission policy of the interactive lane, and the sampling period.
    pub interactive_policy: Option<(reviewlane_ingress::admission::LanePolicy, Duration)>,
    /// Fault hooks shared by the ingress and every extractor (armed by the test).
    pub faults: reviewlane_shared::faults::Faults,
    /// Results larger than this go to the object store (`None`: the server's limit).
    pub result_inline_max: Option<usize>,
    /// The publisher's lease: its ack wait and a delivery claim's expiry.
    pub publish_lease: Duration,
    /// Batch pulls no more than its minimum while interactive work waited longer.
    pub interactive_wait_limit: Duration,
    pub ingress_limits: reviewlane_ingress::config::ServerLimits,
    /// The extractors' `REVIEWLANE_PROVIDER_BATCH` (polling fast by default).
    pub provider_batch: String,
    /// The ingress's clock: where submits start their deadlines (the system's if unset).
    pub ingress_clock: Option<reviewlane_core::clock::SharedClock>,
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            us_provider: SimConfig::default(),
            schema_dialect: Default::default(),
            layout: Default::default(),
            grpc_tls: None,
            us_cluster: false,
            model_prices: Default::default(),
            anthropic: false,
            eu_provider: SimConfig::default(),
            canaries: Vec::new(),
            max_diff_bytes: 1024 * 1024,
            context_tokens: None,
            provider_batch: "poll=50ms..200ms".into(),
            extra_tenants: String::new(),
            extractor_concurrency: 8,
            lease: Duration::from_secs(5),
            lane_max_messages: None,
            extractors: 1,
            key_limit: 8,
            key_budgets: Vec::new(),
            heartbeat: Duration::from_millis(200),
            shutdown_grace: Duration::from_secs(2),
            interactive_policy: None,
            faults: Default::default(),
            result_inline_max: None,
            publish_lease: Duration::from_secs(30),
            interactive_wait_limit: Duration::from_secs(5),
            ingress_limits: Default::default(),
            ingress_clock: None,
        }
    }
}

/// The test tenants and the options' extra ones.
pub fn all_tenants_toml(webhook_url: &str, opts: &StackOptions) -> String {
    format!("{}\n{}", tenants_toml(webhook_url), opts.extra_tenants.replace("{webhook_url}", webhook_url))
}

pub fn tenants_toml(webhook_url: &str) -> String {
    format!(
        r#"
[[tenants]]
id = "acme"
region = "us"
api_key_sha256 = ["{us}"]
sink = {{ kind = "webhook", url = "{url}", secret = "{us_secret}" }}
allow_private_webhook = true
# The whole lane: the tests of a full lane fill it with this tenant alone.
lane_share = 1.0

[[tenants]]
id = "beta"
region = "us"
api_key_sha256 = ["{us2}"]
sink = {{ kind = "webhook", url = "{url}", secret = "{us_secret}" }}
allow_private_webhook = true

[[tenants]]
id = "euro"
region = "eu"
api_key_sha256 = ["{eu}"]
sink = {{ kind = "webhook", url = "{url}", secret = "{eu_secret}" }}
allow_private_webhook = true

# Not allowed to deliver to a private address: its loopback webhook is refused. Also
# the region's operator: it sees every tenant's dead letters.
[[tenants]]
id = "gamma"
region = "us"
api_key_sha256 = ["{strict}"]
sink = {{ kind = "webhook", url = "{url}", secret = "{us_secret}" }}
role = "operator"
"#,
        us = hash_api_key(US_KEY),
        us2 = hash_api_key(US2_KEY),
        eu = hash_api_key(EU_KEY),
        strict = hash_api_key(STRICT_KEY),
        url = webhook_url,
        us_secret = US_SECRET,
        eu_secret = EU_SECRET,
    )
}

impl Stack {
    pub async fn start() -> Stack {
        Self::start_with(StackOptions::default()).await
    }

    pub async fn start_with(opts: StackOptions) -> Stack {
        init_test_log();
        let webhook = WebhookReceiver::start().await;
        let toml = all_tenants_toml(&webhook.url(), &opts);
        let tenants = Arc::new(Tenants::parse(&toml).expect("test tenants parse"));
        // Provisioning owns the layout, as `reviewlane-admin provision` does in a deployment.
        let mut layout = opts.layout.clone();
        if let Some(max) = opts.lane_max_messages {
            layout.lane_max_messages = max;
        }
        let us = if opts.us_cluster {
            // Three JetStream nodes; every stream and bucket of the region on all three.
            let cluster = reviewlane_shared::testing::NatsCluster::start().await;
            let replicated = reviewlane_shared::layout::LayoutConfig { replicas: 3, ..layout.clone() };
            reviewlane_shared::testing::provision(&cluster.url(), Region::Us, &replicated).await;
            let mut nodes = cluster.nodes;
            RegionStack {
                nats: nodes.remove(0),
                peers: nodes,
                provider: SimProvider::start_with(opts.us_provider, opts.canaries.clone()).await,
                replicas: 3,
            }
        } else {
            RegionStack::single(
                NatsServer::start_laid_out(Region::Us, &layout).await,
                SimProvider::start_with(opts.us_provider, opts.canaries.clone()).await,
            )
        };
        let eu = RegionStack::single(
            NatsServer::start_laid_out(Region::Eu, &layout).await,
            SimProvider::start_with(opts.eu_provider, opts.canaries.clone()).await,
        );
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        let mut publisher_admin = Vec::new();
        for (region, rs) in [(Region::Us, &us), (Region::Eu, &eu)] {
            let mut pc = PublisherConfig::new(region, rs.url(), tenants.clone());
            pc.delivery_backoff_base = Duration::from_millis(100);
            pc.delivery_backoff_cap = Duration::from_secs(1);
            pc.shutdown_grace = Duration::from_secs(2);
            pc.lease = opts.publish_lease;
            pc.faults = opts.faults.clone();
            pc.store_retry.base = Duration::from_millis(20);
            pc.store_retry.cap = Duration::from_millis(200);
            pc.admin_addr = "127.0.0.1:0".parse().expect("addr");
            let p = reviewlane_publisher::build(pc).await.expect("publisher builds");
            publisher_admin.push((region, p.admin_addr()));
            let s = stop.clone();
            tasks.push(tokio::spawn(p.run_until_stopped(async move { s.cancelled().await })));
        }
        let knobs = ExtractorKnobs {
            lease: opts.lease,
            concurrency: opts.extractor_concurrency,
            key_limit: opts.key_limit,
            key_budgets: opts.key_budgets.clone(),
            heartbeat: opts.heartbeat,
            grace: opts.shutdown_grace,
            faults: opts.faults.clone(),
            result_inline_max: opts.result_inline_max,
            interactive_wait_limit: opts.interactive_wait_limit,
            schema_dialect: opts.schema_dialect,
            prices: opts.model_prices.clone(),
            anthropic: opts.anthropic,
            context_tokens: opts.context_tokens,
            provider_batch: opts.provider_batch.clone(),
        };
        let ingress_clock = opts.ingress_clock.clone().unwrap_or_else(reviewlane_core::clock::system);
        let ingress = reviewlane_ingress::build_with_clock(
            IngressConfig {
                grpc_addr: "127.0.0.1:0".parse().expect("addr"),
                admin_addr: "127.0.0.1:0".parse().expect("addr"),
                tenants: tenants.clone(),
                nats_urls: [(Region::Us, us.url()), (Region::Eu, eu.url())].into(),
                max_diff_bytes: opts.max_diff_bytes,
                shutdown_grace: Duration::from_secs(2),
                telemetry: Default::default(),
                interactive: opts.interactive_policy.map(|p| p.0).unwrap_or(IngressConfig::default_policies().0),
                batch: IngressConfig::default_policies().1,
                admission_sample: opts.interactive_policy.map(|p| p.1).unwrap_or(Duration::from_millis(500)),
                faults: opts.faults.clone(),
                limits: opts.ingress_limits,
                nats: Default::default(),
                grpc_tls: opts.grpc_tls.clone(),
                notices: Vec::new(),
            },
            ingress_clock,
        )
        .await
        .expect("ingress builds");
        let addr = ingress.local_addr();
        let ingress_admin = ingress.admin_addr();
        let s = stop.clone();
        tasks.push(tokio::spawn(ingress.run_until_stopped(async move { s.cancelled().await })));
        let mut stack = Stack {
            us,
            eu,
            webhook,
            ingress: addr,
            tenants,
            stop,
            tasks,
            extractors: Vec::new(),
            extractor_admin: Vec::new(),
            publisher_admin,
            ingress_admin,
            opts: knobs,
        };
        for _ in 0..opts.extractors {
            stack.start_extractor(Region::Us).await;
            stack.start_extractor(Region::Eu).await;
        }
        stack
    }

    /// The fault hooks the ingress and the extractors check.
    pub fn faults(&self) -> &reviewlane_shared::faults::Faults {
        &self.opts.faults
    }

    pub fn region(&self, r: Region) -> &RegionStack {
        match r {
            Region::Us => &self.us,
            Region::Eu => &self.eu,
        }
    }

    /// The configuration of the next extractor replica of `region`; each replica calls
    /// the provider with its own key (`sk-replica-<n>`), so the provider can tell them
    /// apart.
    pub fn extractor_config(&self, region: Region) -> ExtractorConfig {
        let n = self.extractors.iter().filter(|(r, _, _)| *r == region).count();
        let rs = self.region(region);
        let api_key = Some(format!("sk-replica-{n}").into());
        let provider = if self.opts.anthropic {
            ProviderConfig::Anthropic {
                base_url: format!("http://{}", rs.provider.addr()),
                model: "sim".into(),
                api_key,
                endpoint_region: region,
                max_tokens: 1024,
            }
        } else {
            ProviderConfig::OpenAi {
                base_url: rs.provider.base_url(),
                model: "sim".into(),
                api_key,
                endpoint_region: region,
                schema_dialect: self.opts.schema_dialect,
            }
        };
        let mut xc = ExtractorConfig::new(region, rs.url(), self.tenants.clone(), provider);
        xc.scheduling.lease = self.opts.lease;
        xc.results.prices = self.opts.prices.clone();
        xc.scheduling.concurrency = self.opts.concurrency;
        xc.quota.key_limit = self.opts.key_limit;
        xc.quota.budgets = self.opts.key_budgets.clone();
        xc.quota.heartbeat = self.opts.heartbeat;
        xc.retry.backoff.base = Duration::from_millis(200);
        xc.retry.backoff.cap = Duration::from_secs(2);
        xc.retry.batch_backoff = xc.retry.backoff;
        xc.shutdown_grace = self.opts.grace;
        xc.faults = self.opts.faults.clone();
        xc.results.inline_max = self.opts.result_inline_max;
        xc.scheduling.interactive_wait_limit = self.opts.interactive_wait_limit;
        xc.retry.store.base = Duration::from_millis(20);
        xc.retry.store.cap = Duration::from_millis(200);
        xc.admin_addr = "127.0.0.1:0".parse().expect("addr");
        if let Some(t) = self.opts.context_tokens {
            xc.parts.plan.limits.max_tokens = t;
        }
        xc.batch = reviewlane_extractor::config::BatchSettings::parse(&self.opts.provider_batch)
            .expect("the stack's provider batch setting parses");
        xc
    }

    /// Starts one more extractor replica for `region`.
    pub async fn start_extractor(&mut self, region: Region) {
        let xc = self.extractor_config(region);
        self.start_extractor_with(region, xc).await
    }

    /// Starts one more extractor replica for `region` whose OpenAI adapter calls
    /// `base_url` (a gateway in front of the provider, say) instead of the region's
    /// simulated provider.
    pub async fn start_extractor_calling(&mut self, region: Region, url: String) {
        let mut xc = self.extractor_config(region);
        if let ProviderConfig::OpenAi { base_url, .. } = &mut xc.provider {
            *base_url = url;
        }
        self.start_extractor_with(region, xc).await
    }

    /// Starts one more extractor replica for `region` with `xc` (an `extractor_config`
    /// the test changed: another provider endpoint, say).
    pub async fn start_extractor_with(&mut self, region: Region, xc: ExtractorConfig) {
        let x = reviewlane_extractor::build(xc).await.expect("extractor builds");
        self.extractor_admin.push((region, x.admin_addr()));
        let stop = CancellationToken::new();
        let s = stop.clone();
        let admin = x.admin_addr();
        let task = tokio::spawn(x.run_until_stopped(async move { s.cancelled().await }));
        self.extractors.push((region, stop, task));
        // Ready once it has warmed up: before that it takes no share of the key.
        let ready =
            poll_until(Duration::from_secs(10), || async move { http_status_ok(admin, "/readyz").await.then_some(()) });
        assert!(ready.await.is_some(), "extractor not ready in 10 s");
    }

    /// Stops every extractor of `region` as SIGTERM would, and waits for them.
    pub async fn stop_extractors(&mut self, region: Region) {
        let (mine, rest): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.extractors).into_iter().partition(|(r, _, _)| *r == region);
        self.extractors = rest;
        for (_, stop, task) in mine {
            stop.cancel();
            task.await.expect("extractor task").expect("extractor stops cleanly");
        }
    }

    pub async fn client(&self) -> ReviewServiceClient<Channel> {
        ReviewServiceClient::connect(format!("http://{}", self.ingress)).await.expect("connect to ingress")
    }

    /// Stops every service and waits for each to finish draining.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        for (_, stop, task) in std::mem::take(&mut self.extractors) {
            stop.cancel();
            task.await.expect("extractor task").expect("extractor stops cleanly");
        }
        for t in std::mem::take(&mut self.tasks) {
            t.await.expect("service task").expect("service stops cleanly");
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.stop.cancel();
        for (_, stop, _) in &self.extractors {
            stop.cancel();
        }
    }
}

pub fn authed<T>(key: &str, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert("authorization", format!("Bearer {key}").parse().expect("ascii"));
    req
}

pub fn submit_req(key: &str, idem: &str, diff: &str) -> tonic::Request<SubmitReviewRequest> {
    authed(
        key,
        SubmitReviewRequest {
            idempotency_key: idem.to_string(),
            lane: proto::Lane::Interactive as i32,
            diff: diff.to_string(),
            schema_version: "findings.v1".into(),
            metadata: Some(proto::ReviewMetadata {
                repository: "example/repo".into(),
                base_revision: "aaaa".into(),
                head_revision: "bbbb".into(),
                ..Default::default()
            }),

            ..Default::default()
        },
    )
}

/// Submits a review to the batch lane.
pub async fn submit_batch(
    client: &mut ReviewServiceClient<Channel>,
    key: &str,
    idem: &str,
    diff: &str,
) -> proto::Review {
    let mut req = submit_req(key, idem, diff);
    req.get_mut().lane = proto::Lane::Batch as i32;
    client.submit_review(req).await.expect("submit accepted").into_inner().review.expect("review set")
}

/// Submits a review that must be accepted; returns its first view.
pub async fn submit(client: &mut ReviewServiceClient<Channel>, key: &str, idem: &str, diff: &str) -> proto::Review {
    client
        .submit_review(submit_req(key, idem, diff))
        .await
        .expect("submit accepted")
        .into_inner()
        .review
        .expect("review set")
}

/// Watches a job until a final state (at most 30 s), returning the last view.
pub async fn wait_final(client: &mut ReviewServiceClient<Channel>, key: &str, job_id: &str) -> proto::Review {
    wait_final_within(client, key, job_id, Duration::from_secs(30)).await
}

/// Watches a job until a final state (at most `limit`), returning the last view.
pub async fn wait_final_within(
    client: &mut ReviewServiceClient<Channel>,
    key: &str,
    job_id: &str,
    limit: Duration,
) -> proto::Review {
    let watch = async {
        let mut stream = client
            .watch_review(authed(key, WatchReviewRequest { job_id: job_id.to_string() }))
            .await
            .expect("watch starts")
            .into_inner();
        let mut last = None;
        while let Some(msg) = stream.message().await.expect("watch message") {
            last = msg.review;
        }
        last.expect("watch yields at least one state")
    };
    match tokio::time::timeout(limit, watch).await {
        Ok(r) => r,
        Err(_) => {
            let now = get(client, key, job_id).await;
            panic!("job {job_id} did not reach a final state within {limit:?}; now: {now:?}")
        }
    }
}

/// Cancels a job; the view the cancel answers with.
pub async fn cancel(client: &mut ReviewServiceClient<Channel>, key: &str, job_id: &str) -> proto::Review {
    client
        .cancel_review(authed(key, proto::CancelReviewRequest { job_id: job_id.to_string() }))
        .await
        .expect("cancel answered")
        .into_inner()
        .review
        .expect("review set")
}

pub async fn get(
    client: &mut ReviewServiceClient<Channel>,
    key: &str,
    job_id: &str,
) -> Result<proto::Review, tonic::Status> {
    client
        .get_review(authed(key, GetReviewRequest { job_id: job_id.to_string() }))
        .await
        .map(|r| r.into_inner().review.expect("review set"))
}

/// Every message on one stream of a region's server, as (subject, headers, payload).
pub async fn stream_messages(url: &str, stream: &str) -> Vec<(String, async_nats::HeaderMap, bytes::Bytes)> {
    let js = async_nats::jetstream::new(async_nats::connect(url).await.expect("connect"));
    let mut s = js.get_stream(stream).await.expect("stream exists");
    let state = s.info().await.expect("stream info").state.clone();
    let mut out = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        if let Ok(m) = s.get_raw_message(seq).await {
            out.push((m.subject.to_string(), m.headers, m.payload));
        }
    }
    out
}

/// Whether GET `path` answers 200.
pub async fn http_status_ok(addr: SocketAddr, path: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else { return false };
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out.starts_with("HTTP/1.1 200")
}

/// GET a path from a local HTTP server (admin ports); the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
}

/// The sum of a metric's samples on a Prometheus text page (every label set of `name`).
pub fn metric_sum(page: &str, name: &str) -> f64 {
    page.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

/// Polls `cond` every 50 ms for at most `limit`.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond()
}

/// Runs `probe` until it finds what it looks for (`Some`), or `limit` has passed (then
/// `None`): for conditions that can only be read, not waited on.
pub async fn poll_until<T, F, Fut>(limit: Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(found) = probe().await {
            return Some(found);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (at most 10 s) until the region's publisher has settled every findings
/// message: none pending, none unacknowledged — so no further delivery can come.
pub async fn publisher_settled(stack: &Stack, region: Region) {
    let js = async_nats::jetstream::new(async_nats::connect(stack.region(region).url()).await.expect("connect"));
    let stream = js.get_stream(reviewlane_shared::layout::findings_stream(region)).await.expect("findings stream");
    let consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(reviewlane_publisher::startup::CONSUMER_NAME).await.expect("publisher consumer");
    let settled = poll_until(Duration::from_secs(10), || {
        let mut consumer = consumer.clone();
        async move {
            let info = consumer.info().await.ok()?;
            (info.num_pending == 0 && info.num_ack_pending == 0 && info.delivered.stream_sequence >= 1).then_some(())
        }
    })
    .await;
    assert!(settled.is_some(), "the publisher did not settle its findings messages in 10 s");
}

/// Waits (at most 10 s) until every running extractor says it is ready (its NATS, its
/// streams, its warm-up over: it has its share of the key).
pub async fn extractors_ready(stack: &Stack) {
    for (_, admin) in &stack.extractor_admin {
        let ready = poll_until(Duration::from_secs(10), || async {
            (http_get(*admin, "/readyz").await == "ready\n").then_some(())
        })
        .await;
        assert!(ready.is_some(), "extractor at {admin} not ready in 10 s");
    }
}

/// Waits (at most 10 s) until `tenant`'s pull loops on every lane of `region` are in
/// their long-poll (each consumer has a pull request waiting).
pub async fn lanes_polling(stack: &Stack, region: Region, tenant: &str) {
    let js = async_nats::jetstream::new(async_nats::connect(stack.region(region).url()).await.expect("connect"));
    for lane in reviewlane_core::region::Lane::ALL {
        let stream = js.get_stream(reviewlane_shared::layout::lane_stream(region, lane)).await.expect("lane stream");
        let consumer: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer(&reviewlane_shared::layout::lane_consumer(lane, tenant)).await.expect("lane consumer");
        let polling = poll_until(Duration::from_secs(10), || {
            let mut consumer = consumer.clone();
            async move { (consumer.info().await.ok()?.num_waiting > 0).then_some(()) }
        })
        .await;
        assert!(polling.is_some(), "{} loop of {tenant} not polling in 10 s", lane.as_str());
    }
}

pub fn init_test_log() {
    if std::env::var_os("TEST_LOG").is_some() {
        reviewlane_shared::testing::capture();
    }
}

/// A small diff with problems the built-in analyzer and the simulated provider find.
pub fn sample_diff(marker: &str) -> String {
    format!(
        "diff --git a/src/handler.rs b/src/handler.rs\nindex 1111111..2222222 100644\n--- a/src/handler.rs\n+++ b/src/handler.rs\n@@ -1,3 +1,5 @@\n fn handle(req: Request) -> Response {{\n+    let user = lookup(req.id).unwrap(); // {marker}\n+    // TODO: check permissions\n     respond(user)\n }}\n"
    )
}
