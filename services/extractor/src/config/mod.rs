//! Extractor configuration, read once and validated whole, in sections, one file each:
//! the provider, the quota, scheduling, retries, parts, results and provider batches.
//! The variables are listed in `env.rs` and documented in `docs/configuration.md`
//! ("Extractor").

mod batch;
mod parts;
mod pool;
mod provider;
mod quota;
mod results;
mod retry;
mod scheduling;

use std::sync::Arc;
use std::time::Duration;

use reviewlane_core::config::{ConfigErrors, Env, Reader};
use reviewlane_core::tenants::Tenants;
use reviewlane_shared::Region;

use crate::env;

pub use batch::{BatchSettings, ResubmitVia};
pub use parts::{PartConfig, fit_parts_to_budget};
pub use pool::DeploymentConfig;
pub use provider::{AzureAuth, AzureDeployment, Price, ProviderConfig, parse_prices};
pub use quota::QuotaSettings;
pub use results::{ReconcileConfig, ResultSettings};
pub use retry::{Budgets, RetrySettings};
pub use scheduling::SchedulingSettings;

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
    /// The provider endpoint this extractor calls: the pool's first deployment (its
    /// sweeps' batch API, and the part plan's model).
    pub provider: ProviderConfig,
    /// The pool's other deployments (`REVIEWLANE_DEPLOYMENTS_FILE`).
    pub pool: Vec<DeploymentConfig>,
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
            pool: Vec::new(),
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
        let provider = provider::read_provider(&mut r, region);
        let model = provider.as_ref().map_or("builtin", ProviderConfig::model).to_string();
        let quota = QuotaSettings::read(&mut r, &model);
        let first_id = provider.as_ref().map_or("builtin", ProviderConfig::kind);
        let pool = pool::read_pool(&mut r, region, first_id, (&quota.model_class, quota.key_limit));
        let scheduling = SchedulingSettings::read(&mut r);
        let retry = RetrySettings::read(&mut r);
        let mut parts = parts::read_parts(&mut r, &provider);
        if provider.is_some()
            && let Err(e) = fit_parts_to_budget(&mut parts, &quota.budgets, parts::p_output(&provider))
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
            pool,
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn an_azure_deployment_is_read_checked_and_bound_to_its_region() {
        let azure = |extra: &[(&'static str, &'static str)]| {
            let mut pairs = vec![
                (reviewlane_core::env::REGION, "eu"),
                (reviewlane_core::env::NATS_URL, "nats://x"),
                (env::PROVIDER, "azure"),
                (env::AZURE_ENDPOINT, "https://reviews-eu.openai.azure.com"),
                (env::AZURE_DEPLOYMENT, "gpt-4o-mini-eu"),
                (env::AZURE_MODEL, "gpt-4o-mini"),
                (env::PROVIDER_REGION, "eu"),
            ];
            for (k, v) in extra {
                pairs.retain(|(name, _)| name != k);
                pairs.push((k, v));
            }
            ExtractorConfig::from_env(&env(&pairs))
        };
        let c = azure(&[(env::AZURE_API_KEY, "azure-secret-key")]).unwrap();
        let ProviderConfig::AzureOpenAi(AzureDeployment {
            deployment, model, api_version, auth, endpoint_region, ..
        }) = &c.provider
        else {
            panic!("{:?}", c.provider)
        };
        assert_eq!((deployment.as_str(), model.as_str()), ("gpt-4o-mini-eu", "gpt-4o-mini"));
        assert_eq!(api_version, provider::AZURE_API_VERSION_DEFAULT);
        assert!(matches!(auth, AzureAuth::ApiKey(Some(_))));
        assert_eq!(*endpoint_region, Region::Eu);
        // Prices, the part plan and the cache follow the model, not the deployment's name.
        assert_eq!(c.provider.model(), "gpt-4o-mini");
        let c = azure(&[
            (env::AZURE_TOKEN_FILE, "/var/run/secrets/azure/token"),
            (env::AZURE_API_VERSION, "2025-01-01-preview"),
        ])
        .unwrap();
        let ProviderConfig::AzureOpenAi(AzureDeployment { auth, api_version, .. }) = &c.provider else {
            unreachable!()
        };
        assert!(matches!(auth, AzureAuth::TokenFile(p) if p.ends_with("token")));
        assert_eq!(api_version, "2025-01-01-preview");

        // A deployment in another region refuses the start, naming no secret.
        let errs = azure(&[(env::PROVIDER_REGION, "us"), (env::AZURE_API_KEY, "azure-secret-key")]).unwrap_err();
        assert!(errs.to_string().contains("`us`") && errs.to_string().contains("`eu`"), "{errs}");
        assert!(!errs.to_string().contains("azure-secret-key"));
        // A name that would change the URL's path or query, two credentials, a missing deployment.
        let errs = azure(&[(env::AZURE_DEPLOYMENT, "a/../b?x=1")]).unwrap_err();
        assert!(errs.to_string().contains(env::AZURE_DEPLOYMENT), "{errs}");
        let errs = azure(&[(env::AZURE_API_VERSION, "2024-10-21&x=1")]).unwrap_err();
        assert!(errs.to_string().contains(env::AZURE_API_VERSION), "{errs}");
        let errs = azure(&[(env::AZURE_TOKEN_FILE, "/t"), (env::AZURE_API_KEY, "k")]).unwrap_err();
        assert!(errs.to_string().contains("both"), "{errs}");
        let errs = azure(&[(env::AZURE_DEPLOYMENT, "")]).unwrap_err();
        assert!(errs.to_string().contains(env::AZURE_DEPLOYMENT), "{errs}");
        let errs = azure(&[(env::AZURE_BATCH_DEPLOYMENT, "batch/../x")]).unwrap_err();
        assert!(errs.to_string().contains(env::AZURE_BATCH_DEPLOYMENT), "{errs}");
        // A global batch deployment for sweeps, or none.
        let c = azure(&[(env::AZURE_BATCH_DEPLOYMENT, "gpt-4o-mini-batch")]).unwrap();
        let ProviderConfig::AzureOpenAi(d) = &c.provider else { unreachable!() };
        assert_eq!(d.batch_deployment.as_deref(), Some("gpt-4o-mini-batch"));
        let c = azure(&[]).unwrap();
        let ProviderConfig::AzureOpenAi(d) = &c.provider else { unreachable!() };
        assert_eq!(d.batch_deployment, None);
    }

    #[test]
    fn a_deployments_file_adds_deployments_each_checked_and_bound_to_the_region() {
        let dir = std::env::temp_dir().join(format!("reviewlane-x-pool-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        std::fs::write(&key, "pool-secret-key\n").unwrap();
        let file = |text: &str| {
            let path = dir.join(format!("pool-{}.toml", text.len()));
            std::fs::write(&path, text.replace("KEY", &key.display().to_string())).unwrap();
            path.display().to_string()
        };
        let config = |path: &str| {
            ExtractorConfig::from_env(&env(&[
                (reviewlane_core::env::REGION, "eu"),
                (reviewlane_core::env::NATS_URL, "nats://x"),
                (env::PROVIDER, "openai"),
                (env::OPENAI_BASE_URL, "https://api.example/v1"),
                (env::OPENAI_MODEL, "gpt-4o-mini"),
                (env::PROVIDER_REGION, "eu"),
                (env::MODEL_CLASS, "fast"),
                (env::KEY_LIMIT, "6"),
                (env::DEPLOYMENTS_FILE, path),
            ]))
        };
        let two = file(
            r#"
[[deployments]]
id = "azure-eu-1"
kind = "azure"
endpoint = "https://reviews-eu.openai.azure.com"
deployment = "gpt-4o-mini-eu"
model = "gpt-4o-mini"
region = "eu"
api_key_file = "KEY"
budgets = "rpm=300,tpm=50000"

[[deployments]]
id = "claude-eu"
kind = "anthropic"
class = "deep"
endpoint = "https://anthropic.example"
model = "claude-sonnet"
region = "eu"
key_limit = 3
price = "3/15"
"#,
        );
        let c = config(&two).unwrap();
        assert_eq!(c.pool.len(), 2);
        let (azure, claude) = (&c.pool[0], &c.pool[1]);
        assert_eq!((azure.id.as_str(), azure.class.as_str(), azure.key_limit), ("azure-eu-1", "fast", 6), "defaults");
        assert!(
            matches!(&azure.provider, ProviderConfig::AzureOpenAi(d) if matches!(d.auth, AzureAuth::ApiKey(Some(_))))
        );
        assert_eq!(azure.budgets.len(), 2);
        assert_eq!((claude.class.as_str(), claude.key_limit), ("deep", 3));
        assert_eq!(claude.price, Some(Price { input_per_mtok: 3.0, output_per_mtok: 15.0 }));

        let refused = |text: &str, says: &str| {
            let errs = config(&file(text)).unwrap_err().to_string();
            assert!(errs.contains(says), "{says}: {errs}");
            assert!(!errs.contains("pool-secret-key"), "{errs}");
        };
        let one = |extra: &str| {
            format!(
                "[[deployments]]\nid = \"x-1\"\nkind = \"openai\"\nendpoint = \"https://o.example/v1\"\nmodel = \"m\"\nregion = \"eu\"\napi_key_file = \"KEY\"\n{extra}"
            )
        };
        // Residency: a deployment of another region refuses the start, naming it.
        refused(
            &one("").replace("region = \"eu\"", "region = \"us\""),
            "deployment `x-1`: its endpoint belongs to region `us`",
        );
        refused(&format!("{}\n{}", one(""), one("")), "its id is taken");
        refused(&one("").replace("x-1", "openai"), "its id is taken");
        refused(&one("").replace("x-1", "a.b"), "its id may hold only");
        refused(&one("").replace("kind = \"openai\"", "kind = \"bedrock\""), "its kind");
        refused(&one("budgets = \"rpm=0\""), "its budgets");
        refused(&one("key_limit = 0"), "key_limit");
        refused(&one("").replace("\nmodel = \"m\"", ""), "not a deployments file");
        refused(&one("").replace("kind = \"openai\"", "kind = \"azure\""), "deployment` name");
        std::fs::remove_dir_all(&dir).unwrap();
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
