//! The provider section: which endpoint this extractor calls, with which model and key
//! (`REVIEWLANE_PROVIDER` and the chosen provider's settings), and what its tokens cost.

use reviewlane_shared::Region;

use crate::env;
use reviewlane_core::config::Reader;
use reviewlane_core::schema_dialect::SchemaDialect;
use secrecy::SecretString;

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
    /// An Azure OpenAI deployment.
    AzureOpenAi(AzureDeployment),
}

/// An Azure OpenAI deployment: called at `{endpoint}/openai/deployments/{deployment}/
/// chat/completions?api-version={api_version}`.
#[derive(Debug, Clone)]
pub struct AzureDeployment {
    /// The resource's endpoint, e.g. `https://my-resource.openai.azure.com`.
    pub endpoint: String,
    pub deployment: String,
    /// The model the deployment serves: prices, the part plan and the result cache.
    pub model: String,
    pub api_version: String,
    pub auth: AzureAuth,
    pub endpoint_region: Region,
    pub schema_dialect: SchemaDialect,
    /// The resource's Global Batch deployment of the same model, if sweeps may use
    /// Azure's Batch API.
    pub batch_deployment: Option<String>,
}

/// How calls to an Azure OpenAI deployment authenticate.
#[derive(Debug, Clone)]
pub enum AzureAuth {
    /// The resource's key, in the `api-key` header.
    ApiKey(Option<SecretString>),
    /// A Microsoft Entra ID access token as a bearer token, read from this file at each
    /// call (whatever renews it rewrites the file: tokens last about an hour).
    TokenFile(std::path::PathBuf),
}

impl ProviderConfig {
    /// Output tokens the provider counts against a token budget when a call starts (the
    /// request's output limit; the built-in analyzer is not metered).
    pub fn output_reserve(&self) -> u32 {
        match self {
            ProviderConfig::Builtin => 0,
            ProviderConfig::OpenAi { .. } | ProviderConfig::AzureOpenAi(_) => {
                crate::provider::openai::MAX_OUTPUT_TOKENS
            }
            ProviderConfig::Anthropic { max_tokens, .. } => *max_tokens,
        }
    }

    /// The dimensions this provider enforces over a shorter window than their period.
    /// Azure OpenAI: "the rate of incoming requests over a small period of time,
    /// typically 1 or 10 seconds" (its quota documentation) — rpm / 6 requests per 10 s.
    pub fn enforced_windows(&self) -> Vec<(reviewlane_core::meter::Dimension, std::time::Duration)> {
        match self {
            ProviderConfig::AzureOpenAi(_) => {
                vec![(reviewlane_core::meter::Dimension::Requests, std::time::Duration::from_secs(10))]
            }
            _ => Vec::new(),
        }
    }

    /// The model called (`builtin` for the built-in analyzer).
    pub fn model(&self) -> &str {
        match self {
            ProviderConfig::Builtin => "builtin",
            ProviderConfig::OpenAi { model, .. }
            | ProviderConfig::Anthropic { model, .. }
            | ProviderConfig::AzureOpenAi(AzureDeployment { model, .. }) => model,
        }
    }

    /// The provider's kind, as its adapter names itself (`Provider::name`).
    pub fn kind(&self) -> &'static str {
        match self {
            ProviderConfig::Builtin => "builtin",
            ProviderConfig::OpenAi { .. } => "openai",
            ProviderConfig::Anthropic { .. } => "anthropic",
            ProviderConfig::AzureOpenAi(_) => "azure",
        }
    }

    /// The region the endpoint processes data in (`None`: the built-in analyzer, which
    /// runs in the extractor).
    pub fn endpoint_region(&self) -> Option<Region> {
        match self {
            ProviderConfig::Builtin => None,
            ProviderConfig::OpenAi { endpoint_region, .. }
            | ProviderConfig::Anthropic { endpoint_region, .. }
            | ProviderConfig::AzureOpenAi(AzureDeployment { endpoint_region, .. }) => Some(*endpoint_region),
        }
    }
}

/// Azure's REST API version the adapter sends when none is configured: the latest
/// generally available one with structured outputs.
pub const AZURE_API_VERSION_DEFAULT: &str = "2024-10-21";

/// Whether `s` may stand in a URL path segment or query value as is: a deployment name
/// or an API version (letters, digits, `-`, `_`, `.`).
pub(super) fn url_safe(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
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

/// `REVIEWLANE_PROVIDER` and the chosen provider's settings; an endpoint bound to
/// another region than the extractor's is refused.
pub(super) fn read_provider(r: &mut Reader<'_>, region: Option<Region>) -> Option<ProviderConfig> {
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
        "azure" => {
            let found = endpoint(
                r,
                env::AZURE_ENDPOINT,
                "the resource's endpoint, e.g. https://my-resource.openai.azure.com",
                env::AZURE_MODEL,
            );
            let deployment: Option<String> = r.required(env::AZURE_DEPLOYMENT, "deployment name");
            if deployment.as_deref().is_some_and(|d| !url_safe(d)) {
                r.error("REVIEWLANE_AZURE_DEPLOYMENT may hold only letters, digits, `-`, `_` and `.`");
            }
            let batch_deployment = r.raw(env::AZURE_BATCH_DEPLOYMENT);
            if batch_deployment.as_deref().is_some_and(|d| !url_safe(d)) {
                r.error("REVIEWLANE_AZURE_BATCH_DEPLOYMENT may hold only letters, digits, `-`, `_` and `.`");
            }
            let api_version = r.raw(env::AZURE_API_VERSION).unwrap_or_else(|| AZURE_API_VERSION_DEFAULT.into());
            if !url_safe(&api_version) {
                r.error("REVIEWLANE_AZURE_API_VERSION is not an API version such as 2024-10-21");
            }
            let auth = match r.raw(env::AZURE_TOKEN_FILE) {
                Some(path) if r.raw(env::AZURE_API_KEY_FILE).is_some() || r.raw(env::AZURE_API_KEY).is_some() => {
                    r.error("REVIEWLANE_AZURE_TOKEN_FILE and an Azure API key are both set; set one");
                    AzureAuth::TokenFile(path.into())
                }
                Some(path) => AzureAuth::TokenFile(path.into()),
                None => AzureAuth::ApiKey(api_key(r, env::AZURE_API_KEY_FILE, env::AZURE_API_KEY)),
            };
            let schema_dialect = SchemaDialect::default();
            match (found, deployment) {
                (Some((endpoint, model, endpoint_region)), Some(deployment)) => {
                    Some(ProviderConfig::AzureOpenAi(AzureDeployment {
                        endpoint,
                        deployment,
                        model,
                        api_version,
                        auth,
                        endpoint_region,
                        schema_dialect,
                        batch_deployment,
                    }))
                }
                _ => None,
            }
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
            r.error("REVIEWLANE_PROVIDER has an invalid value (`builtin`, `openai`, `anthropic` or `azure`)");
            None
        }
    };
    let endpoint_region = provider.as_ref().and_then(ProviderConfig::endpoint_region);
    if let (Some(region), Some(endpoint_region)) = (region, endpoint_region)
        && endpoint_region != region
    {
        r.error(format!(
            "provider endpoint belongs to region `{endpoint_region}` but this extractor serves `{region}`; refusing to send `{region}` content there"
        ));
    }
    provider
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
}
