//! Building and running one region's extractor: verify the wiring, create one durable
//! pull consumer per (lane, tenant), announce the replica in `QUOTA_<R>`, serve the
//! consumers through the scheduler, and drain on shutdown.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;
use reviewlane_core::job::ReviewDepth;
use reviewlane_core::region::Lane;
use reviewlane_shared::admin::Admin;
use reviewlane_shared::job_store::JobStore;
use reviewlane_shared::layout;
use reviewlane_shared::results::{Results, message_max};
use reviewlane_shared::startup::{StartError, connect_region, durable_consumer};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::config::{ExtractorConfig, ProviderConfig};
use crate::metrics::Metrics;
use crate::pool::{Deployment, Others};
use crate::provider::Provider;
use crate::provider::builtin::BuiltinAnalyzer;
use crate::provider::openai::OpenAiProvider;
use crate::quota::{KeyConfig, Quota, Scope};
use crate::schedule::{Backlog, LaneLoop, Slots, serve};
use crate::worker::Worker;

pub struct App {
    admin: Admin,
    registry: Arc<Registry>,
    client: async_nats::Client,
    worker: Arc<Worker>,
    /// Each deployment's lane loops, with their weight.
    loops: Vec<(LaneLoop, u32, Arc<Deployment>)>,
    /// The pool: the deployment `REVIEWLANE_PROVIDER` names first, then the file's.
    deployments: Vec<Arc<Deployment>>,
    /// The first deployment's key: the replica's slots wake on its changes.
    quota: Quota,
    /// Drive each class's provider batches while this replica leads them: one per class
    /// with a batch path (none where no deployment has a batch API this region may use).
    coordinators: Vec<crate::sweep::Coordinator>,
    config: ExtractorConfig,
}

pub fn consumer_name(lane: Lane, tenant: &str) -> String {
    layout::lane_consumer(lane, tenant)
}

pub async fn build(config: ExtractorConfig) -> Result<App, StartError> {
    build_with_provider(config, None).await
}

/// As `build`, with a provider supplied by the caller (tests, embedding).
pub async fn build_with_provider(
    mut config: ExtractorConfig,
    provider: Option<Arc<dyn Provider>>,
) -> Result<App, StartError> {
    reviewlane_shared::startup::log_notices(&config.notices);
    let output = config.provider.output_reserve();
    crate::config::fit_parts_to_budget(&mut config.parts, &config.quota.budgets, output)
        .map_err(|e| StartError::Other(anyhow::anyhow!(e)))?;
    // A part fits one call on every deployment it may go to.
    for d in &config.pool {
        crate::config::fit_parts_to_budget(&mut config.parts, &d.budgets, d.provider.output_reserve())
            .map_err(|e| StartError::Other(anyhow::anyhow!("deployment `{}`: {e}", d.id)))?;
    }
    reviewlane_core::findings::warm_up();
    let provider = provider.unwrap_or_else(|| provider_of(&config, &config.provider));
    let adapters: Vec<Arc<dyn Provider>> = std::iter::once(provider.clone())
        .chain(config.pool.iter().map(|d| provider_of(&config, &d.provider)))
        .collect();
    for adapter in &adapters {
        if adapter.region() != config.region {
            return Err(StartError::Other(anyhow::anyhow!(
                "provider endpoint belongs to region `{}` but this extractor serves `{}`",
                adapter.region(),
                config.region
            )));
        }
    }
    let conn = connect_region(&config.nats_url, config.region, "reviewlane-extractor", &config.nats).await?;
    let (consumers, key) = lane_consumers(&config, &conn, provider.name()).await?;
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry, config.region);
    registry.register_collector(Box::new(reviewlane_shared::admin::NatsConnected(vec![(
        config.region,
        conn.client.clone(),
    )])));
    for (lane, window) in Lane::ALL.into_iter().zip(config.lane_windows) {
        metrics.slo(lane, window);
    }
    let admin = Admin::bind(config.admin_addr).await.map_err(|e| StartError::Other(e.into()))?;
    let clock = reviewlane_core::clock::system();
    let health = reviewlane_shared::store_health::StoreHealth::register(&mut registry, &[config.region], clock.clone());
    let q = &config.quota;
    let quota = Quota::new(
        conn.layout.quota.clone(),
        conn.client.clone(),
        key.clone(),
        q.heartbeat,
        q.probe_every,
        clock.clone(),
    )
    .with_budgets(q.budgets.clone())
    .enforced_over(config.provider.enforced_windows());
    let deployments = pool_of(&config, &quota, &key, adapters);
    if let Some(c) = consumers.iter().find(|c| !deployments.iter().any(|d| d.class == c.class)) {
        return Err(StartError::Other(anyhow::anyhow!(
            "tenant `{}`'s {} reviews use model class `{}`, which no deployment of region `{}` serves",
            c.tenant,
            c.lane.as_str(),
            c.class,
            config.region
        )));
    }
    let loops = pool_loops(&deployments, &consumers, |d| call_cost(&config, d.output_reserve));
    for (l, _, _) in loops.iter().filter(|(l, _, _)| l.lane == Lane::Interactive) {
        metrics.known_scope(&l.scope);
    }
    let client = conn.client.clone();
    let sweeps = reviewlane_shared::sweeps::Sweeps::new(conn.layout.js.clone(), conn.layout.sweeps.clone());
    let region_class = config.quota.model_class.clone();
    // The tenants' batch classes. Each class's sweeps go to its batch path; the region's
    // class also takes those of a class that has lost its path (it took every sweep
    // before). A path no tenant's class uses is not run, but the region's.
    let batch_class: HashMap<String, String> = config
        .tenants
        .iter()
        .filter(|t| t.region == config.region)
        .map(|t| {
            let class = t.class_for(Lane::Batch, ReviewDepth::Full).unwrap_or(&region_class);
            (t.id.clone(), class.to_string())
        })
        .collect();
    let mut paths = batch_paths(&config, &deployments)?;
    paths.retain(|(d, _)| d.class == region_class || batch_class.values().any(|c| *c == d.class));
    let batch_class = Arc::new(batch_class);
    let why_not = (!paths.iter().any(|(d, _)| d.class == region_class))
        .then(|| crate::sweep::why_no_batches(&config.provider, config.region, &config.batch))
        .flatten();
    if let Some(why) = &why_not {
        tracing::info!(region = %config.region, "sweeps of the region's class run on the lanes: {why}");
    }
    let classes: Vec<String> = paths.iter().map(|(d, _)| d.class.clone()).collect();
    let capability = reviewlane_shared::sweeps::BatchCapability {
        provider: provider.name().to_string(),
        available: !paths.is_empty(),
        why_not: why_not.clone(),
        classes: classes.clone(),
        region_class: Some(region_class.clone()),
    };
    sweeps.announce(&capability).await.map_err(|e| StartError::Other(anyhow::anyhow!(e)))?;
    let coordinators: Vec<crate::sweep::Coordinator> = paths
        .into_iter()
        .map(|(d, client)| {
            let (batch_class, classes, region) = (batch_class.clone(), classes.clone(), region_class.clone());
            let ours = d.class.clone();
            let serves = move |tenant: &str| match batch_class.get(tenant) {
                Some(c) if classes.contains(c) => *c == ours,
                _ => ours == region,
            };
            crate::sweep::Coordinator {
                region: config.region,
                sweeps: sweeps.clone(),
                jobs: JobStore::new(conn.layout.jobs.clone(), conn.client.clone()).with_clock(clock.clone()),
                results: Results::new(
                    conn.layout.clone(),
                    config.results.inline_max.unwrap_or_else(|| message_max(&conn.client, &conn.layout)),
                ),
                index: reviewlane_shared::job_index::JobIndex::new(conn.layout.js.clone(), config.region),
                dead_letters: reviewlane_shared::dead_letters::DeadLetters::new(conn.layout.js.clone(), config.region),
                client,
                settings: config.batch,
                clock: clock.clone(),
                owner: format!("replica-{:016x}", rand::random::<u64>()),
                lead_ttl: LEAD_TTL,
                price: d.price,
                served_by: reviewlane_core::job::ServedBy { deployment: d.id.clone(), model_class: d.class.clone() },
                budgets: config.retry.budgets,
                quarantine_raw_max: config.results.quarantine_raw_max,
                tokens_of: item_tokens(&config),
                too_large: over_one_call(&config),
                js: conn.layout.js.clone(),
                faults: config.faults.clone(),
                metrics: metrics.clone(),
                quota: d.quota.clone(),
                interactive: None,
                lead_key: reviewlane_shared::sweeps::lead_key((d.class != region_class).then_some(d.class.as_str())),
                serves: Arc::new(serves),
            }
        })
        .collect();
    let worker = Arc::new(Worker {
        region: config.region,
        stores: stores_of(&config, conn, &clock),
        policy: policy_of(&config),
        metrics,
        health,
        clock,
        faults: config.faults.clone(),
        split_cache: Default::default(),
        abort: CancellationToken::new(),
    });
    Ok(App { admin, registry: Arc::new(registry), client, worker, loops, deployments, quota, coordinators, config })
}

/// How long the coordinator's lead lasts unrenewed: another replica takes over this
/// long after the leader dies.
const LEAD_TTL: Duration = Duration::from_secs(10);

/// The Anthropic Messages adapter of `provider`, if it is one.
fn anthropic_adapter(
    config: &ExtractorConfig,
    provider: &ProviderConfig,
) -> Option<crate::provider::anthropic::AnthropicProvider> {
    let ProviderConfig::Anthropic { base_url, model, api_key, endpoint_region, max_tokens } = provider else {
        return None;
    };
    Some(crate::provider::anthropic::AnthropicProvider::new(
        crate::provider::anthropic::AnthropicEndpoint {
            base_url: base_url.clone(),
            model: model.clone(),
            api_key: api_key.clone(),
            region: *endpoint_region,
            max_tokens: *max_tokens,
        },
        config.scheduling.provider_timeout,
        config.quota.hint_ceiling,
        config.results.max_response_bytes,
    ))
}

/// Each class's batch path: the first of its deployments in rank order (then as
/// configured) whose provider has a batch API this region may use, with that API. A
/// batch endpoint of another region refuses the start.
#[allow(clippy::type_complexity)]
fn batch_paths(
    config: &ExtractorConfig,
    deployments: &[Arc<Deployment>],
) -> Result<Vec<(Arc<Deployment>, Arc<dyn crate::batch::BatchApi>)>, StartError> {
    let providers = std::iter::once(&config.provider).chain(config.pool.iter().map(|d| &d.provider));
    let mut ranked: Vec<_> = deployments.iter().zip(providers).collect();
    ranked.sort_by(|(a, _), (b, _)| a.rank.cmp_order(b.rank));
    let mut paths: Vec<(Arc<Deployment>, Arc<dyn crate::batch::BatchApi>)> = Vec::new();
    for (d, provider) in ranked {
        if paths.iter().any(|(p, _)| p.class == d.class)
            || crate::sweep::why_no_batches(provider, config.region, &config.batch).is_some()
        {
            continue;
        }
        let Some(client) = batch_api_of(config, provider) else { continue };
        if client.region() != config.region {
            return Err(StartError::Other(anyhow::anyhow!(
                "the batch endpoint of deployment `{}` belongs to region `{}` but this extractor serves `{}`",
                d.id,
                client.region(),
                config.region
            )));
        }
        paths.push((d.clone(), client));
    }
    // The region's class first: its coordinator is the one earlier extractors ran.
    paths.sort_by_key(|(d, _)| d.class != config.quota.model_class);
    Ok(paths)
}

/// The batch API of `provider`, if it has one.
fn batch_api_of(config: &ExtractorConfig, provider: &ProviderConfig) -> Option<Arc<dyn crate::batch::BatchApi>> {
    use crate::batch::{anthropic::AnthropicBatches, openai::OpenAiBatches};
    let (timeout, ceiling, max_body) =
        (config.scheduling.provider_timeout, config.quota.hint_ceiling, config.results.max_response_bytes);
    match provider {
        ProviderConfig::Builtin => None,
        ProviderConfig::AzureOpenAi(d) => {
            d.batch_deployment.as_ref()?;
            let adapter = Arc::new(OpenAiProvider::azure(d, timeout, ceiling, max_body));
            Some(Arc::new(OpenAiBatches::azure(d, (timeout, ceiling), adapter)))
        }
        ProviderConfig::OpenAi { base_url, model, api_key, endpoint_region, schema_dialect } => {
            let adapter = OpenAiProvider::new(
                base_url,
                model.clone(),
                api_key.clone(),
                *endpoint_region,
                timeout,
                ceiling,
                max_body,
            )
            .with_schema_dialect(*schema_dialect);
            let api =
                OpenAiBatches::new(base_url, api_key.clone(), *endpoint_region, (timeout, ceiling), Arc::new(adapter));
            Some(Arc::new(api))
        }
        ProviderConfig::Anthropic { base_url, api_key, endpoint_region, .. } => {
            let adapter = Arc::new(anthropic_adapter(config, provider)?);
            Some(Arc::new(AnthropicBatches::new(
                base_url,
                api_key.clone(),
                *endpoint_region,
                (timeout, ceiling),
                adapter,
            )))
        }
    }
}

/// The tokens an item of a provider batch is metered for against the enqueued-token
/// budget: its prompt's, the call's overhead and its output limit.
fn item_tokens(
    config: &ExtractorConfig,
) -> Arc<dyn Fn(&reviewlane_core::messages::ReviewMessage) -> u64 + Send + Sync> {
    let tokenizer = config.parts.plan.tokenizer;
    let reviewlane_core::meter::Cost { input: fixed, output } = call_overhead(config);
    Arc::new(move |review| {
        let Ok(diff) = review.parse_diff() else { return fixed + output };
        let prompt = crate::provider::prompt_diff(review, &diff);
        fixed + output + crate::tokenizer::counter(tokenizer).tokens(&prompt) as u64
    })
}

/// Whether a review would be split into parts on the lanes (`parts::split` under the
/// configured plan gives more than one).
fn over_one_call(
    config: &ExtractorConfig,
) -> Arc<dyn Fn(&reviewlane_core::messages::ReviewMessage) -> bool + Send + Sync> {
    let plan = config.parts.plan;
    Arc::new(move |review| {
        let Ok(diff) = review.parse_diff() else { return false };
        let counter = crate::tokenizer::counter(plan.tokenizer);
        reviewlane_core::parts::split(&diff, &plan.limits, counter.as_ref()).len() > 1
    })
}

/// The adapter of `provider` (the config's, or a deployment of its pool).
fn provider_of(config: &ExtractorConfig, provider: &ProviderConfig) -> Arc<dyn Provider> {
    let (timeout, ceiling, max_body) =
        (config.scheduling.provider_timeout, config.quota.hint_ceiling, config.results.max_response_bytes);
    match provider {
        ProviderConfig::Builtin => Arc::new(BuiltinAnalyzer::new(config.region)),
        ProviderConfig::OpenAi { base_url, model, api_key, endpoint_region, schema_dialect } => Arc::new(
            OpenAiProvider::new(base_url, model.clone(), api_key.clone(), *endpoint_region, timeout, ceiling, max_body)
                .with_schema_dialect(*schema_dialect),
        ),
        ProviderConfig::Anthropic { .. } => {
            Arc::new(anthropic_adapter(config, provider).expect("an Anthropic provider"))
        }
        ProviderConfig::AzureOpenAi(d) => Arc::new(OpenAiProvider::azure(d, timeout, ceiling, max_body)),
    }
}

/// A lane's durable consumer for one tenant, the model class of its reviews, and the
/// tenant's weight.
struct LaneConsumer {
    lane: Lane,
    tenant: String,
    class: String,
    consumer: async_nats::jetstream::consumer::PullConsumer,
    weight: u32,
}

/// One durable consumer per (lane, tenant of this region), with its tenant's weight;
/// and the first deployment's provider key, with the tenants' limits and weights.
async fn lane_consumers(
    config: &ExtractorConfig,
    conn: &reviewlane_shared::startup::RegionConnection,
    provider: &str,
) -> Result<(Vec<LaneConsumer>, KeyConfig), StartError> {
    let mut loops = Vec::new();
    let mut limits = HashMap::new();
    let mut weights = HashMap::new();
    // Each lane stream's consumers, listed once: a depth consumer no longer asked for is
    // removed only where it exists.
    let mut existing = HashMap::new();
    for lane in Lane::ALL {
        existing.insert(lane, consumer_names(&conn.layout.js, &layout::lane_stream(config.region, lane)).await?);
    }
    for tenant in config.tenants.iter().filter(|t| t.region == config.region) {
        if let Some(l) = tenant.scope_limit {
            limits.insert(tenant.id.clone(), l);
        }
        weights.insert(tenant.id.clone(), tenant.weight);
        for lane in Lane::ALL {
            let stream = layout::lane_stream(config.region, lane);
            for (name, filter, depth) in lane_consumer_plan(config.region, lane, tenant) {
                if filter.is_none() {
                    if existing[&lane].contains(&name) {
                        drop_consumer(&conn.layout.js, &stream, &name).await?;
                    }
                    continue;
                }
                let consumer =
                    durable_consumer(&conn.layout.js, &stream, &name, filter, config.scheduling.lease).await?;
                let class = tenant.class_for(lane, depth).unwrap_or(&config.quota.model_class).to_string();
                loops.push(LaneConsumer { lane, tenant: tenant.id.clone(), class, consumer, weight: tenant.weight });
            }
        }
    }
    if loops.is_empty() {
        tracing::warn!(region = %config.region, "no tenant of this region in the tenants file: nothing to serve");
    }
    let key = KeyConfig {
        key: KeyConfig::token(provider, &config.quota.key_id),
        limit: config.quota.key_limit,
        tenant_limits: limits,
        weights,
    };
    Ok((loops, key))
}

/// A (lane, tenant)'s consumers in the order they are put in place, each with its filter
/// and the depth its class is taken at: one for all its reviews; or, for a tenant whose
/// reviews at `changed_hunks` have a class of their own, one for its full-depth reviews
/// and one for the others. A filter of `None` is a consumer that must not exist (it is
/// removed before the consumer that takes its reviews widens its filter: filters on a
/// work-queue stream may not overlap).
fn lane_consumer_plan(
    region: reviewlane_core::region::Region,
    lane: Lane,
    tenant: &reviewlane_core::tenants::Tenant,
) -> [(String, Option<String>, ReviewDepth); 2] {
    let (main, by_depth) = (consumer_name(lane, &tenant.id), layout::lane_depth_consumer(lane, &tenant.id));
    if tenant.splits_depth() {
        [
            (main, Some(layout::lane_depth_filter(region, lane, &tenant.id, ReviewDepth::Full)), ReviewDepth::Full),
            (
                by_depth,
                Some(layout::lane_depth_filter(region, lane, &tenant.id, ReviewDepth::ChangedHunks)),
                ReviewDepth::ChangedHunks,
            ),
        ]
    } else {
        [
            (by_depth, None, ReviewDepth::ChangedHunks),
            (main, Some(layout::lane_filter(region, lane, &tenant.id)), ReviewDepth::Full),
        ]
    }
}

/// The names of a stream's consumers.
async fn consumer_names(
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> Result<std::collections::HashSet<String>, StartError> {
    use futures::TryStreamExt;
    let stream = js.get_stream_no_info(stream).await.map_err(|e| StartError::Other(e.into()))?;
    stream.consumer_names().try_collect().await.map_err(|e| StartError::Other(e.into()))
}

/// Removes a durable consumer if it exists; its unacknowledged reviews stay on the
/// work-queue stream for the consumer whose filter takes them.
async fn drop_consumer(js: &async_nats::jetstream::Context, stream: &str, name: &str) -> Result<(), StartError> {
    let stream = js.get_stream_no_info(stream).await.map_err(|e| StartError::Other(e.into()))?;
    match stream.delete_consumer(name).await {
        Ok(_) => {
            tracing::info!(
                consumer = name,
                "a depth's own lane consumer removed: its tenant no longer names its class"
            );
            Ok(())
        }
        Err(e)
            if matches!(e.kind(), async_nats::jetstream::stream::ConsumerErrorKind::JetStream(j)
                if j.error_code() == async_nats::jetstream::ErrorCode::CONSUMER_NOT_FOUND) =>
        {
            Ok(())
        }
        Err(e) => Err(StartError::Other(e.into())),
    }
}

/// The pool: the first deployment (`provider`, on `quota`), then the file's, each on
/// its own key with the tenants' limits and weights, sharing the replica id.
fn pool_of(
    config: &ExtractorConfig,
    quota: &Quota,
    key: &KeyConfig,
    adapters: Vec<Arc<dyn Provider>>,
) -> Vec<Arc<Deployment>> {
    let prices = &config.results.prices;
    let mut adapters = adapters.into_iter();
    let first = adapters.next().expect("the first deployment's adapter");
    let mut pool = vec![Arc::new(Deployment {
        id: first.name().to_string(),
        class: config.quota.model_class.clone(),
        kind: config.provider.kind(),
        model: config.provider.model().to_string(),
        output_reserve: config.provider.output_reserve(),
        provider: first,
        quota: quota.clone(),
        price: prices.get(&config.quota.model_class).copied(),
        rank: crate::pool::Rank::of(0, prices.get(&config.quota.model_class).copied()),
    })];
    for (d, provider) in config.pool.iter().zip(adapters) {
        let key = KeyConfig { key: KeyConfig::token(d.provider.kind(), &d.id), limit: d.key_limit, ..key.clone() };
        pool.push(Arc::new(Deployment {
            id: d.id.clone(),
            class: d.class.clone(),
            kind: d.provider.kind(),
            model: d.provider.model().to_string(),
            output_reserve: d.provider.output_reserve(),
            provider,
            quota: quota
                .another_key(key, config.quota.probe_every)
                .with_budgets(d.budgets.clone())
                .enforced_over(d.provider.enforced_windows()),
            price: d.price.or_else(|| prices.get(d.provider.model()).copied()),
            rank: crate::pool::Rank::of(d.preference, d.price.or_else(|| prices.get(d.provider.model()).copied())),
        }));
    }
    pool
}

/// The other deployments of `d`'s class, as `d` sees them.
fn others_of(deployments: &[Arc<Deployment>], d: &Deployment) -> Others {
    let others = deployments.iter().filter(|o| o.class == d.class && o.id != d.id);
    Others::new(d.rank, others.map(|o| (o.quota.clone(), o.rank)).collect())
}

/// The other deployments of `d`'s class in rank order (then as configured), each with
/// `tenant`'s scope on it and the others of the class as it sees them: where `d`'s
/// split reviews may also run their parts.
fn siblings(deployments: &[Arc<Deployment>], d: &Deployment, tenant: &str) -> Vec<crate::pool::Callee> {
    let mut siblings: Vec<_> = deployments
        .iter()
        .filter(|o| o.class == d.class && o.id != d.id)
        .map(|o| crate::pool::Callee {
            deployment: o.clone(),
            others: others_of(deployments, o),
            scope: o.scope(tenant),
        })
        .collect();
    siblings.sort_by(|a, b| a.deployment.rank.cmp_order(b.deployment.rank));
    siblings
}

/// Each deployment's loops on the lane consumers of its class, each knowing the other
/// deployments of that class.
fn pool_loops(
    deployments: &[Arc<Deployment>],
    consumers: &[LaneConsumer],
    cost_on: impl Fn(&Deployment) -> crate::schedule::CallCost,
) -> Vec<(LaneLoop, u32, Arc<Deployment>)> {
    let mut loops = Vec::new();
    for d in deployments {
        let cost = cost_on(d);
        for c in consumers.iter().filter(|c| c.class == d.class) {
            let l = LaneLoop {
                lane: c.lane,
                scope: d.scope(&c.tenant),
                others: others_of(deployments, d),
                consumer: c.consumer.clone(),
                cost: cost.clone(),
                siblings: Arc::new(siblings(deployments, d, &c.tenant)),
            };
            loops.push((l, c.weight, d.clone()));
        }
    }
    loops
}

/// The tokens every call sends besides its diff: the instructions and schema.
fn fixed_tokens(config: &ExtractorConfig) -> u64 {
    crate::tokenizer::counter(config.parts.plan.tokenizer).tokens(&crate::provider::fixed_prompt()) as u64
}

/// What every call of the first deployment is metered for besides its diff: the
/// instructions and schema it sends, and the output limit the provider counts when the
/// call starts.
fn call_overhead(config: &ExtractorConfig) -> reviewlane_core::meter::Cost {
    reviewlane_core::meter::Cost { input: fixed_tokens(config), output: u64::from(config.provider.output_reserve()) }
}

/// What a review message's first call on a deployment whose calls ask for at most
/// `output` tokens is metered for: its input — the prompt's tokens (one part's at most:
/// a split review reserves each other part as it starts it) and the call's overhead —
/// and that output limit, which the provider counts when the call starts.
fn call_cost(config: &ExtractorConfig, output: u32) -> crate::schedule::CallCost {
    use reviewlane_core::meter::Cost;
    let plan = config.parts.plan;
    let (fixed, output) = (fixed_tokens(config), u64::from(output));
    Arc::new(move |decoded: Option<&crate::schedule::Decoded>| {
        let at_most = Cost { input: fixed + plan.limits.budget() as u64, output };
        let Some(crate::schedule::Decoded { review, diff: Some(diff) }) = decoded else { return at_most };
        let prompt = crate::provider::prompt_diff(review, diff);
        if prompt.len() > plan.limits.budget() || prompt.len() >= 4 * 1024 * 1024 {
            return at_most;
        }
        let tokens = crate::tokenizer::counter(plan.tokenizer).tokens(&prompt).min(plan.limits.budget());
        Cost { input: fixed + tokens as u64, output }
    })
}

/// The region's stores the worker writes to.
fn stores_of(
    config: &ExtractorConfig,
    conn: reviewlane_shared::startup::RegionConnection,
    clock: &reviewlane_core::clock::SharedClock,
) -> crate::worker::Stores {
    let inline_max = config.results.inline_max.unwrap_or_else(|| message_max(&conn.client, &conn.layout));
    crate::worker::Stores {
        cache: config
            .results
            .cache
            .then(|| reviewlane_shared::result_cache::ResultCache::new(conn.layout.cache.clone())),
        jobs: JobStore::new(conn.layout.jobs.clone(), conn.client.clone()).with_clock(clock.clone()),
        results: Results::new(conn.layout.clone(), inline_max),
        layout: conn.layout,
    }
}

/// How the worker paces and bounds its work.
fn policy_of(config: &ExtractorConfig) -> crate::worker::WorkPolicy {
    crate::worker::WorkPolicy {
        budgets: config.retry.budgets,
        backoff: [config.retry.backoff, config.retry.batch_backoff],
        lease: config.scheduling.lease,
        provider_timeout: config.scheduling.provider_timeout,
        circuit_open_for: config.quota.circuit_open_for,
        store_retry: config.retry.store,
        quarantine_raw_max: config.results.quarantine_raw_max,
        parts: config.parts,
        call_overhead: fixed_tokens(config),
    }
}

impl App {
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub fn admin_addr(&self) -> std::net::SocketAddr {
        self.admin.local_addr()
    }

    /// Serves until `shutdown` resolves; then stops pulling, gives calls in flight the
    /// grace period, hands back what is left without delay, and drains NATS.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let stop = CancellationToken::new();
        // The worker's own: its steps that wait (a keep retried against a full store)
        // give up when the grace is over.
        let abort = self.worker.abort.clone();
        for d in &self.deployments {
            d.quota.start(stop.clone()).await.map_err(|e| anyhow::anyhow!(e))?;
        }
        let mut streams: Vec<String> = Lane::ALL.iter().map(|l| layout::lane_stream(self.config.region, *l)).collect();
        streams.push(layout::findings_stream(self.config.region));
        streams.push(format!("KV_{}", layout::jobs_bucket(self.config.region)));
        let nats = reviewlane_shared::admin::nats_ready(self.client.clone(), streams);
        // Ready once NATS is and the replica has warmed up (the others have seen it),
        // while the store takes writes.
        let quotas: Vec<Quota> = self.deployments.iter().map(|d| d.quota.clone()).collect();
        let health = self.worker.health.clone();
        let ready: reviewlane_shared::admin::Ready = std::sync::Arc::new(move || {
            let (nats, quotas, health) = (nats.clone(), quotas.clone(), health.clone());
            Box::pin(async move { quotas.iter().all(Quota::warmed_up) && health.ready() && nats().await })
        });
        let admin = tokio::spawn(self.admin.run(self.registry.clone(), ready, stop.clone()));
        let changed: Arc<Notify> = self.quota.changed.clone();
        let reserve =
            self.config.scheduling.interactive_reserve_slots.unwrap_or(self.config.scheduling.concurrency / 8);
        let slots =
            Slots::new(self.config.scheduling.concurrency, self.config.scheduling.batch_min_slots, reserve, changed);
        let backlog = Backlog::default();
        let tasks = TaskTracker::new();
        // One per (interactive lane, tenant), whichever deployments serve it.
        let mut seen = std::collections::HashSet::new();
        let interactive: Vec<_> = self
            .loops
            .iter()
            .filter(|(l, _, _)| l.lane == Lane::Interactive && seen.insert(l.scope.tenant.clone()))
            .map(|(l, _, _)| l.consumer.clone())
            .collect();
        let monitor = tokio::spawn(watch_interactive_backlog(
            interactive,
            backlog.clone(),
            self.config.scheduling.interactive_wait_limit,
            stop.clone(),
        ));
        let reconciler = crate::reconcile::Reconciler {
            layout: self.worker.stores.layout.clone(),
            jobs: self.worker.stores.jobs.clone(),
            results: self.worker.stores.results.clone(),
            clock: self.worker.clock.clone(),
            grace: self.config.results.reconcile.grace,
            metrics: self.worker.metrics.clone(),
        };
        let reconciling = tokio::spawn(
            reconciler
                .run(self.config.results.reconcile.every, stop.clone())
                .instrument(tracing::info_span!("reconcile", region = %self.config.region)),
        );
        let coordinating: Vec<_> = self
            .coordinators
            .into_iter()
            .map(|c| {
                let span =
                    tracing::info_span!("sweeps", region = %self.config.region, deployment = %c.served_by.deployment);
                let c = crate::sweep::Coordinator { interactive: Some(slots.clone()), ..c };
                tokio::spawn(c.run(stop.clone()).instrument(span))
            })
            .collect();
        let scopes = self
            .loops
            .iter()
            .filter(|(l, _, _)| l.lane == Lane::Interactive)
            .map(|(l, _, d)| (d.quota.clone(), l.scope.clone()))
            .collect();
        let lanes = tokio::spawn(sample(
            async_nats::jetstream::new(self.client.clone()),
            self.config.region,
            self.worker.metrics.clone(),
            (scopes, self.deployments.clone()),
            stop.clone(),
        ));
        let mut handles = Vec::new();
        for (l, weight, deployment) in self.loops {
            let span = tracing::info_span!("lane", region = %self.config.region, lane = l.lane.as_str(), tenant = %l.scope.tenant, deployment = %deployment.id);
            let shared = Arc::new(l);
            for _ in 0..weight {
                let l = LaneLoop {
                    lane: shared.lane,
                    scope: shared.scope.clone(),
                    others: shared.others.clone(),
                    consumer: shared.consumer.clone(),
                    cost: shared.cost.clone(),
                    siblings: shared.siblings.clone(),
                };
                let puller = reviewlane_shared::pull::Puller::new(shared.consumer.clone(), self.client.clone()).await?;
                let worker = self.worker.clone();
                let abort = abort.clone();
                let (d, others) = (deployment.clone(), shared.others.clone());
                let run = move |admitted| {
                    let (worker, abort, d, others) = (worker.clone(), abort.clone(), d.clone(), others.clone());
                    async move {
                        worker.process_one(admitted, &d, &others, &abort).await;
                    }
                    .in_current_span()
                };
                handles.push(tokio::spawn(
                    serve(
                        l,
                        puller,
                        slots.clone(),
                        deployment.quota.clone(),
                        backlog.clone(),
                        self.config.scheduling.lease,
                        tasks.clone(),
                        stop.clone(),
                        run,
                    )
                    .instrument(span.clone()),
                ));
            }
        }
        tracing::info!(region = %self.config.region, concurrency = self.config.scheduling.concurrency, "extractor running");
        shutdown.await;
        tracing::info!("shutting down: no new pulls");
        stop.cancel();
        for h in handles {
            let _ = h.await;
        }
        let _ = monitor.await;
        let _ = lanes.await;
        let _ = reconciling.await;
        for c in coordinating {
            let _ = c.await;
        }
        let _ = admin.await;
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

/// Every second: queue age and depth of the region's lanes, from stream metadata (the
/// oldest message of a work-queue stream is the oldest review not yet done), each
/// quota scope's calls in flight against this replica's current limit, and each
/// deployment's state.
async fn sample(
    js: async_nats::jetstream::Context,
    region: reviewlane_shared::Region,
    metrics: crate::metrics::Metrics,
    (scopes, deployments): (Vec<(Quota, Scope)>, Vec<Arc<Deployment>>),
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut ticks = 0u64;
    loop {
        tokio::select! { _ = tick.tick() => {}, _ = stop.cancelled() => return }
        for (quota, scope) in &scopes {
            metrics.scope(scope, quota.in_flight(scope), quota.fair_share(scope));
        }
        for d in &deployments {
            metrics.deployment(&d.id, &d.class, d.state());
        }
        // What operators see of the pool (`ListDeployments`), every 5 s.
        if ticks.is_multiple_of(5)
            && let Ok(kv) = js.get_key_value(layout::quota_bucket(region)).await
        {
            for d in &deployments {
                if let Err(e) = reviewlane_shared::pool_status::put(&kv, &d.status().await).await {
                    tracing::debug!(kind = e.kind(), "writing a deployment's status failed");
                }
            }
        }
        // The account's storage against its limit, every 10 s (when it has one).
        if ticks.is_multiple_of(10)
            && let Ok(account) = js.query_account().await
            && let Some(limit) = account.limits.max_storage.filter(|l| *l > 0)
        {
            metrics.store_used("account", used_ratio(account.storage, limit as u64));
        }
        ticks += 1;
        for lane in Lane::ALL {
            let Ok(mut stream) = js.get_stream(layout::lane_stream(region, lane)).await else { continue };
            let Ok(info) = stream.info().await else { continue };
            let state = &info.state;
            let age = if state.messages == 0 {
                0.0
            } else {
                let oldest = state.first_timestamp.unix_timestamp_nanos() as f64 / 1e9;
                let now = reviewlane_shared::telemetry::now_ms() as f64 / 1000.0;
                (now - oldest).max(0.0)
            };
            metrics.lane(lane, age, state.messages as i64);
            let bound = |used: u64, max: i64| if max > 0 { used_ratio(used, max as u64) } else { 0.0 };
            let used = bound(state.bytes, info.config.max_bytes).max(bound(state.messages, info.config.max_messages));
            metrics.store_used(&layout::lane_stream(region, lane), used);
        }
    }
}

/// `used` of `limit`, 0..1.
fn used_ratio(used: u64, limit: u64) -> f64 {
    if limit == 0 { 0.0 } else { (used as f64 / limit as f64).min(1.0) }
}

/// Marks the interactive lane backlogged once reviews have been waiting undelivered
/// (consumer metadata only) for longer than `limit`.
async fn watch_interactive_backlog(
    consumers: Vec<async_nats::jetstream::consumer::PullConsumer>,
    backlog: Backlog,
    limit: Duration,
    stop: CancellationToken,
) {
    let mut waiting_since: Option<Instant> = None;
    // One consumer-info request per interactive tenant a tick: a second is fine grain
    // against a threshold of seconds.
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! { _ = tick.tick() => {}, _ = stop.cancelled() => return }
        let mut pending = 0u64;
        for c in &consumers {
            let mut c = c.clone();
            if let Ok(info) = c.info().await {
                pending += info.num_pending;
            }
        }
        waiting_since = if pending > 0 { waiting_since.or(Some(Instant::now())) } else { None };
        backlog.set(waiting_since.is_some_and(|t| t.elapsed() > limit));
    }
}
