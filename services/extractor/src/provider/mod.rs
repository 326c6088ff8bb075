//! Provider adapters: one trait, one adapter per provider contract. An adapter is built
//! for one region and refuses content of another.

pub mod anthropic;
pub mod builtin;
pub mod openai;

use futures::future::BoxFuture;
use reviewlane_core::diff::Diff;
use reviewlane_core::job::ReviewDepth;
use reviewlane_shared::Region;

use crate::upstream::UpstreamOutcome;

/// What a provider is asked. Content: never logged.
pub struct ProviderRequest<'a> {
    pub job_id: &'a str,
    pub region: Region,
    pub schema_version: &'a str,
    pub diff_text: &'a str,
    pub diff: &'a Diff,
    pub review_depth: ReviewDepth,
    /// The part of a split review this call answers (`None`: the whole review).
    pub part: Option<u32>,
}

/// Header naming the part of a split review a call answers (an index, never content).
pub const PART_HEADER: &str = "x-reviewlane-part";

/// Names the job (and the part) on a provider call, for the provider's logs and support.
pub(crate) fn identify(rb: reqwest::RequestBuilder, req: &ProviderRequest<'_>) -> reqwest::RequestBuilder {
    let rb = rb.header(openai::JOB_ID_HEADER, req.job_id);
    match req.part {
        Some(i) => rb.header(PART_HEADER, i.to_string()),
        None => rb,
    }
}

pub trait Provider: Send + Sync + 'static {
    /// Short fixed name for labels: `builtin`, `openai`, `anthropic`.
    fn name(&self) -> &'static str;
    /// The region this adapter's endpoint belongs to.
    fn region(&self) -> Region;
    /// One call. Implementations return `Permanent` for a request of another region.
    fn review<'a>(&'a self, req: &'a ProviderRequest<'a>) -> BoxFuture<'a, UpstreamOutcome>;
}

/// Version of the instructions the adapters send; part of the result-cache key, so a
/// changed prompt never serves answers to the old one. Bump it with any prompt change.
pub const PROMPT_VERSION: &str = "prompt.v2";

/// The instructions a call is sent with: the reviewer's task, then what the depth, the
/// schema version and a split review add.
pub(crate) fn instructions(req: &ProviderRequest<'_>) -> String {
    let mut text = openai::SYSTEM_PROMPT.to_string();
    if req.review_depth == ReviewDepth::ChangedHunks {
        text = format!("{text} {}", openai::CHANGED_HUNKS_PROMPT);
    }
    if req.schema_version == reviewlane_core::findings::FINDINGS_V2 {
        text = format!("{text} {}", openai::V2_PROMPT);
    }
    if req.part.is_some() {
        text = format!("{text} {}", openai::PART_PROMPT);
    }
    text
}

/// Everything a call sends besides the diff, at its longest: every instruction and the
/// largest findings schema (what the token budgets reserve on top of the diff's tokens;
/// the answer's usage corrects the estimate).
pub fn fixed_prompt() -> String {
    let schema = reviewlane_core::findings::known_schemas()
        .into_iter()
        .filter_map(reviewlane_core::findings::schema_document)
        .map(|d| d.to_string())
        .max_by_key(String::len)
        .unwrap_or_default();
    [openai::SYSTEM_PROMPT, openai::CHANGED_HUNKS_PROMPT, openai::V2_PROMPT, openai::PART_PROMPT, &schema].join(" ")
}

/// Status of a request the adapter refuses to send (another region's content).
pub const REFUSED_OTHER_REGION: u16 = 421;

/// The diff text a provider is shown: as submitted, or at degraded depth
/// (`changed_hunks`) only the changed lines with one line of context either side, line
/// numbers unchanged (findings on it validate against the whole diff).
pub fn prompt_diff<'a>(review: &'a reviewlane_core::messages::ReviewMessage, diff: &Diff) -> std::borrow::Cow<'a, str> {
    match review.review_depth {
        ReviewDepth::Full => review.diff_text(),
        ReviewDepth::ChangedHunks => std::borrow::Cow::Owned(reviewlane_core::diff::changed_lines_only(diff, 1)),
    }
}

/// Every known findings schema as one provider dialect accepts it, full and compact (for
/// reviews at degraded depth), projected once. Answers are always held to the full
/// schema by the validator.
#[derive(Default)]
pub struct DialectSchemas(std::collections::HashMap<&'static str, (serde_json::Value, serde_json::Value)>);

impl DialectSchemas {
    pub fn new(dialect: reviewlane_core::schema_dialect::SchemaDialect) -> Self {
        use reviewlane_core::{findings, schema_dialect};
        DialectSchemas(
            findings::known_schemas()
                .into_iter()
                .filter_map(|v| {
                    let full = schema_dialect::project(findings::schema_document(v)?, dialect);
                    let compact = schema_dialect::project(&findings::compact_schema_document(v)?, dialect);
                    Some((v, (full, compact)))
                })
                .collect(),
        )
    }

    /// The schema a request is sent with (projected once, at start; serialized from
    /// here into each request without a copy).
    pub fn for_request(&self, req: &ProviderRequest<'_>) -> &serde_json::Value {
        static NONE: serde_json::Value = serde_json::Value::Null;
        let degraded = req.review_depth == ReviewDepth::ChangedHunks;
        self.0.get(req.schema_version).map_or(&NONE, |(full, compact)| if degraded { compact } else { full })
    }
}

/// How an adapter turns a provider's HTTP answer into an outcome.
pub type Classify = fn(u16, &http::HeaderMap, &[u8], std::time::SystemTime, std::time::Duration) -> UpstreamOutcome;

/// The HTTP client every adapter calls with: a whole-call timeout, a connect timeout,
/// pooled connections.
/// How a request to a provider proves who it is.
pub(crate) enum Auth {
    None,
    /// `Authorization: Bearer <key>`.
    Bearer(secrecy::SecretString),
    /// Azure's `api-key: <key>`.
    ApiKeyHeader(secrecy::SecretString),
    /// `Authorization: Bearer <token>`, the token read from this file at each request
    /// (whatever renews it rewrites the file).
    BearerFile(std::path::PathBuf),
}

/// The token file could not be read (being renewed, or not mounted yet).
#[derive(Debug)]
pub(crate) struct NoCredential;

impl Auth {
    /// How an Azure OpenAI deployment configured with `auth` is called.
    pub(crate) fn azure(auth: &crate::config::AzureAuth) -> Auth {
        match auth {
            crate::config::AzureAuth::ApiKey(key) => key.clone().map_or(Auth::None, Auth::ApiKeyHeader),
            crate::config::AzureAuth::TokenFile(path) => Auth::BearerFile(path.clone()),
        }
    }

    /// `rb` with its credential.
    pub(crate) async fn apply(&self, rb: reqwest::RequestBuilder) -> Result<reqwest::RequestBuilder, NoCredential> {
        use secrecy::ExposeSecret;
        Ok(match self {
            Auth::None => rb,
            Auth::Bearer(key) => rb.bearer_auth(key.expose_secret()),
            Auth::ApiKeyHeader(key) => rb.header("api-key", key.expose_secret()),
            Auth::BearerFile(path) => match tokio::fs::read_to_string(path).await {
                Ok(token) => rb.bearer_auth(token.trim()),
                Err(_) => {
                    tracing::warn!("the provider token file cannot be read");
                    return Err(NoCredential);
                }
            },
        })
    }
}

pub(crate) fn http_client(timeout: std::time::Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(std::time::Duration::from_secs(10))
        .pool_max_idle_per_host(64)
        .build()
        .expect("reqwest client builds")
}

/// Sends a prepared call and classifies the answer, reading at most `cap` bytes of it.
/// An answer over the cap is unusable as output: the schema path decides (a retry within
/// its budget), never an unbounded read; errors are classified from their headers and
/// the start of their body.
pub(crate) async fn send(
    rb: reqwest::RequestBuilder,
    cap: usize,
    hint_ceiling: std::time::Duration,
    classify: Classify,
) -> UpstreamOutcome {
    let resp = match rb.send().await {
        Ok(r) => r,
        Err(e) if e.is_timeout() => return UpstreamOutcome::Transient { status_class: "timeout" },
        Err(_) => return UpstreamOutcome::Transient { status_class: "connect" },
    };
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let now = std::time::SystemTime::now();
    match read_capped(resp, cap).await {
        Ok((body, false)) => classify(status, &headers, &body, now, hint_ceiling),
        Ok((_, true)) if (200..300).contains(&status) => {
            tracing::warn!(cap, "provider answer over the size cap; treated as invalid output");
            UpstreamOutcome::Ok { output: String::new(), slow_down: None, usage: None, meter: Default::default() }
        }
        Ok((body, true)) => classify(status, &headers, &body, now, hint_ceiling),
        Err(e) if e.is_timeout() => UpstreamOutcome::Transient { status_class: "timeout" },
        Err(_) => UpstreamOutcome::Transient { status_class: "reset" },
    }
}

/// Reads at most `cap` bytes of the body; `true` when there was more.
async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if body.len() + chunk.len() > cap {
            body.extend_from_slice(&chunk[..cap - body.len()]);
            return Ok((body, true));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, false))
}

/// Runs `call` unless the request's content belongs to another region than the
/// adapter's endpoint, which is refused without sending anything.
pub(crate) fn in_region<'a>(
    adapter: Region,
    req: &'a ProviderRequest<'a>,
    call: impl std::future::Future<Output = UpstreamOutcome> + Send + 'a,
) -> BoxFuture<'a, UpstreamOutcome> {
    use futures::FutureExt;
    if req.region != adapter {
        return futures::future::ready(UpstreamOutcome::Permanent { status: REFUSED_OTHER_REGION }).boxed();
    }
    call.boxed()
}
