//! OpenAI-compatible chat completions with structured outputs (`response_format`
//! `json_schema`, strict). Works with OpenAI, vLLM, Ollama and LiteLLM endpoints.

use std::time::Duration;

use futures::future::BoxFuture;
use reviewlane_shared::Region;
use reviewlane_shared::findings;
use reviewlane_shared::job::ReviewDepth;
use reviewlane_shared::schema_dialect::{self, SchemaDialect};
use secrecy::{ExposeSecret, SecretString};

use super::{Provider, ProviderRequest};
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
        let http = super::http_client(timeout);
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
        super::send(rb, self.max_response_bytes, self.hint_ceiling, classify).await
    }
}

impl Provider for OpenAiProvider {
    fn name(&self) -> &'static str {
        "openai"
    }

    fn region(&self) -> Region {
        self.region
    }

    fn review<'a>(&'a self, req: &'a ProviderRequest<'a>) -> BoxFuture<'a, UpstreamOutcome> {
        super::in_region(self.region, req, self.call(req))
    }
}
