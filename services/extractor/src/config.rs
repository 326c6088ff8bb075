//! Extractor configuration, read once and validated whole.
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `REVIEWLANE_REGION` | required | `us` or `eu`: the only region this process touches |
//! | `REVIEWLANE_ADMIN_ADDR` | `127.0.0.1:9465` | admin HTTP: `/metrics`, `/healthz`, `/readyz` |
//! | `REVIEWLANE_NATS_URL` | required | that region's NATS |
//! | `REVIEWLANE_TENANTS_FILE` | required | this region's tenants get a consumer per lane (weight, scope limit) |
//! | `REVIEWLANE_MODEL_CLASS` | the model | model class of the quota scope (provider, model class, tenant, region) |
//! | `REVIEWLANE_KEY_LIMIT` | `8` | calls in flight on the provider key (account) across all replicas and tenants; tenants share it by `weight`, and a tenant's `scope_limit` caps it |
//! | `REVIEWLANE_KEY_ID` | `default` | names the provider key (account) this deployment calls with: deployments with the same id share one window, pause and circuit |
//! | `REVIEWLANE_HEARTBEAT_MS` | `1000` | replica heartbeat in `QUOTA_<R>` |
//! | `REVIEWLANE_QUOTA_CIRCUIT_SECS` | `600` | after `insufficient_quota`, the scope's jobs end at once for this long |
//! | `REVIEWLANE_PROBE_EVERY_SECS` | `60` | a scope's window probes one call higher after this long without a 429 |
//! | `REVIEWLANE_INTERACTIVE_WAIT_LIMIT_SECS` | `5` | batch pulls no more than its minimum while interactive work waited longer |
//! | `REVIEWLANE_BATCH_MIN_SLOTS` | `1` | call slots batch keeps whenever it has work (its aging bound: under an interactive backlog batch slows down, never stops) |
//! | `REVIEWLANE_INTERACTIVE_RESERVE_SLOTS` | concurrency / 8 | call slots batch leaves free beyond its minimum while interactive work came within the last minute, so an interactive review arriving during a batch flood starts at once instead of waiting for a batch call to end (batch alone still uses every slot) |
//! | `REVIEWLANE_PROVIDER` | `builtin` | `builtin`, `openai` (any OpenAI-compatible API) or `anthropic` (Messages API) |
//! | `REVIEWLANE_OPENAI_BASE_URL` | for `openai` | e.g. `https://api.openai.com/v1` |
//! | `REVIEWLANE_OPENAI_MODEL` | for `openai` | model name |
//! | `REVIEWLANE_OPENAI_API_KEY_FILE` (or `REVIEWLANE_OPENAI_API_KEY`) | optional | bearer key, from a file (a mounted Secret) or the variable (kept secret) |
//! | `REVIEWLANE_PROVIDER_REGION` | for `openai` | region the endpoint is bound to; must equal `REVIEWLANE_REGION` |
//! | `REVIEWLANE_ANTHROPIC_BASE_URL`, `_MODEL`, `_API_KEY_FILE` (or `_API_KEY`), `_MAX_TOKENS` | for `anthropic` (max tokens `4096`) | Anthropic Messages API endpoint (region-bound like any provider), model, key, output token limit |
//! | `REVIEWLANE_OPENAI_SCHEMA_DIALECT` | `portable` | the JSON Schema subset the endpoint's structured outputs accept: `portable` (structure only, every property required: any provider), `openai`, `openai-fine-tuned`, `anthropic`, `full`; the answer is always checked against the full schema |
//! | `REVIEWLANE_CONCURRENCY` | `8` | provider calls in flight in this process |
//! | `REVIEWLANE_LEASE_SECS` | `30` | consumer ack wait; extended by progress acks during a call |
//! | `REVIEWLANE_PROVIDER_TIMEOUT_SECS` | `120` | one provider call |
//! | `REVIEWLANE_BUDGET_CONGESTION` / `_TRANSIENT` / `_SCHEMA` | `5` / `3` / `2` | retries per job and kind |
//! | `REVIEWLANE_BACKOFF_BASE_MS` / `REVIEWLANE_BACKOFF_CAP_SECS` | `1000` / `60` | backoff without a hint |
//! | `REVIEWLANE_BATCH_BACKOFF_BASE_MS` / `REVIEWLANE_BATCH_BACKOFF_CAP_SECS` | as above | the batch lane's own |
//! | `REVIEWLANE_HINT_CEILING_SECS` | `300` | longest provider retry hint honoured |
//! | `REVIEWLANE_SHUTDOWN_GRACE_SECS` | `20` | time for in-flight calls at SIGTERM |
//! | `REVIEWLANE_MODEL_PRICES` | unset | `model=in/out,...`: US dollars per million input/output tokens, for the estimated cost of each job (`GetReview`); a model not listed costs 0 |
//! | `REVIEWLANE_STORE_RETRIES` | `12` | tries of one store write after a paid answer (never the call) |
//! | `REVIEWLANE_STORE_BACKOFF_BASE_MS` / `REVIEWLANE_STORE_BACKOFF_CAP_MS` | `100` / `4000` | backoff between those tries (about 26 s in all: longer than a JetStream cluster's failover) |
//! | `REVIEWLANE_PROVIDER_MAX_RESPONSE_BYTES` | `4194304` | provider response body read at most; a longer answer is invalid output |
//! | `REVIEWLANE_RESULT_INLINE_MAX_BYTES` | the server's message limit | results larger than this go whole to the `FINDINGS_<R>` object store |
//! | `REVIEWLANE_QUARANTINE_RAW_MAX_BYTES` | `4096` | raw item kept with a quarantined finding; longer ones are cut (digest and length kept) |
//! | `REVIEWLANE_RECONCILE_EVERY_SECS` | `30` | how often the reconciler looks for stranded jobs |
//! | `REVIEWLANE_CONTEXT_TOKENS` | `100000` | the model's context budget for the diff; a larger review is split into parts, each its own call |
//! | `REVIEWLANE_PART_FILL_PERCENT` | `80` | share of that budget a part fills (the rest is the count's margin) |
//! | `REVIEWLANE_PART_OVERLAP_LINES` | `3` | unchanged lines repeated before each range of a hunk cut across parts |
//! | `REVIEWLANE_TOKENIZER` | `auto` | how parts are counted: `o200k`, `cl100k` (OpenAI's tokenizers), `estimate`, or `auto` (the model's tokenizer when it is an OpenAI model, else `estimate`) |
//! | `REVIEWLANE_BYTES_PER_TOKEN` | `3.0` | the estimate's ratio (code is about 3.5 with OpenAI's and Anthropic's tokenizers; lower is safer) |
//! | `REVIEWLANE_MAX_PARTS` | `64` | a review needing more parts ends `too_large` without a call |
//! | `REVIEWLANE_FINDINGS_CAP` | `500` | findings kept of a split review's merged result (most severe first); the rest are counted as dropped |
//! | `REVIEWLANE_RECONCILE_GRACE_SECS` | `120` | how long a job may go without a message or live lease before it counts as stranded |

use std::time::Duration;

use reviewlane_shared::Region;
use std::sync::Arc;

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

/// A provider key from `<var>_FILE` (a mounted Secret) or `<var>`.
fn api_key(r: &mut Reader<'_>, var: &str) -> Option<SecretString> {
    match r.raw(&format!("{var}_FILE")) {
        Some(path) => match std::fs::read_to_string(&path) {
            Ok(k) => Some(SecretString::from(k.trim().to_string())),
            Err(_) => {
                r.error(format!("{var}_FILE names a file that cannot be read"));
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

#[derive(Debug, Clone)]
pub struct ExtractorConfig {
    pub region: Region,
    /// Admin HTTP port: `/metrics`, `/healthz`.
    pub admin_addr: std::net::SocketAddr,
    pub nats_url: String,
    /// Tenants: this region's get a consumer per lane, with their weight and scope limit.
    pub tenants: Arc<Tenants>,
    pub provider: ProviderConfig,
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
    /// How long an `insufficient_quota` answer keeps a scope's circuit open.
    pub circuit_open_for: Duration,
    /// How long a scope's window holds before it probes one call higher.
    pub probe_every: Duration,
    /// Batch stops pulling while interactive work has waited longer than this.
    pub interactive_wait_limit: Duration,
    /// Call slots batch keeps whenever it has work, backlog or not: its aging bound.
    pub batch_min_slots: usize,
    /// Slots batch leaves free for interactive work (`None`: concurrency / 8).
    pub interactive_reserve_slots: Option<usize>,
    pub concurrency: usize,
    pub lease: Duration,
    pub provider_timeout: Duration,
    pub budgets: Budgets,
    /// Backoff without a provider hint, interactive lane.
    pub backoff: Backoff,
    /// Backoff without a provider hint, batch lane.
    pub batch_backoff: Backoff,
    /// Longest provider retry hint honoured; longer ones are cut to this and counted.
    pub hint_ceiling: Duration,
    pub shutdown_grace: Duration,
    /// Reuse validated results of identical reviews (`CACHE_<R>`).
    pub result_cache: bool,
    /// Each lane's service window, exported as `reviewlane_lane_slo_seconds`.
    pub lane_windows: [Duration; 2],
    pub store_retry: StoreRetry,
    pub quarantine_raw_max: usize,
    pub max_response_bytes: usize,
    /// Results larger than this go to the object store (`None`: the server's limit).
    pub result_inline_max: Option<usize>,
    pub reconcile: ReconcileConfig,
    pub telemetry: reviewlane_shared::telemetry::TelemetryConfig,
    /// Fault hooks for tests (no-ops unless built with `fault-hooks`).
    pub faults: reviewlane_shared::faults::Faults,
    /// Prices per model class (`REVIEWLANE_MODEL_PRICES`), for the estimated cost of
    /// each job.
    pub prices: std::collections::HashMap<String, Price>,
    /// Credentials and TLS for the region's NATS (`REVIEWLANE_NATS_*`).
    pub nats: reviewlane_shared::nats_client::NatsClientConfig,
    /// Splitting reviews larger than the model's context into parts.
    pub parts: PartConfig,
}

/// How reviews larger than the model's context are split (see
/// `reviewlane_core::chunk`) and merged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartConfig {
    /// Limits and tokenizer of new splits (a split job keeps the plan it started with).
    pub plan: reviewlane_core::chunk::Plan,
    pub max_parts: u32,
    pub findings_cap: u32,
}

impl PartConfig {
    /// Defaults for a model: its tokenizer when tiktoken knows it, else the estimate.
    pub fn for_model(model: &str) -> Self {
        PartConfig {
            plan: reviewlane_core::chunk::Plan {
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
        let model_class = match &provider {
            ProviderConfig::Builtin => "builtin".to_string(),
            ProviderConfig::OpenAi { model, .. } | ProviderConfig::Anthropic { model, .. } => model.clone(),
        };
        let parts = PartConfig::for_model(&model_class);
        ExtractorConfig {
            region,
            admin_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 9465)),
            nats_url: nats_url.into(),
            tenants,
            provider,
            model_class,
            key_limit: 8,
            key_id: "default".into(),
            heartbeat: Duration::from_secs(1),
            probe_every: Duration::from_secs(60),
            circuit_open_for: Duration::from_secs(600),
            interactive_wait_limit: Duration::from_secs(5),
            batch_min_slots: 1,
            interactive_reserve_slots: None,
            concurrency: 8,
            lease: Duration::from_secs(30),
            provider_timeout: Duration::from_secs(120),
            budgets: Budgets::default(),
            backoff: Backoff::default(),
            batch_backoff: Backoff::default(),
            hint_ceiling: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(20),
            result_cache: true,
            lane_windows: [Duration::from_secs(60), Duration::from_secs(3600)],
            store_retry: StoreRetry::default(),
            quarantine_raw_max: 4096,
            max_response_bytes: 4 * 1024 * 1024,
            result_inline_max: None,
            reconcile: ReconcileConfig::default(),
            telemetry: Default::default(),
            faults: Default::default(),
            nats: Default::default(),
            prices: Default::default(),
            parts,
        }
    }

    pub fn from_env(env: &dyn Env) -> Result<Self, ConfigErrors> {
        let mut r = Reader::new(env);
        let region: Option<Region> = r.required("REVIEWLANE_REGION", "`us` or `eu`");
        let nats_url: Option<String> = reviewlane_shared::nats_client::read_url(&mut r, "REVIEWLANE_NATS_URL");
        let tenants = r.tenants("REVIEWLANE_TENANTS_FILE");
        let provider = match r.raw("REVIEWLANE_PROVIDER").as_deref().unwrap_or("builtin") {
            "builtin" => Some(ProviderConfig::Builtin),
            "openai" => {
                let base_url: Option<String> = r.required("REVIEWLANE_OPENAI_BASE_URL", "http(s) URL of the API");
                let model: Option<String> = r.required("REVIEWLANE_OPENAI_MODEL", "model name");
                let endpoint_region: Option<Region> =
                    r.required("REVIEWLANE_PROVIDER_REGION", "`us` or `eu`: where the endpoint processes data");
                let api_key = api_key(&mut r, "REVIEWLANE_OPENAI_API_KEY");
                let schema_dialect = match r.raw("REVIEWLANE_OPENAI_SCHEMA_DIALECT") {
                    None => SchemaDialect::default(),
                    Some(v) => v.parse().unwrap_or_else(|()| {
                        r.error(
                            "REVIEWLANE_OPENAI_SCHEMA_DIALECT has an invalid value (`portable`, `openai`, `openai-fine-tuned`, `anthropic` or `full`)",
                        );
                        SchemaDialect::default()
                    }),
                };
                if let Some(u) = &base_url
                    && !(u.starts_with("http://") || u.starts_with("https://"))
                {
                    r.error("REVIEWLANE_OPENAI_BASE_URL must be an http(s) URL");
                }
                match (base_url, model, endpoint_region) {
                    (Some(base_url), Some(model), Some(endpoint_region)) => {
                        Some(ProviderConfig::OpenAi { base_url, model, api_key, endpoint_region, schema_dialect })
                    }
                    _ => None,
                }
            }
            "anthropic" => {
                let base_url: Option<String> = r.required(
                    "REVIEWLANE_ANTHROPIC_BASE_URL",
                    "http(s) URL of the API, e.g. https://api.anthropic.com",
                );
                let model: Option<String> = r.required("REVIEWLANE_ANTHROPIC_MODEL", "model name");
                let endpoint_region: Option<Region> =
                    r.required("REVIEWLANE_PROVIDER_REGION", "`us` or `eu`: where the endpoint processes data");
                let api_key = api_key(&mut r, "REVIEWLANE_ANTHROPIC_API_KEY");
                let max_tokens: u32 = r.or("REVIEWLANE_ANTHROPIC_MAX_TOKENS", 4096, "a token count");
                if let Some(u) = &base_url
                    && !(u.starts_with("http://") || u.starts_with("https://"))
                {
                    r.error("REVIEWLANE_ANTHROPIC_BASE_URL must be an http(s) URL");
                }
                match (base_url, model, endpoint_region) {
                    (Some(base_url), Some(model), Some(endpoint_region)) => {
                        Some(ProviderConfig::Anthropic { base_url, model, api_key, endpoint_region, max_tokens })
                    }
                    _ => None,
                }
            }
            _ => {
                r.error("REVIEWLANE_PROVIDER has an invalid value (`builtin`, `openai` or `anthropic`)");
                None
            }
        };
        let endpoint_region = match &provider {
            Some(
                ProviderConfig::OpenAi { endpoint_region, .. } | ProviderConfig::Anthropic { endpoint_region, .. },
            ) => Some(*endpoint_region),
            _ => None,
        };
        if let (Some(region), Some(endpoint_region)) = (region, endpoint_region)
            && endpoint_region != region
        {
            r.error(format!(
                "provider endpoint belongs to region `{endpoint_region}` but this extractor serves `{region}`; refusing to send `{region}` content there"
            ));
        }
        let d = ExtractorConfig::new(Region::Us, "", Arc::default(), ProviderConfig::Builtin);
        let model_class: Option<String> = r.optional("REVIEWLANE_MODEL_CLASS", "a name");
        let key_limit: u32 = r.or("REVIEWLANE_KEY_LIMIT", d.key_limit, "a count");
        let key_id: String = r.or("REVIEWLANE_KEY_ID", d.key_id.clone(), "a name");
        let heartbeat_ms: u64 = r.or("REVIEWLANE_HEARTBEAT_MS", 1000, "milliseconds");
        let admin_addr = r.or("REVIEWLANE_ADMIN_ADDR", d.admin_addr, "host:port");
        let probe_every: u64 = r.or("REVIEWLANE_PROBE_EVERY_SECS", 60, "whole seconds");
        let circuit: u64 = r.or("REVIEWLANE_QUOTA_CIRCUIT_SECS", 600, "whole seconds");
        let wait_limit: u64 = r.or("REVIEWLANE_INTERACTIVE_WAIT_LIMIT_SECS", 5, "whole seconds");
        let batch_min_slots: usize = r.or("REVIEWLANE_BATCH_MIN_SLOTS", d.batch_min_slots, "a count");
        let interactive_reserve_slots: Option<usize> = r
            .raw("REVIEWLANE_INTERACTIVE_RESERVE_SLOTS")
            .map(|_| r.or("REVIEWLANE_INTERACTIVE_RESERVE_SLOTS", 0, "a count"));
        if heartbeat_ms == 0 {
            r.error("REVIEWLANE_HEARTBEAT_MS must be positive");
        }
        let concurrency: usize = r.or("REVIEWLANE_CONCURRENCY", d.concurrency, "a positive count");
        if concurrency == 0 {
            r.error("REVIEWLANE_CONCURRENCY must be positive");
        }
        let lease: u64 = r.or("REVIEWLANE_LEASE_SECS", 30, "whole seconds");
        if lease == 0 {
            r.error("REVIEWLANE_LEASE_SECS must be positive");
        }
        let timeout: u64 = r.or("REVIEWLANE_PROVIDER_TIMEOUT_SECS", 120, "whole seconds");
        let budgets = Budgets {
            congestion: r.or("REVIEWLANE_BUDGET_CONGESTION", d.budgets.congestion, "a count"),
            transient: r.or("REVIEWLANE_BUDGET_TRANSIENT", d.budgets.transient, "a count"),
            schema: r.or("REVIEWLANE_BUDGET_SCHEMA", d.budgets.schema, "a count"),
        };
        let base_ms: u64 = r.or("REVIEWLANE_BACKOFF_BASE_MS", 1000, "milliseconds");
        let cap_s: u64 = r.or("REVIEWLANE_BACKOFF_CAP_SECS", 60, "whole seconds");
        let batch_base_ms: u64 = r.or("REVIEWLANE_BATCH_BACKOFF_BASE_MS", base_ms, "milliseconds");
        let batch_cap_s: u64 = r.or("REVIEWLANE_BATCH_BACKOFF_CAP_SECS", cap_s, "whole seconds");
        let ceiling: u64 = r.or("REVIEWLANE_HINT_CEILING_SECS", 300, "whole seconds");
        let grace: u64 = r.or("REVIEWLANE_SHUTDOWN_GRACE_SECS", 20, "whole seconds");
        let result_cache = match r.raw("REVIEWLANE_RESULT_CACHE").as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(_) => {
                r.error("REVIEWLANE_RESULT_CACHE must be `on` or `off`");
                true
            }
        };
        let store_retry = StoreRetry::from_reader(&mut r);
        let prices = match r.raw("REVIEWLANE_MODEL_PRICES").map(|t| parse_prices(&t)) {
            None => Default::default(),
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                r.error(format!(
                    "REVIEWLANE_MODEL_PRICES: {e} (expected `model=in/out,...`, dollars per million tokens)"
                ));
                Default::default()
            }
        };
        let quarantine_raw_max: usize = r.or("REVIEWLANE_QUARANTINE_RAW_MAX_BYTES", 4096, "bytes");
        let max_response_bytes: usize = r.or("REVIEWLANE_PROVIDER_MAX_RESPONSE_BYTES", d.max_response_bytes, "bytes");
        let result_inline_max: Option<usize> = r.optional("REVIEWLANE_RESULT_INLINE_MAX_BYTES", "bytes");
        let reconcile = ReconcileConfig {
            every: Duration::from_secs(r.or("REVIEWLANE_RECONCILE_EVERY_SECS", 30, "whole seconds")),
            grace: Duration::from_secs(r.or("REVIEWLANE_RECONCILE_GRACE_SECS", 120, "whole seconds")),
        };
        if reconcile.every.is_zero() {
            r.error("REVIEWLANE_RECONCILE_EVERY_SECS must be positive");
        }
        let parts = read_parts(&mut r, &provider);
        let lane_windows = r.lane_windows();
        let telemetry = reviewlane_shared::telemetry::TelemetryConfig::read(&mut r);
        let nats = reviewlane_shared::nats_client::NatsClientConfig::from_reader(&mut r, &["REVIEWLANE_NATS"]);
        r.finish()?;
        let provider = provider.expect("checked");
        let model_class = model_class.unwrap_or_else(|| match &provider {
            ProviderConfig::Builtin => "builtin".to_string(),
            ProviderConfig::OpenAi { model, .. } | ProviderConfig::Anthropic { model, .. } => model.clone(),
        });
        Ok(ExtractorConfig {
            region: region.expect("checked"),
            admin_addr,
            nats_url: nats_url.expect("checked"),
            tenants: Arc::new(tenants.expect("checked")),
            provider,
            model_class,
            key_limit,
            key_id,
            heartbeat: Duration::from_millis(heartbeat_ms),
            probe_every: Duration::from_secs(probe_every),
            circuit_open_for: Duration::from_secs(circuit),
            interactive_wait_limit: Duration::from_secs(wait_limit),
            batch_min_slots,
            interactive_reserve_slots,
            concurrency,
            lease: Duration::from_secs(lease),
            provider_timeout: Duration::from_secs(timeout),
            budgets,
            backoff: Backoff {
                base: Duration::from_millis(base_ms),
                cap: Duration::from_secs(cap_s),
                ..Backoff::default()
            },
            batch_backoff: Backoff {
                base: Duration::from_millis(batch_base_ms),
                cap: Duration::from_secs(batch_cap_s),
                ..Backoff::default()
            },
            hint_ceiling: Duration::from_secs(ceiling),
            shutdown_grace: Duration::from_secs(grace),
            result_cache,
            lane_windows,
            store_retry,
            quarantine_raw_max,
            max_response_bytes,
            result_inline_max,
            reconcile,
            telemetry,
            faults: Default::default(),
            nats,
            prices,
            parts,
        })
    }
}

/// `REVIEWLANE_CONTEXT_TOKENS` and the rest of the split settings.
fn read_parts(r: &mut Reader<'_>, provider: &Option<ProviderConfig>) -> PartConfig {
    use reviewlane_core::chunk::{PartLimits, Plan, Tokenizer};
    let model = match provider {
        Some(ProviderConfig::OpenAi { model, .. } | ProviderConfig::Anthropic { model, .. }) => model.as_str(),
        _ => "builtin",
    };
    let d = PartConfig::for_model(model);
    let limits = PartLimits {
        max_tokens: r.or("REVIEWLANE_CONTEXT_TOKENS", d.plan.limits.max_tokens, "a token count"),
        fill_percent: r.or("REVIEWLANE_PART_FILL_PERCENT", d.plan.limits.fill_percent, "a percentage"),
        overlap: r.or("REVIEWLANE_PART_OVERLAP_LINES", d.plan.limits.overlap, "a line count"),
    };
    if limits.max_tokens < 1000 {
        r.error("REVIEWLANE_CONTEXT_TOKENS must be at least 1000");
    }
    if !(1..=100).contains(&limits.fill_percent) {
        r.error("REVIEWLANE_PART_FILL_PERCENT must be between 1 and 100");
    }
    let bytes_per_token: f64 = r.or("REVIEWLANE_BYTES_PER_TOKEN", 3.0, "a number");
    // At least 1: no tokenizer makes more tokens than bytes, which is what lets a diff
    // no longer in bytes than the budget skip counting.
    if !(1.0..=16.0).contains(&bytes_per_token) {
        r.error("REVIEWLANE_BYTES_PER_TOKEN must be between 1 and 16");
    }
    let estimate = Tokenizer::Estimate { milli_bytes_per_token: (bytes_per_token * 1000.0) as u32 };
    let tokenizer = match r.raw("REVIEWLANE_TOKENIZER").as_deref().unwrap_or("auto") {
        "auto" => crate::tokenizer::for_model(model).unwrap_or(estimate),
        "o200k" => Tokenizer::O200k,
        "cl100k" => Tokenizer::Cl100k,
        "estimate" => estimate,
        _ => {
            r.error("REVIEWLANE_TOKENIZER must be `auto`, `o200k`, `cl100k` or `estimate`");
            estimate
        }
    };
    let max_parts: u32 = r.or("REVIEWLANE_MAX_PARTS", d.max_parts, "a count");
    let findings_cap: u32 = r.or("REVIEWLANE_FINDINGS_CAP", d.findings_cap, "a count");
    if max_parts == 0 || findings_cap == 0 {
        r.error("REVIEWLANE_MAX_PARTS and REVIEWLANE_FINDINGS_CAP must be positive");
    }
    PartConfig { plan: Plan { limits, tokenizer }, max_parts, findings_cap }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        m.entry("REVIEWLANE_TENANTS_FILE").or_insert(path.display().to_string());
        m
    }

    #[test]
    fn builtin_defaults() {
        let c = ExtractorConfig::from_env(&env(&[("REVIEWLANE_REGION", "eu"), ("REVIEWLANE_NATS_URL", "nats://x")]))
            .unwrap();
        assert_eq!(c.region, Region::Eu);
        assert!(matches!(c.provider, ProviderConfig::Builtin));
        assert_eq!(c.concurrency, 8);
        assert_eq!(c.interactive_reserve_slots, None, "concurrency / 8 unless set");
        let set = ExtractorConfig::from_env(&env(&[
            ("REVIEWLANE_REGION", "eu"),
            ("REVIEWLANE_NATS_URL", "nats://x"),
            ("REVIEWLANE_INTERACTIVE_RESERVE_SLOTS", "0"),
        ]))
        .unwrap();
        assert_eq!(set.interactive_reserve_slots, Some(0));
        let errs = ExtractorConfig::from_env(&env(&[
            ("REVIEWLANE_REGION", "eu"),
            ("REVIEWLANE_NATS_URL", "nats://x"),
            ("REVIEWLANE_INTERACTIVE_RESERVE_SLOTS", "some"),
        ]))
        .unwrap_err();
        assert!(errs.to_string().contains("REVIEWLANE_INTERACTIVE_RESERVE_SLOTS"), "{errs}");
    }

    #[test]
    fn refuses_a_provider_endpoint_of_another_region() {
        let errs = ExtractorConfig::from_env(&env(&[
            ("REVIEWLANE_REGION", "eu"),
            ("REVIEWLANE_NATS_URL", "nats://x"),
            ("REVIEWLANE_PROVIDER", "openai"),
            ("REVIEWLANE_OPENAI_BASE_URL", "https://api.example/v1"),
            ("REVIEWLANE_OPENAI_MODEL", "m"),
            ("REVIEWLANE_OPENAI_API_KEY", "sk-secret-value"),
            ("REVIEWLANE_PROVIDER_REGION", "us"),
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
    fn split_settings_default_by_model_and_are_checked() {
        use reviewlane_core::chunk::Tokenizer;
        let base = [
            ("REVIEWLANE_REGION", "eu"),
            ("REVIEWLANE_NATS_URL", "nats://x"),
            ("REVIEWLANE_PROVIDER", "openai"),
            ("REVIEWLANE_OPENAI_BASE_URL", "https://api.example/v1"),
            ("REVIEWLANE_OPENAI_MODEL", "gpt-4o-mini"),
            ("REVIEWLANE_PROVIDER_REGION", "eu"),
        ];
        let c = ExtractorConfig::from_env(&env(&base)).unwrap();
        assert_eq!(c.parts.plan.tokenizer, Tokenizer::O200k);
        assert_eq!((c.parts.plan.limits.max_tokens, c.parts.max_parts, c.parts.findings_cap), (100_000, 64, 500));
        let mut set = base.to_vec();
        set.extend([("REVIEWLANE_TOKENIZER", "estimate"), ("REVIEWLANE_BYTES_PER_TOKEN", "3.5")]);
        set.push(("REVIEWLANE_CONTEXT_TOKENS", "20000"));
        let c = ExtractorConfig::from_env(&env(&set)).unwrap();
        assert_eq!(c.parts.plan.tokenizer, Tokenizer::Estimate { milli_bytes_per_token: 3500 });
        assert_eq!(c.parts.plan.limits.max_tokens, 20_000);
        let mut bad = base.to_vec();
        bad.extend([
            ("REVIEWLANE_TOKENIZER", "words"),
            ("REVIEWLANE_BYTES_PER_TOKEN", "0.5"),
            ("REVIEWLANE_PART_FILL_PERCENT", "0"),
            ("REVIEWLANE_MAX_PARTS", "0"),
        ]);
        let errs = ExtractorConfig::from_env(&env(&bad)).unwrap_err();
        assert_eq!(errs.0.len(), 4, "{errs}");
    }

    #[test]
    fn reports_all_missing() {
        let errs =
            ExtractorConfig::from_env(&env(&[("REVIEWLANE_PROVIDER", "openai"), ("REVIEWLANE_CONCURRENCY", "0")]))
                .unwrap_err();
        // region, nats url, base url, model, provider region, concurrency
        assert_eq!(errs.0.len(), 6, "{errs}");
    }
}
