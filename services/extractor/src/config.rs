//! Extractor configuration, read once and validated whole, in sections: the provider,
//! the quota, scheduling, retries, parts and results. The variables are listed in
//! `env.rs` and documented in `docs/configuration.md` ("Extractor").

use std::time::Duration;

use reviewlane_shared::Region;
use std::sync::Arc;

use crate::env;
use reviewlane_core::config::{ConfigErrors, Env, Reader};
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_core::tenants::Tenants;
use reviewlane_shared::store::StoreRetry;
use secrecy::SecretString;

use crate::upstream::Backoff;

#[derive(Debug, Clone)]
pub enum ProviderConfig {
    Builtin,
    OpenAi {
        base_url: String,
        model: String,
        api_key: Option<SecretString>,
        endpoint_region: Region,
        schema_dialect: SchemaDialect,
    },
    /// Anthropic's Messages API.
    Anthropic {
        base_url: String,
        model: String,
        api_key: Option<SecretString>,
        endpoint_region: Region,
        max_tokens: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    pub congestion: u32,
    pub transient: u32,
    pub schema: u32,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets { congestion: 5, transient: 3, schema: 2 }
    }
}

impl Budgets {
    /// Retries a job may spend on `budget`.
    pub fn of(&self, budget: reviewlane_core::job::Budget) -> u32 {
        use reviewlane_core::job::Budget;
        match budget {
            Budget::Congestion => self.congestion,
            Budget::Transient => self.transient,
            Budget::Schema => self.schema,
        }
    }
}

/// A provider key from `file` (naming a mounted Secret) or `var`.
fn api_key(r: &mut Reader<'_>, file: &str, var: &str) -> Option<SecretString> {
    match r.raw(file) {
        Some(path) => match std::fs::read_to_string(&path) {
            Ok(k) => Some(SecretString::from(k.trim().to_string())),
            Err(_) => {
                r.error(format!("{file} names a file that cannot be read"));
                None
            }
        },
        None => r.raw(var).map(SecretString::from),
    }
}

/// A model's price in US dollars per million tokens, input and output.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
}

impl Price {
    /// The estimated cost of `t` in millionths of a dollar.
    pub fn cost_micro_usd(&self, t: reviewlane_core::job::Tokens) -> u64 {
        (t.input as f64 * self.input_per_mtok + t.output as f64 * self.output_per_mtok).round() as u64
    }
}

/// `model=in/out,model=in/out` (dollars per million tokens) -> prices by model.
pub fn parse_prices(table: &str) -> Result<std::collections::HashMap<String, Price>, String> {
    table
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|entry| {
            let (model, prices) = entry.split_once('=').ok_or("an entry is not `model=in/out`")?;
            let (i, o) = prices.split_once('/').ok_or("a price is not `in/out`")?;
            let num = |v: &str| v.trim().parse::<f64>().ok().filter(|p| p.is_finite() && *p >= 0.0);
            match (num(i), num(o)) {
                (Some(input_per_mtok), Some(output_per_mtok)) => {
                    Ok((model.trim().to_string(), Price { input_per_mtok, output_per_mtok }))
                }
                _ => Err("a price is not a non-negative number"),
            }
        })
        .collect::<Result<_, _>>()
        .map_err(str::to_string)
}

/// When the reconciler runs and whom it considers stranded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcileConfig {
    pub every: Duration,
    pub grace: Duration,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        ReconcileConfig { every: Duration::from_secs(30), grace: Duration::from_secs(120) }
    }
}

/// The extractor's whole configuration: what every service has (region, NATS,
/// tenants, admin, telemetry, drain), then one section per concern, each read by its
/// own function.
#[derive(Debug, Clone)]
pub struct ExtractorConfig {
    pub region: Region,
    /// Admin HTTP port: `/metrics`, `/healthz`.
    pub admin_addr: std::net::SocketAddr,
    pub nats_url: String,
    /// Credentials and TLS for the region's NATS (`REVIEWLANE_NATS_*`).
    pub nats: reviewlane_shared::nats_client::NatsClientConfig,
    /// Tenants: this region's get a consumer per lane, with their weight and scope limit.
    pub tenants: Arc<Tenants>,
    pub telemetry: reviewlane_shared::telemetry::TelemetryConfig,
    pub shutdown_grace: Duration,
    /// Each lane's service window, exported as `reviewlane_lane_slo_seconds`.
    pub lane_windows: [Duration; 2],
    /// Fault hooks for tests (no-ops unless built with `fault-hooks`).
    pub faults: reviewlane_shared::faults::Faults,
    /// The provider endpoint this extractor calls.
    pub provider: ProviderConfig,
    pub quota: QuotaSettings,
    pub scheduling: SchedulingSettings,
    pub retry: RetrySettings,
    /// Splitting reviews larger than the model's context into parts.
    pub parts: PartConfig,
    pub results: ResultSettings,
    /// Sweeps through the provider's batch API (`REVIEWLANE_PROVIDER_BATCH`).
    pub batch: BatchSettings,
    /// Variables set in the environment that this service no longer reads, with where
    /// they went (logged at start).
    pub notices: Vec<String>,
}

/// The provider key's shared quota: its scope, its fleet window and its pauses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaSettings {
    /// Model class of the quota scope (provider, model class, tenant, region).
    pub model_class: String,
    /// Calls in flight on the provider key (account) across the fleet: the ceiling of
    /// its shared congestion window.
    pub key_limit: u32,
    /// Names the provider key (account) this deployment calls with; deployments that
    /// share a key share its window and pause. Not the key itself.
    pub key_id: String,
    /// Replica heartbeat period in `QUOTA_<R>`.
    pub heartbeat: Duration,
    /// How long a scope's window holds before it probes one call higher.
    pub probe_every: Duration,
    /// How long an `insufficient_quota` answer keeps a scope's circuit open.
    pub circuit_open_for: Duration,
    /// Longest provider retry hint honoured; longer ones are cut to this and counted.
    pub hint_ceiling: Duration,
    /// The key's configured limits per metered dimension (requests, tokens, input and
    /// output tokens per minute, tokens per day); the others are learned from the
    /// answers' headers.
    pub budgets: Vec<(reviewlane_core::meter::Dimension, u64)>,
}

/// How this process takes work: its call slots, its lease, and the lanes' shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulingSettings {
    /// Provider calls in flight in this process.
    pub concurrency: usize,
    /// The consumer's ack wait; extended by progress acks during a call.
    pub lease: Duration,
    /// One provider call.
    pub provider_timeout: Duration,
    /// Batch stops pulling while interactive work has waited longer than this.
    pub interactive_wait_limit: Duration,
    /// Call slots batch keeps whenever it has work, backlog or not: its aging bound.
    pub batch_min_slots: usize,
    /// Slots batch leaves free for interactive work (`None`: concurrency / 8).
    pub interactive_reserve_slots: Option<usize>,
}

/// What a job may retry, how it backs off, and how a store write after a paid answer
/// is retried.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RetrySettings {
    pub budgets: Budgets,
    /// Backoff without a provider hint, interactive lane.
    pub backoff: Backoff,
    /// Backoff without a provider hint, batch lane.
    pub batch_backoff: Backoff,
    pub store: StoreRetry,
}

/// What is kept of an answer, where, and for how long it is reused.
#[derive(Debug, Clone)]
pub struct ResultSettings {
    /// Reuse validated results of identical reviews (`CACHE_<R>`).
    pub cache: bool,
    /// Results larger than this go to the object store (`None`: the server's limit).
    pub inline_max: Option<usize>,
    /// Raw item kept with a quarantined finding; longer ones are cut.
    pub quarantine_raw_max: usize,
    /// Provider response body read at most; a longer answer is invalid output.
    pub max_response_bytes: usize,
    /// Prices per model class (`REVIEWLANE_MODEL_PRICES`), for the estimated cost of
    /// each job.
    pub prices: std::collections::HashMap<String, Price>,
    /// The reconciler: how often it runs and whom it considers stranded.
    pub reconcile: ReconcileConfig,
}

impl QuotaSettings {
    /// Defaults for a deployment calling `model_class`.
    pub fn for_model(model_class: impl Into<String>) -> Self {
        QuotaSettings {
            model_class: model_class.into(),
            key_limit: 8,
            key_id: "default".into(),
            heartbeat: Duration::from_secs(1),
            probe_every: Duration::from_secs(60),
            circuit_open_for: Duration::from_secs(600),
            hint_ceiling: Duration::from_secs(300),
            budgets: Vec::new(),
        }
    }

    fn read(r: &mut Reader<'_>, model: &str) -> Self {
        let d = QuotaSettings::for_model(model);
        let q = QuotaSettings {
            model_class: r.or(env::MODEL_CLASS, d.model_class.clone(), "a name"),
            key_limit: r.or(env::KEY_LIMIT, d.key_limit, "a count"),
            key_id: r.or(env::KEY_ID, d.key_id.clone(), "a name"),
            heartbeat: Duration::from_millis(r.or(env::HEARTBEAT_MS, 1000, "milliseconds")),
            circuit_open_for: Duration::from_secs(r.or(env::QUOTA_CIRCUIT_SECS, 600, "whole seconds")),
            hint_ceiling: Duration::from_secs(r.or(env::HINT_CEILING_SECS, 300, "whole seconds")),
            budgets: match reviewlane_core::meter::parse_budgets(&r.raw(env::KEY_BUDGETS).unwrap_or_default()) {
                Ok(b) => b,
                Err(e) => {
                    r.error(format!("{}: {e}", env::KEY_BUDGETS));
                    Vec::new()
                }
            },
            ..d
        };
        if q.heartbeat.is_zero() {
            r.error("REVIEWLANE_HEARTBEAT_MS must be positive");
        }
        q
    }
}

impl Default for SchedulingSettings {
    fn default() -> Self {
        SchedulingSettings {
            concurrency: 8,
            lease: Duration::from_secs(30),
            provider_timeout: Duration::from_secs(120),
            interactive_wait_limit: Duration::from_secs(5),
            batch_min_slots: 1,
            interactive_reserve_slots: None,
        }
    }
}

impl SchedulingSettings {
    fn read(r: &mut Reader<'_>) -> Self {
        let d = SchedulingSettings::default();
        let s = SchedulingSettings {
            concurrency: r.or(env::CONCURRENCY, d.concurrency, "a positive count"),
            lease: Duration::from_secs(r.or(env::LEASE_SECS, 30, "whole seconds")),
            provider_timeout: Duration::from_secs(r.or(env::PROVIDER_TIMEOUT_SECS, 120, "whole seconds")),
            interactive_wait_limit: Duration::from_secs(r.or(env::INTERACTIVE_WAIT_LIMIT_SECS, 5, "whole seconds")),
            batch_min_slots: r.or(env::BATCH_MIN_SLOTS, d.batch_min_slots, "a count"),
            interactive_reserve_slots: r
                .raw(env::INTERACTIVE_RESERVE_SLOTS)
                .map(|_| r.or(env::INTERACTIVE_RESERVE_SLOTS, 0, "a count")),
        };
        if s.concurrency == 0 {
            r.error("REVIEWLANE_CONCURRENCY must be positive");
        }
        if s.lease.is_zero() {
            r.error("REVIEWLANE_LEASE_SECS must be positive");
        }
        s
    }
}

impl RetrySettings {
    fn read(r: &mut Reader<'_>) -> Self {
        let d = Budgets::default();
        let budgets = Budgets {
            congestion: r.or(env::BUDGET_CONGESTION, d.congestion, "a count"),
            transient: r.or(env::BUDGET_TRANSIENT, d.transient, "a count"),
            schema: r.or(env::BUDGET_SCHEMA, d.schema, "a count"),
        };
        let backoff = Backoff {
            base: Duration::from_millis(r.or(env::BACKOFF_BASE_MS, 1000, "milliseconds")),
            cap: Duration::from_secs(r.or(env::BACKOFF_CAP_SECS, 60, "whole seconds")),
            ..Backoff::default()
        };
        RetrySettings { budgets, backoff, batch_backoff: backoff, store: StoreRetry::from_reader(r) }
    }
}

impl Default for ResultSettings {
    fn default() -> Self {
        ResultSettings {
            cache: true,
            inline_max: None,
            quarantine_raw_max: 4096,
            max_response_bytes: 4 * 1024 * 1024,
            prices: Default::default(),
            reconcile: ReconcileConfig::default(),
        }
    }
}

impl ResultSettings {
    fn read(r: &mut Reader<'_>) -> Self {
        let cache = match r.raw(env::RESULT_CACHE).as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(_) => {
                r.error("REVIEWLANE_RESULT_CACHE must be `on` or `off`");
                true
            }
        };
        let prices = match r.raw(env::MODEL_PRICES).map(|t| parse_prices(&t)) {
            None => Default::default(),
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                r.error(format!(
                    "REVIEWLANE_MODEL_PRICES: {e} (expected `model=in/out,...`, dollars per million tokens)"
                ));
                Default::default()
            }
        };
        let reconcile = ReconcileConfig {
            grace: Duration::from_secs(r.or(env::RECONCILE_GRACE_SECS, 120, "whole seconds")),
            ..ReconcileConfig::default()
        };
        ResultSettings { cache, prices, reconcile, ..ResultSettings::default() }
    }
}

/// How reviews larger than the model's context are split (see
/// `reviewlane_core::parts`) and merged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartConfig {
    /// Limits and tokenizer of new splits (a split job keeps the plan it started with).
    pub plan: reviewlane_core::parts::Plan,
    pub max_parts: u32,
    pub findings_cap: u32,
}

impl PartConfig {
    /// Defaults for a model: its tokenizer when tiktoken knows it, else the estimate.
    pub fn for_model(model: &str) -> Self {
        PartConfig {
            plan: reviewlane_core::parts::Plan {
                limits: Default::default(),
                tokenizer: crate::tokenizer::for_model(model).unwrap_or_default(),
            },
            max_parts: 64,
            findings_cap: 500,
        }
    }
}

impl ExtractorConfig {
    /// A configuration with defaults, for tests and embedding.
    pub fn new(region: Region, nats_url: impl Into<String>, tenants: Arc<Tenants>, provider: ProviderConfig) -> Self {
        let model = provider.model().to_string();
        ExtractorConfig {
            region,
            admin_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 9465)),
            nats_url: nats_url.into(),
            nats: Default::default(),
            tenants,
            telemetry: Default::default(),
            shutdown_grace: Duration::from_secs(20),
            lane_windows: [Duration::from_secs(60), Duration::from_secs(3600)],
            faults: Default::default(),
            provider,
            quota: QuotaSettings::for_model(model.clone()),
            scheduling: SchedulingSettings::default(),
            retry: RetrySettings::default(),
            parts: PartConfig::for_model(&model),
            results: ResultSettings::default(),
            batch: BatchSettings::default(),
            notices: Vec::new(),
        }
    }

    pub fn from_env(env: &dyn Env) -> Result<Self, ConfigErrors> {
        let mut r = Reader::new(env);
        let region: Option<Region> = r.required(reviewlane_core::env::REGION, "`us` or `eu`");
        let nats_url: Option<String> = reviewlane_shared::nats_client::read_url(&mut r, reviewlane_core::env::NATS_URL);
        let tenants = r.tenants(reviewlane_core::env::TENANTS_FILE);
        let admin_addr =
            r.or(reviewlane_core::env::ADMIN_ADDR, std::net::SocketAddr::from(([127, 0, 0, 1], 9465)), "host:port");
        let grace: u64 = r.or(reviewlane_core::env::SHUTDOWN_GRACE_SECS, 20, "whole seconds");
        let provider = read_provider(&mut r, region);
        let model = provider.as_ref().map_or("builtin", ProviderConfig::model).to_string();
        let quota = QuotaSettings::read(&mut r, &model);
        let scheduling = SchedulingSettings::read(&mut r);
        let retry = RetrySettings::read(&mut r);
        let mut parts = read_parts(&mut r, &provider);
        if provider.is_some()
            && let Err(e) = fit_parts_to_budget(&mut parts, &quota.budgets, p_output(&provider))
        {
            r.error(e);
        }
        let results = ResultSettings::read(&mut r);
        let batch = match BatchSettings::parse(&r.raw(env::PROVIDER_BATCH).unwrap_or_default()) {
            Ok(b) => b,
            Err(e) => {
                r.error(format!("{}: {e}", env::PROVIDER_BATCH));
                BatchSettings::default()
            }
        };
        let lane_windows = r.lane_windows();
        let telemetry = reviewlane_shared::telemetry::TelemetryConfig::read(&mut r);
        let nats = reviewlane_shared::nats_client::NatsClientConfig::from_reader(&mut r, &[reviewlane_core::env::NATS]);
        let notices = r.retired_notices(env::RETIRED);
        r.finish()?;
        Ok(ExtractorConfig {
            region: region.expect("checked"),
            admin_addr,
            nats_url: nats_url.expect("checked"),
            nats,
            tenants: Arc::new(tenants.expect("checked")),
            telemetry,
            shutdown_grace: Duration::from_secs(grace),
            lane_windows,
            faults: Default::default(),
            provider: provider.expect("checked"),
            quota,
            scheduling,
            retry,
            parts,
            results,
            batch,
            notices,
        })
    }
}

/// How sweeps run through the provider's own batch API: one setting,
/// `REVIEWLANE_PROVIDER_BATCH` = `off`, or comma-separated `poll=<first>..<cap>`,
/// `requests=<n>`, `mb=<n>`, `resubmit=<n>`, `enqueued_tokens=<n>`, `price=<percent>`
/// (durations as `500ms`, `30s`, `5m`). Unset: on, with the defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    pub enabled: bool,
    pub poll: reviewlane_core::batch::PollBackoff,
    /// Requests per provider batch at most (below the provider's own limit): a batch's
    /// item ids are one KV entry.
    pub max_requests: usize,
    /// Bytes of a batch's requests at most (below the provider's own limit).
    pub max_bytes: Option<usize>,
    /// Times an item whose line did not run (expired, cancelled, 5xx, missing) is sent
    /// again, in a later provider batch.
    pub resubmissions: u32,
    /// Where such an item goes again: a later provider batch, or the batch lane (one
    /// synchronous call at the full price, within the lane's own budgets).
    pub resubmit_via: ResubmitVia,
    /// Tokens the model's batches may hold enqueued at once (`None`: no budget).
    pub enqueued_tokens: Option<u64>,
    /// The batch price, in percent of the synchronous price (both providers: 50).
    pub price_percent: u32,
}

impl Default for BatchSettings {
    fn default() -> Self {
        BatchSettings {
            enabled: true,
            poll: Default::default(),
            max_requests: 10_000,
            max_bytes: None,
            resubmissions: 2,
            resubmit_via: ResubmitVia::Batches,
            enqueued_tokens: None,
            price_percent: 50,
        }
    }
}

/// Where an item of a provider batch whose line did not run goes again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResubmitVia {
    Batches,
    Lanes,
}

/// `500ms`, `30s`, `5m`.
fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (n, unit) = s.find(|c: char| !c.is_ascii_digit()).map_or((s, ""), |i| s.split_at(i));
    let n: u64 = n.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n * 60)),
        _ => None,
    }
}

impl BatchSettings {
    pub fn parse(spec: &str) -> Result<BatchSettings, String> {
        let mut b = BatchSettings::default();
        match spec.trim() {
            "" | "on" => return Ok(b),
            "off" => return Ok(BatchSettings { enabled: false, ..b }),
            _ => {}
        }
        for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty() && *e != "on") {
            let (key, value) = entry.split_once('=').ok_or_else(|| format!("`{entry}` is not key=value"))?;
            let count = || value.parse::<u64>().map_err(|_| format!("`{key}` takes a whole number"));
            match key {
                "poll" => {
                    let (first, cap) = value.split_once("..").ok_or("poll is `<first>..<cap>`, e.g. 30s..5m")?;
                    let (first, cap) = parse_duration(first)
                        .zip(parse_duration(cap))
                        .filter(|(f, c)| !f.is_zero() && f <= c)
                        .ok_or("poll durations are like 500ms, 30s, 5m, the first positive and at most the cap")?;
                    b.poll = reviewlane_core::batch::PollBackoff { first, cap };
                }
                "requests" => b.max_requests = count()?.clamp(1, 50_000) as usize,
                "mb" => b.max_bytes = Some((count()?.max(1) as usize).saturating_mul(1024 * 1024)),
                "resubmit" => b.resubmissions = count()?.min(10) as u32,
                "resubmit_via" => {
                    b.resubmit_via = match value {
                        "batches" => ResubmitVia::Batches,
                        "lanes" => ResubmitVia::Lanes,
                        _ => return Err("resubmit_via is `batches` or `lanes`".into()),
                    }
                }
                "enqueued_tokens" => b.enqueued_tokens = Some(count()?.max(1)),
                "price" => b.price_percent = count()?.min(100) as u32,
                other => return Err(format!("unknown key `{other}`")),
            }
        }
        Ok(b)
    }

    /// The provider's limits on one batch, lowered to these settings.
    pub fn limits(&self, provider: reviewlane_core::batch::BatchLimits) -> reviewlane_core::batch::BatchLimits {
        reviewlane_core::batch::BatchLimits {
            max_requests: provider.max_requests.min(self.max_requests),
            max_bytes: self.max_bytes.map_or(provider.max_bytes, |b| b.min(provider.max_bytes)),
        }
    }
}

impl ProviderConfig {
    /// Output tokens the provider counts against a token budget when a call starts (the
    /// request's output limit; the built-in analyzer is not metered).
    pub fn output_reserve(&self) -> u32 {
        match self {
            ProviderConfig::Builtin => 0,
            ProviderConfig::OpenAi { .. } => crate::provider::openai::MAX_OUTPUT_TOKENS,
            ProviderConfig::Anthropic { max_tokens, .. } => *max_tokens,
        }
    }

    /// The model called (`builtin` for the built-in analyzer).
    pub fn model(&self) -> &str {
        match self {
            ProviderConfig::Builtin => "builtin",
            ProviderConfig::OpenAi { model, .. } | ProviderConfig::Anthropic { model, .. } => model,
        }
    }
}

/// `REVIEWLANE_PROVIDER` and the chosen provider's settings; an endpoint bound to
/// another region than the extractor's is refused.
fn read_provider(r: &mut Reader<'_>, region: Option<Region>) -> Option<ProviderConfig> {
    let endpoint = |r: &mut Reader<'_>, url_var: &str, example: &str, model_var: &str| {
        let base_url: Option<String> = r.required(url_var, example);
        if let Some(u) = &base_url
            && !(u.starts_with("http://") || u.starts_with("https://"))
        {
            r.error(format!("{url_var} must be an http(s) URL"));
        }
        let model: Option<String> = r.required(model_var, "model name");
        let endpoint_region: Option<Region> =
            r.required(env::PROVIDER_REGION, "`us` or `eu`: where the endpoint processes data");
        Some((base_url?, model?, endpoint_region?))
    };
    let provider = match r.raw(env::PROVIDER).as_deref().unwrap_or("builtin") {
        "builtin" => Some(ProviderConfig::Builtin),
        "openai" => {
            let found = endpoint(r, env::OPENAI_BASE_URL, "http(s) URL of the API", env::OPENAI_MODEL);
            let api_key = api_key(r, env::OPENAI_API_KEY_FILE, env::OPENAI_API_KEY);
            let schema_dialect = match r.raw(env::OPENAI_SCHEMA_DIALECT) {
                None => SchemaDialect::default(),
                Some(v) => v.parse().unwrap_or_else(|()| {
                    r.error(
                        "REVIEWLANE_OPENAI_SCHEMA_DIALECT has an invalid value (`portable`, `openai`, `openai-fine-tuned`, `anthropic` or `full`)",
                    );
                    SchemaDialect::default()
                }),
            };
            found.map(|(base_url, model, endpoint_region)| ProviderConfig::OpenAi {
                base_url,
                model,
                api_key,
                endpoint_region,
                schema_dialect,
            })
        }
        "anthropic" => {
            let found = endpoint(
                r,
                env::ANTHROPIC_BASE_URL,
                "http(s) URL of the API, e.g. https://api.anthropic.com",
                env::ANTHROPIC_MODEL,
            );
            let api_key = api_key(r, env::ANTHROPIC_API_KEY_FILE, env::ANTHROPIC_API_KEY);
            let max_tokens: u32 = r.or(env::ANTHROPIC_MAX_TOKENS, 4096, "a token count");
            found.map(|(base_url, model, endpoint_region)| ProviderConfig::Anthropic {
                base_url,
                model,
                api_key,
                endpoint_region,
                max_tokens,
            })
        }
        _ => {
            r.error("REVIEWLANE_PROVIDER has an invalid value (`builtin`, `openai` or `anthropic`)");
            None
        }
    };
    let endpoint_region = match &provider {
        Some(ProviderConfig::OpenAi { endpoint_region, .. } | ProviderConfig::Anthropic { endpoint_region, .. }) => {
            Some(*endpoint_region)
        }
        _ => None,
    };
    if let (Some(region), Some(endpoint_region)) = (region, endpoint_region)
        && endpoint_region != region
    {
        r.error(format!(
            "provider endpoint belongs to region `{endpoint_region}` but this extractor serves `{region}`; refusing to send `{region}` content there"
        ));
    }
    provider
}

fn p_output(provider: &Option<ProviderConfig>) -> u32 {
    provider.as_ref().map_or(0, ProviderConfig::output_reserve)
}

/// Caps a part so that one call fits each of the key's token budgets with what every
/// call sends besides the diff and, where the budget counts it at start, the output
/// limit: a part that does not could never run. `Err` when no part could.
pub fn fit_parts_to_budget(
    parts: &mut PartConfig,
    budgets: &[(reviewlane_core::meter::Dimension, u64)],
    output: u32,
) -> Result<(), String> {
    use reviewlane_core::meter::Dimension;
    let output = u64::from(output);
    let fixed = crate::tokenizer::counter(parts.plan.tokenizer).tokens(&crate::provider::fixed_prompt()) as u64;
    let too_small = |dim: Dimension, beside: u64| {
        format!(
            "the {} budget in {} must exceed what one call takes besides its diff ({beside} tokens: \
             the instructions and schema, and the output limit where it is counted)",
            dim.short(),
            env::KEY_BUDGETS
        )
    };
    for &(dim, limit) in budgets {
        let beside = match dim {
            Dimension::Requests => continue,
            // Output is not the part's: the budget only has to hold one call's limit.
            Dimension::OutputTokens if output < limit => continue,
            Dimension::OutputTokens => return Err(too_small(dim, output)),
            Dimension::InputTokens => fixed,
            Dimension::Tokens | Dimension::TokensPerDay => fixed + output,
        };
        let Some(room) = limit.checked_sub(beside).filter(|room| *room > 0) else {
            return Err(too_small(dim, beside));
        };
        let fill = parts.plan.limits.fill_percent.max(1);
        let cap = usize::try_from(room).unwrap_or(usize::MAX).saturating_mul(100) / fill;
        parts.plan.limits.max_tokens = parts.plan.limits.max_tokens.min(cap);
    }
    Ok(())
}

/// `REVIEWLANE_CONTEXT_TOKENS` and the rest of the split settings.
fn read_parts(r: &mut Reader<'_>, provider: &Option<ProviderConfig>) -> PartConfig {
    use reviewlane_core::parts::{PartLimits, Plan, Tokenizer};
    let model = match provider {
        Some(ProviderConfig::OpenAi { model, .. } | ProviderConfig::Anthropic { model, .. }) => model.as_str(),
        _ => "builtin",
    };
    let d = PartConfig::for_model(model);
    let limits = PartLimits {
        max_tokens: r.or(env::CONTEXT_TOKENS, d.plan.limits.max_tokens, "a token count"),
        fill_percent: r.or(env::PART_FILL_PERCENT, d.plan.limits.fill_percent, "a percentage"),
        overlap: d.plan.limits.overlap,
    };
    if limits.max_tokens < 1000 {
        r.error("REVIEWLANE_CONTEXT_TOKENS must be at least 1000");
    }
    if !(1..=100).contains(&limits.fill_percent) {
        r.error("REVIEWLANE_PART_FILL_PERCENT must be between 1 and 100");
    }
    let bytes_per_token: f64 = r.or(env::BYTES_PER_TOKEN, 3.0, "a number");
    // At least 1: no tokenizer makes more tokens than bytes, which is what lets a diff
    // no longer in bytes than the budget skip counting.
    if !(1.0..=16.0).contains(&bytes_per_token) {
        r.error("REVIEWLANE_BYTES_PER_TOKEN must be between 1 and 16");
    }
    let estimate = Tokenizer::Estimate { milli_bytes_per_token: (bytes_per_token * 1000.0) as u32 };
    let tokenizer = match r.raw(env::TOKENIZER).as_deref().unwrap_or("auto") {
        "auto" => crate::tokenizer::for_model(model).unwrap_or(estimate),
        "o200k" => Tokenizer::O200k,
        "cl100k" => Tokenizer::Cl100k,
        "estimate" => estimate,
        _ => {
            r.error("REVIEWLANE_TOKENIZER must be `auto`, `o200k`, `cl100k` or `estimate`");
            estimate
        }
    };
    let max_parts: u32 = r.or(env::MAX_PARTS, d.max_parts, "a count");
    let findings_cap: u32 = r.or(env::FINDINGS_CAP, d.findings_cap, "a count");
    if max_parts == 0 || findings_cap == 0 {
        r.error("REVIEWLANE_MAX_PARTS and REVIEWLANE_FINDINGS_CAP must be positive");
    }
    PartConfig { plan: Plan { limits, tokenizer }, max_parts, findings_cap }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_setting_reads_off_or_its_keys_and_refuses_the_rest() {
        assert_eq!(BatchSettings::parse(""), Ok(BatchSettings::default()));
        assert!(!BatchSettings::parse("off").unwrap().enabled);
        assert_eq!(BatchSettings::default().resubmit_via, ResubmitVia::Batches);
        let b = BatchSettings::parse(
            "poll=50ms..2s, requests=300, mb=5, resubmit=1, resubmit_via=lanes, enqueued_tokens=9000, price=40",
        )
        .unwrap();
        assert_eq!(b.resubmit_via, ResubmitVia::Lanes);
        assert_eq!((b.poll.first, b.poll.cap), (Duration::from_millis(50), Duration::from_secs(2)));
        assert_eq!((b.max_requests, b.max_bytes, b.resubmissions), (300, Some(5 * 1024 * 1024), 1));
        assert_eq!((b.enqueued_tokens, b.price_percent, b.enabled), (Some(9000), 40, true));
        let lowered = b.limits(reviewlane_core::batch::BatchLimits::OPENAI);
        assert_eq!((lowered.max_requests, lowered.max_bytes), (300, 5 * 1024 * 1024));
        assert_eq!(
            BatchSettings::default().limits(reviewlane_core::batch::BatchLimits::ANTHROPIC).max_requests,
            10_000
        );
        for bad in ["poll=5m..30s", "poll=30", "requests=lots", "colour=blue", "requests", "resubmit_via=carrier"] {
            assert!(BatchSettings::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn prices_parse_and_cost_is_in_micro_dollars() {
        let p = parse_prices("gpt-4o-mini=0.15/0.60, sim=1/2").unwrap();
        assert_eq!(p["sim"], Price { input_per_mtok: 1.0, output_per_mtok: 2.0 });
        let t = reviewlane_core::job::Tokens { input: 1_000_000, output: 500_000 };
        assert_eq!(p["gpt-4o-mini"].cost_micro_usd(t), 450_000);
        assert_eq!(p["sim"].cost_micro_usd(reviewlane_core::job::Tokens { input: 100, output: 50 }), 200);
        assert!(parse_prices("sim=1").is_err());
        assert!(parse_prices("sim=-1/2").is_err());
        assert!(parse_prices("").unwrap().is_empty());
    }
    use std::collections::HashMap;

    fn env(pairs: &[(&'static str, &str)]) -> HashMap<&'static str, String> {
        let path = std::env::temp_dir().join(format!("reviewlane-x-tenants-{}.toml", std::process::id()));
        std::fs::write(&path, "[[tenants]]\nid = \"a\"\nregion = \"eu\"\n").unwrap();
        let mut m: HashMap<&'static str, String> = pairs.iter().map(|(k, v)| (*k, v.to_string())).collect();
        m.entry(reviewlane_core::env::TENANTS_FILE).or_insert(path.display().to_string());
        m
    }

    #[test]
    fn builtin_defaults() {
        let c = ExtractorConfig::from_env(&env(&[
            (reviewlane_core::env::REGION, "eu"),
            (reviewlane_core::env::NATS_URL, "nats://x"),
        ]))
        .unwrap();
        assert_eq!(c.region, Region::Eu);
        assert!(matches!(c.provider, ProviderConfig::Builtin));
        assert_eq!(c.scheduling.concurrency, 8);
        assert_eq!(c.scheduling.interactive_reserve_slots, None, "concurrency / 8 unless set");
        let set = ExtractorConfig::from_env(&env(&[
            (reviewlane_core::env::REGION, "eu"),
            (reviewlane_core::env::NATS_URL, "nats://x"),
            (env::INTERACTIVE_RESERVE_SLOTS, "0"),
        ]))
        .unwrap();
        assert_eq!(set.scheduling.interactive_reserve_slots, Some(0));
        let errs = ExtractorConfig::from_env(&env(&[
            (reviewlane_core::env::REGION, "eu"),
            (reviewlane_core::env::NATS_URL, "nats://x"),
            (env::INTERACTIVE_RESERVE_SLOTS, "some"),
        ]))
        .unwrap_err();
        assert!(errs.to_string().contains(env::INTERACTIVE_RESERVE_SLOTS), "{errs}");
    }

    #[test]
    fn refuses_a_provider_endpoint_of_another_region() {
        let errs = ExtractorConfig::from_env(&env(&[
            (reviewlane_core::env::REGION, "eu"),
            (reviewlane_core::env::NATS_URL, "nats://x"),
            (env::PROVIDER, "openai"),
            (env::OPENAI_BASE_URL, "https://api.example/v1"),
            (env::OPENAI_MODEL, "m"),
            (env::OPENAI_API_KEY, "sk-secret-value"),
            (env::PROVIDER_REGION, "us"),
        ]))
        .unwrap_err();
        assert_eq!(errs.0.len(), 1, "{errs}");
        assert!(errs.0[0].contains("`us`") && errs.0[0].contains("`eu`"));
        assert!(!errs.to_string().contains("sk-secret-value"));
    }

    #[test]
    fn store_retry_doubles_up_to_its_cap() {
        let r = StoreRetry { tries: 5, base: Duration::from_millis(100), cap: Duration::from_millis(500) };
        let delays: Vec<_> = (1..=5).map(|n| r.delay(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
    }

    #[test]
    fn a_token_budget_caps_a_part_so_that_it_fits_with_its_output_limit() {
        let openai = |budgets: &[(&'static str, &'static str)]| {
            let mut pairs = vec![
                (env::PROVIDER, "openai"),
                (env::OPENAI_BASE_URL, "http://127.0.0.1:1/v1"),
                (env::OPENAI_MODEL, "gpt-4o-mini"),
                (env::PROVIDER_REGION, "eu"),
                (reviewlane_core::env::REGION, "eu"),
                (reviewlane_core::env::NATS_URL, "nats://127.0.0.1:1"),
            ];
            pairs.extend_from_slice(budgets);
            ExtractorConfig::from_env(&env(&pairs))
        };
        let c = openai(&[(env::KEY_BUDGETS, "tpm=20000,rpm=30")]).unwrap();
        let budget = c.parts.plan.limits.budget() as u64;
        let fixed = crate::tokenizer::counter(c.parts.plan.tokenizer).tokens(&crate::provider::fixed_prompt()) as u64;
        assert!(fixed > 100, "the instructions and schema are counted: {fixed}");
        assert!(budget + fixed + 4096 <= 20_000 && budget > 14_000, "part budget {budget}");
        use reviewlane_core::meter::Dimension;
        assert_eq!(c.quota.budgets, vec![(Dimension::Requests, 30), (Dimension::Tokens, 20_000)]);
        // An input budget caps the prompt without the output limit.
        let c = openai(&[(env::KEY_BUDGETS, "itpm=20000,otpm=8000")]).unwrap();
        let budget = c.parts.plan.limits.budget() as u64;
        assert!(budget + fixed <= 20_000 && budget + fixed + 4096 > 20_000, "part budget {budget}");
        // A budget no larger than one call's output limit could never run a call.
        for never in ["tpm=4000", "otpm=4000"] {
            let e = openai(&[(env::KEY_BUDGETS, never)]).unwrap_err();
            assert!(e.to_string().contains("REVIEWLANE_KEY_BUDGETS"), "{e}");
        }
        let e = openai(&[(env::KEY_BUDGETS, "tpm=lots")]).unwrap_err();
        assert!(e.to_string().contains("REVIEWLANE_KEY_BUDGETS"), "{e}");
    }

    #[test]
    fn split_settings_default_by_model_and_are_checked() {
        use reviewlane_core::parts::Tokenizer;
        let base = [
            (reviewlane_core::env::REGION, "eu"),
            (reviewlane_core::env::NATS_URL, "nats://x"),
            (env::PROVIDER, "openai"),
            (env::OPENAI_BASE_URL, "https://api.example/v1"),
            (env::OPENAI_MODEL, "gpt-4o-mini"),
            (env::PROVIDER_REGION, "eu"),
        ];
        let c = ExtractorConfig::from_env(&env(&base)).unwrap();
        assert_eq!(c.parts.plan.tokenizer, Tokenizer::O200k);
        assert_eq!((c.parts.plan.limits.max_tokens, c.parts.max_parts, c.parts.findings_cap), (100_000, 64, 500));
        let mut set = base.to_vec();
        set.extend([(env::TOKENIZER, "estimate"), (env::BYTES_PER_TOKEN, "3.5")]);
        set.push((env::CONTEXT_TOKENS, "20000"));
        let c = ExtractorConfig::from_env(&env(&set)).unwrap();
        assert_eq!(c.parts.plan.tokenizer, Tokenizer::Estimate { milli_bytes_per_token: 3500 });
        assert_eq!(c.parts.plan.limits.max_tokens, 20_000);
        let mut bad = base.to_vec();
        bad.extend([
            (env::TOKENIZER, "words"),
            (env::BYTES_PER_TOKEN, "0.5"),
            (env::PART_FILL_PERCENT, "0"),
            (env::MAX_PARTS, "0"),
        ]);
        let errs = ExtractorConfig::from_env(&env(&bad)).unwrap_err();
        assert_eq!(errs.0.len(), 4, "{errs}");
    }

    #[test]
    fn reports_all_missing() {
        let errs = ExtractorConfig::from_env(&env(&[(env::PROVIDER, "openai"), (env::CONCURRENCY, "0")])).unwrap_err();
        // region, nats url, base url, model, provider region, concurrency
        assert_eq!(errs.0.len(), 6, "{errs}");
    }
}
