//! OpenAI-compatible chat completions with structured outputs (`response_format`
//! `json_schema`, strict). Works with OpenAI, vLLM, Ollama and LiteLLM endpoints, and
//! with Azure OpenAI deployments (`OpenAiProvider::azure`): the same body, sent to the
//! deployment's path with its `api-version`, authenticated by the `api-key` header or an
//! Entra ID bearer token, and read by `upstream::classify_azure`.

use std::time::Duration;

use futures::future::BoxFuture;
use reviewlane_core::job::ReviewDepth;
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_shared::Region;
use secrecy::SecretString;

use super::{Auth, Provider, ProviderRequest};
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

/// Added for `findings.v2`.
pub(super) const V2_PROMPT: &str = "For each finding also give `suggested_action` (what to do), your `confidence`, \
`end_line` when it spans several lines of one hunk, `side` `old` only when the lines are removed ones, and \
`suggested_replacement` only when you can give the exact new lines that replace `line` to `end_line`.";

/// Added when the diff is one part of a larger one.
pub(super) const PART_PROMPT: &str = "The diff is one part of a larger change; review what it shows.";

/// A chat completions request with structured outputs.
#[derive(serde::Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    temperature: u8,
    max_tokens: u32,
    messages: [Message<'a>; 2],
    response_format: ResponseFormat<'a>,
}

#[derive(serde::Serialize)]
struct Message<'a> {
    role: &'static str,
    content: std::borrow::Cow<'a, str>,
}

#[derive(serde::Serialize)]
struct ResponseFormat<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    json_schema: JsonSchema<'a>,
}

#[derive(serde::Serialize)]
struct JsonSchema<'a> {
    name: String,
    strict: bool,
    schema: &'a serde_json::Value,
}

/// Which contract the endpoint speaks beyond the request body.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Contract {
    OpenAi,
    Azure,
}

pub struct OpenAiProvider {
    http: reqwest::Client,
    endpoint: String,
    model: String,
    auth: Auth,
    contract: Contract,
    /// Azure: the global batch deployment a batch line names.
    batch_deployment: Option<String>,
    region: Region,
    hint_ceiling: Duration,
    /// Largest response body read; a longer one is cut there.
    max_response_bytes: usize,
    /// Each known schema version as this endpoint's dialect accepts it: full, and
    /// compact for reviews at degraded depth.
    schemas: super::DialectSchemas,
}

/// Output token limits of one call: full depth, and degraded depth (`changed_hunks`).
pub const MAX_OUTPUT_TOKENS: u32 = 4096;
pub const MAX_OUTPUT_TOKENS_DEGRADED: u32 = 1024;

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
            auth: api_key.map_or(Auth::None, Auth::Bearer),
            contract: Contract::OpenAi,
            batch_deployment: None,
            region,
            hint_ceiling,
            max_response_bytes,
            schemas: Default::default(),
        }
        .with_schema_dialect(SchemaDialect::default())
    }

    /// An Azure OpenAI deployment's chat completions.
    pub fn azure(
        d: &crate::config::AzureDeployment,
        timeout: Duration,
        hint_ceiling: Duration,
        max_response_bytes: usize,
    ) -> Self {
        let endpoint = format!(
            "{}/openai/deployments/{}/chat/completions?api-version={}",
            d.endpoint.trim_end_matches('/'),
            d.deployment,
            d.api_version
        );
        let auth = Auth::azure(&d.auth);
        OpenAiProvider {
            http: super::http_client(timeout),
            endpoint,
            model: d.model.clone(),
            auth,
            contract: Contract::Azure,
            batch_deployment: d.batch_deployment.clone(),
            region: d.endpoint_region,
            hint_ceiling,
            max_response_bytes,
            schemas: Default::default(),
        }
        .with_schema_dialect(d.schema_dialect)
    }

    /// Sends each schema as `dialect` accepts it.
    pub fn with_schema_dialect(mut self, dialect: SchemaDialect) -> Self {
        self.schemas = super::DialectSchemas::new(dialect);
        self
    }

    /// The request body, borrowing the diff and the schema: serialized once, copied
    /// nowhere else.
    fn body<'a>(&'a self, req: &'a ProviderRequest<'a>) -> ChatRequest<'a> {
        self.body_for(req, &self.model)
    }

    /// The request body naming `model` (an Azure batch line names its global batch
    /// deployment).
    fn body_for<'a>(&'a self, req: &'a ProviderRequest<'a>, model: &'a str) -> ChatRequest<'a> {
        // The schema as this endpoint's dialect takes it; the answer is held to the full
        // schema by our validator.
        let degraded = req.review_depth == ReviewDepth::ChangedHunks;
        ChatRequest {
            model,
            temperature: 0,
            max_tokens: if degraded { MAX_OUTPUT_TOKENS_DEGRADED } else { MAX_OUTPUT_TOKENS },
            messages: [
                Message { role: "system", content: super::instructions(req).into() },
                Message { role: "user", content: req.diff_text.into() },
            ],
            response_format: ResponseFormat {
                kind: "json_schema",
                json_schema: JsonSchema {
                    name: req.schema_version.replace('.', "_"),
                    strict: true,
                    schema: self.schemas.for_request(req),
                },
            },
        }
    }

    /// One request line of a batch input file (`/v1/batches`, JSONL): the same body as
    /// the synchronous call — the strict `json_schema` included — under the item's
    /// `custom_id` (`reviewlane_core::batch::custom_id`). On Azure, the line's URL has
    /// no version and its model names the global batch deployment.
    pub fn batch_line(&self, custom_id: &str, req: &ProviderRequest<'_>) -> serde_json::Value {
        let (url, model) = match (self.contract, &self.batch_deployment) {
            (Contract::Azure, Some(deployment)) => ("/chat/completions", deployment.as_str()),
            (Contract::Azure, None) => ("/chat/completions", self.model.as_str()),
            (Contract::OpenAi, _) => ("/v1/chat/completions", self.model.as_str()),
        };
        serde_json::json!({
            "custom_id": custom_id,
            "method": "POST",
            "url": url,
            "body": self.body_for(req, model),
        })
    }

    async fn call(&self, req: &ProviderRequest<'_>) -> UpstreamOutcome {
        let rb = super::identify(self.http.post(&self.endpoint), req).json(&self.body(req));
        let Ok(rb) = self.auth.apply(rb).await else {
            // Being renewed, or not mounted yet: the transient budget decides.
            return UpstreamOutcome::Transient { status_class: "credential" };
        };
        let classify = match self.contract {
            Contract::OpenAi => classify,
            Contract::Azure => crate::upstream::classify_azure,
        };
        super::send(rb, self.max_response_bytes, self.hint_ceiling, classify).await
    }
}

impl Provider for OpenAiProvider {
    fn name(&self) -> &'static str {
        match self.contract {
            Contract::OpenAi => "openai",
            Contract::Azure => "azure",
        }
    }

    fn region(&self) -> Region {
        self.region
    }

    fn review<'a>(&'a self, req: &'a ProviderRequest<'a>) -> BoxFuture<'a, UpstreamOutcome> {
        super::in_region(self.region, req, self.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reviewlane_core::{diff, findings};

    /// A change of 3 lines in each of 3 places of a 150-line file, as `git diff -U20`
    /// might show it.
    fn wide_diff() -> String {
        let mut d = String::from("diff --git a/src/lib.rs b/src/lib.rs\n--- a/src/lib.rs\n+++ b/src/lib.rs\n");
        for k in 0..3u32 {
            let start = 1 + k * 50;
            d.push_str(&format!("@@ -{start},43 +{start},43 @@\n"));
            for i in 0..20 {
                d.push_str(&format!(" fn context_{k}_{i}() {{ let value = compute({i}); }}\n"));
            }
            for i in 0..3 {
                d.push_str(&format!("-    old_call_{k}_{i}(value);\n+    new_call_{k}_{i}(value).unwrap();\n"));
            }
            for i in 0..20 {
                d.push_str(&format!(" fn after_{k}_{i}() {{ let other = compute({i}); }}\n"));
            }
        }
        d
    }

    fn review(depth: ReviewDepth, text: &str) -> reviewlane_core::messages::ReviewMessage {
        reviewlane_core::messages::ReviewMessage {
            job_id: "us_00000000000000000000000000000000".into(),
            tenant: "acme".into(),
            region: Region::Us,
            lane: reviewlane_shared::Lane::Interactive,
            schema_version: findings::LATEST_SCHEMA.into(),
            review_depth: depth,
            metadata: Default::default(),
            diff: text.into(),
            diff_bytes: None,
            submitted_at_ms: 0,
            input_digest: String::new(),
            request_digest: String::new(),
            deadline_ms: None,
            replay_of: None,
            sweep_id: None,
            deeper_of: None,
            deeper_review: None,
        }
    }

    /// An adapter of an endpoint never called.
    fn provider() -> OpenAiProvider {
        let (timeout, ceiling) = (Duration::from_secs(1), Duration::from_secs(1));
        OpenAiProvider::new("http://127.0.0.1:1/v1", "m".into(), None, Region::Us, timeout, ceiling, 1024)
            .with_schema_dialect(SchemaDialect::Full)
    }

    /// The request for `r`, showing `prompt`.
    fn request<'a>(
        r: &'a reviewlane_core::messages::ReviewMessage,
        prompt: &'a str,
        parsed: &'a diff::Diff,
    ) -> ProviderRequest<'a> {
        ProviderRequest {
            job_id: &r.job_id,
            region: Region::Us,
            schema_version: &r.schema_version,
            diff_text: prompt,
            diff: parsed,
            review_depth: r.review_depth,
            part: None,
        }
    }

    #[test]
    fn a_degraded_review_sends_less_and_asks_for_less() {
        let text = wide_diff();
        let parsed = diff::parse(&text).unwrap();
        let provider = provider();
        let body = |depth| {
            let r = review(depth, &text);
            let prompt = super::super::prompt_diff(&r, &parsed).into_owned();
            serde_json::to_value(provider.body(&request(&r, &prompt, &parsed))).unwrap()
        };
        let (full, degraded) = (body(ReviewDepth::Full), body(ReviewDepth::ChangedHunks));
        // Fewer tokens in (estimated at 4 bytes a token): only the changed lines and one
        // line of context go out.
        let tokens = |b: &serde_json::Value| b.to_string().len() / 4;
        assert!(tokens(&degraded) * 2 < tokens(&full), "{} vs {}", tokens(&degraded), tokens(&full));
        // Fewer tokens out: a smaller limit and shorter texts in the schema.
        assert_eq!((full["max_tokens"].as_u64(), degraded["max_tokens"].as_u64()), (Some(4096), Some(1024)));
        let message = |b: &serde_json::Value| {
            b["response_format"]["json_schema"]["schema"]["properties"]["findings"]["items"]["properties"]["message"]["maxLength"]
                .as_u64()
        };
        assert_eq!((message(&full), message(&degraded)), (Some(4000), Some(500)));
        // Every added line is still there, at its number: findings validate as before.
        let shown = diff::parse(degraded["messages"][1]["content"].as_str().unwrap()).unwrap();
        assert_eq!(shown.added_lines().count(), parsed.added_lines().count());
    }

    #[test]
    fn a_batch_line_carries_the_synchronous_body_under_its_custom_id() {
        let text = wide_diff();
        let parsed = diff::parse(&text).unwrap();
        let provider = provider();
        let r = review(ReviewDepth::Full, &text);
        let req = request(&r, &text, &parsed);
        let line = provider.batch_line(&r.job_id, &req);
        assert_eq!(line["custom_id"], r.job_id.as_str());
        assert_eq!((line["method"].as_str(), line["url"].as_str()), (Some("POST"), Some("/v1/chat/completions")));
        assert_eq!(line["body"], serde_json::to_value(provider.body(&req)).unwrap());
        assert_eq!(line["body"]["response_format"]["json_schema"]["strict"], true);
        // One line of JSONL.
        assert!(!line.to_string().contains('\n'));
    }
}
