//! OpenAI-compatible chat completions with structured outputs (`response_format`
//! `json_schema`, strict). Works with OpenAI, vLLM, Ollama and LiteLLM endpoints.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use reviewlane_shared::Region;
use reviewlane_shared::findings;
use reviewlane_shared::job::ReviewDepth;
use reviewlane_shared::schema_dialect::{self, SchemaDialect};
use secrecy::{ExposeSecret, SecretString};

use super::{Provider, ProviderRequest, REFUSED_OTHER_REGION};
use crate::upstream::{UpstreamOutcome, classify};

/// Header carrying the job id (metadata) so a provider or proxy can correlate calls.
pub const JOB_ID_HEADER: &str = "x-reviewlane-job-id";

pub(super) const SYSTEM_PROMPT: &str = "You are a meticulous code reviewer. Review the unified diff the user sends. \
Report only real problems in added lines: security issues (hard-coded secrets, injection, eval), \
correctness and reliability bugs (panics, unchecked errors), leftover debug output, and TODO/FIXME notes. \
For each finding give the file path exactly as on the diff's new side (`+++ b/<path>`, without `b/`), \
the line number on the new side, a severity, a category, a short title, a message explaining the problem \
and the fix, and `evidence`: text copied verbatim from that line. Answer with JSON that matches the schema; \
an empty `findings` list is a valid answer.";

/// Added at depth `changed_hunks`, when admission degraded the review under load.
pub(super) const CHANGED_HUNKS_PROMPT: &str = "The service is under load: review only the changed lines, report only problems \
of medium severity or higher, and keep messages short.";

pub struct OpenAiProvider {
    http: reqwest::Client,
    endpoint: String,
    model: String,
    api_key: Option<SecretString>,
    region: Region,
    hint_ceiling: Duration,
    /// Largest response body read; a longer one is cut there.
    max_response_bytes: usize,
    /// Each known schema version as this endpoint's dialect accepts it.
    schemas: std::collections::HashMap<&'static str, serde_json::Value>,
}

impl OpenAiProvider {
    pub fn new(
        base_url: &str,
        model: String,
        api_key: Option<SecretString>,
        region: Region,
        timeout: Duration,
        hint_ceiling: Duration,
        max_response_bytes: usize,
    ) -> Self {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(64)
            .build()
            .expect("reqwest client builds");
        OpenAiProvider {
            http,
            endpoint: format!("{}/chat/completions", base_url.trim_end_matches('/')),
            model,
            api_key,
            region,
            hint_ceiling,
            max_response_bytes,
            schemas: Default::default(),
        }
        .with_schema_dialect(SchemaDialect::default())
    }

    /// Sends each schema as `dialect` accepts it.
    pub fn with_schema_dialect(mut self, dialect: SchemaDialect) -> Self {
        self.schemas = findings::known_schemas()
            .into_iter()
            .filter_map(|v| Some((v, schema_dialect::project(findings::schema_document(v)?, dialect))))
            .collect();
        self
    }

    fn body(&self, req: &ProviderRequest<'_>) -> serde_json::Value {
        // The schema as this endpoint's dialect takes it; the answer is held to the full
        // schema by our validator.
        let schema = self.schemas.get(req.schema_version).cloned().unwrap_or_default();
        serde_json::json!({
            "model": self.model,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": match req.review_depth {
                    ReviewDepth::Full => SYSTEM_PROMPT.to_string(),
                    ReviewDepth::ChangedHunks => format!("{SYSTEM_PROMPT} {CHANGED_HUNKS_PROMPT}"),
                }},
                {"role": "user", "content": req.diff_text},
            ],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": req.schema_version.replace('.', "_"), "strict": true, "schema": schema},
            },
        })
    }

    async fn call(&self, req: &ProviderRequest<'_>) -> UpstreamOutcome {
        let mut rb = self.http.post(&self.endpoint).header(JOB_ID_HEADER, req.job_id).json(&self.body(req));
        if let Some(key) = &self.api_key {
            rb = rb.bearer_auth(key.expose_secret());
        }
        let resp = match rb.send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return UpstreamOutcome::Transient { status_class: "timeout" },
            Err(_) => return UpstreamOutcome::Transient { status_class: "connect" },
        };
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        match read_capped(resp, self.max_response_bytes).await {
            Ok((body, false)) => classify(status, &headers, &body, std::time::SystemTime::now(), self.hint_ceiling),
            // An answer over the cap is unusable as output: the schema path decides (a
            // retry within its budget), never an unbounded read. Errors are classified
            // from their headers and the start of their body.
            Ok((_, true)) if (200..300).contains(&status) => {
                tracing::warn!(
                    cap = self.max_response_bytes,
                    "provider answer over the size cap; treated as invalid output"
                );
                UpstreamOutcome::Ok { output: String::new(), slow_down: None, usage: None }
            }
            Ok((body, true)) => classify(status, &headers, &body, std::time::SystemTime::now(), self.hint_ceiling),
            Err(e) if e.is_timeout() => UpstreamOutcome::Transient { status_class: "timeout" },
            Err(_) => UpstreamOutcome::Transient { status_class: "reset" },
        }
    }
}

/// Reads at most `cap` bytes of the body; `true` when there was more.
pub(super) async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<(Vec<u8>, bool), reqwest::Error> {
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

impl Provider for OpenAiProvider {
    fn name(&self) -> &'static str {
        "openai"
    }

    fn region(&self) -> Region {
        self.region
    }

    fn review<'a>(&'a self, req: &'a ProviderRequest<'a>) -> BoxFuture<'a, UpstreamOutcome> {
        if req.region != self.region {
            return futures::future::ready(UpstreamOutcome::Permanent { status: REFUSED_OTHER_REGION }).boxed();
        }
        self.call(req).boxed()
    }
}
