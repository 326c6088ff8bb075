//! The pool section: the deployments a region calls besides the one `REVIEWLANE_PROVIDER`
//! names, from `REVIEWLANE_DEPLOYMENTS_FILE` (TOML, one `[[deployments]]` table each).
//! Each is its own provider key with its own limits, and serves one model class.
//!
//! ```toml
//! [[deployments]]
//! id = "azure-us-2"              # its name in metrics, scopes and its key
//! kind = "azure"                 # openai | anthropic | azure
//! class = "fast"                 # default: REVIEWLANE_MODEL_CLASS
//! endpoint = "https://reviews-us.openai.azure.com"   # the API's base URL
//! model = "gpt-4o-mini"
//! region = "us"                  # where it processes data: the extractor's region
//! api_key_file = "/var/run/secrets/azure-us-2/key"
//! deployment = "gpt-4o-mini-us"  # azure: the deployment's name
//! key_limit = 8                  # default: REVIEWLANE_KEY_LIMIT
//! budgets = "rpm=300,tpm=50000"  # default: learned from the answers
//! price = "0.15/0.60"            # dollars per million tokens in/out; default: REVIEWLANE_MODEL_PRICES
//! preference = 1                 # lower goes first in its class (default 0); then the cheaper
//! ```

use std::collections::HashSet;

use reviewlane_core::config::Reader;
use reviewlane_core::meter::Dimension;
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_shared::Region;
use secrecy::SecretString;
use serde::Deserialize;

use super::provider::{AZURE_API_VERSION_DEFAULT, AzureAuth, AzureDeployment, Price, ProviderConfig, url_safe};
use crate::env;

/// One more deployment of the region's pool.
#[derive(Debug, Clone)]
pub struct DeploymentConfig {
    pub id: String,
    pub class: String,
    pub provider: ProviderConfig,
    /// Calls in flight on its key across the fleet.
    pub key_limit: u32,
    /// Its key's configured limits (the others are learned).
    pub budgets: Vec<(Dimension, u64)>,
    /// Its price, when the file gives one (else the prices table's, by model).
    pub price: Option<Price>,
    /// Lower goes first among its class's deployments (default 0, the first
    /// deployment's); at the same preference the cheaper goes first.
    pub preference: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    deployments: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    id: String,
    kind: String,
    class: Option<String>,
    endpoint: String,
    model: String,
    region: Region,
    api_key_file: Option<String>,
    token_file: Option<String>,
    deployment: Option<String>,
    api_version: Option<String>,
    max_tokens: Option<u32>,
    schema_dialect: Option<String>,
    key_limit: Option<u32>,
    budgets: Option<String>,
    price: Option<String>,
    preference: Option<u32>,
}

/// The deployments `REVIEWLANE_DEPLOYMENTS_FILE` lists (none when it is not set). Each
/// must process data in `region` (a deployment of another region refuses the start),
/// have an id of its own, and name what its kind needs; `first_id` is the id of the
/// deployment `REVIEWLANE_PROVIDER` configures. Errors name the entry, never a key.
pub(super) fn read_pool(
    r: &mut Reader<'_>,
    region: Option<Region>,
    first_id: &str,
    defaults: (&str, u32),
) -> Vec<DeploymentConfig> {
    let Some(path) = r.raw(env::DEPLOYMENTS_FILE) else { return Vec::new() };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(_) => {
            r.error("REVIEWLANE_DEPLOYMENTS_FILE names a file that cannot be read");
            return Vec::new();
        }
    };
    let file: File = match toml::from_str(&text) {
        Ok(f) => f,
        Err(e) => {
            r.error(format!("REVIEWLANE_DEPLOYMENTS_FILE is not a deployments file: {}", e.message()));
            return Vec::new();
        }
    };
    let mut ids: HashSet<String> = HashSet::from([first_id.to_string()]);
    let mut out = Vec::new();
    for entry in file.deployments {
        let id = entry.id.clone();
        let mut errors = Vec::new();
        if !url_safe(&id) || id.contains('.') {
            errors.push("its id may hold only letters, digits, `-` and `_`".to_string());
        } else if !ids.insert(id.clone()) {
            errors.push("its id is taken by another deployment".to_string());
        }
        match deployment(entry, region, defaults) {
            Ok(d) if errors.is_empty() => out.push(d),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
        for e in errors {
            r.error(format!("deployment `{id}`: {e}"));
        }
    }
    out
}

fn deployment(e: Entry, region: Option<Region>, (class, key_limit): (&str, u32)) -> Result<DeploymentConfig, String> {
    if let Some(region) = region
        && e.region != region
    {
        return Err(format!(
            "its endpoint belongs to region `{}` but this extractor serves `{region}`; refusing to send `{region}` content there",
            e.region
        ));
    }
    if !(e.endpoint.starts_with("http://") || e.endpoint.starts_with("https://")) {
        return Err("its endpoint must be an http(s) URL".into());
    }
    let key = |file: &Option<String>| -> Result<Option<SecretString>, String> {
        match file {
            None => Ok(None),
            Some(path) => std::fs::read_to_string(path)
                .map(|k| Some(SecretString::from(k.trim().to_string())))
                .map_err(|_| "its api_key_file cannot be read".to_string()),
        }
    };
    let schema_dialect = match &e.schema_dialect {
        None => SchemaDialect::default(),
        Some(v) => v.parse().map_err(|()| "its schema_dialect is not a known dialect".to_string())?,
    };
    let provider = match e.kind.as_str() {
        "openai" => ProviderConfig::OpenAi {
            base_url: e.endpoint,
            model: e.model,
            api_key: key(&e.api_key_file)?,
            endpoint_region: e.region,
            schema_dialect,
        },
        "anthropic" => ProviderConfig::Anthropic {
            base_url: e.endpoint,
            model: e.model,
            api_key: key(&e.api_key_file)?,
            endpoint_region: e.region,
            max_tokens: e.max_tokens.unwrap_or(4096),
        },
        "azure" => {
            let deployment =
                e.deployment.filter(|d| url_safe(d)).ok_or("an azure deployment needs its `deployment` name")?;
            let api_version = e.api_version.unwrap_or_else(|| AZURE_API_VERSION_DEFAULT.into());
            if !url_safe(&api_version) {
                return Err("its api_version is not an API version such as 2024-10-21".into());
            }
            let auth = match (&e.token_file, &e.api_key_file) {
                (Some(_), Some(_)) => return Err("both token_file and api_key_file are set; set one".into()),
                (Some(t), None) => AzureAuth::TokenFile(t.into()),
                (None, _) => AzureAuth::ApiKey(key(&e.api_key_file)?),
            };
            ProviderConfig::AzureOpenAi(AzureDeployment {
                endpoint: e.endpoint,
                deployment,
                model: e.model,
                api_version,
                auth,
                endpoint_region: e.region,
                schema_dialect,
                batch_deployment: None,
            })
        }
        _ => return Err("its kind is not `openai`, `anthropic` or `azure`".into()),
    };
    let budgets = reviewlane_core::meter::parse_budgets(e.budgets.as_deref().unwrap_or_default())
        .map_err(|e| format!("its budgets: {e}"))?;
    let price = match &e.price {
        None => None,
        Some(p) => {
            let table = super::provider::parse_prices(&format!("m={p}")).map_err(|e| format!("its price: {e}"))?;
            table.get("m").copied()
        }
    };
    let key_limit = e.key_limit.unwrap_or(key_limit);
    if key_limit == 0 {
        return Err("its key_limit must be positive".into());
    }
    Ok(DeploymentConfig {
        id: e.id,
        class: e.class.unwrap_or_else(|| class.to_string()),
        provider,
        key_limit,
        budgets,
        price,
        preference: e.preference.unwrap_or(0),
    })
}
