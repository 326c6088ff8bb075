//! Anthropic's Messages API: the findings come back as the input of a forced tool call
//! (`tool_choice` = the `report_findings` tool, whose `input_schema` is the findings
//! schema in Anthropic's dialect); `anthropic-version` pinned; 429 with `retry-after`
//! and the `anthropic-ratelimit-*` headers, 529 (overloaded) transient, 413 and other
//! 4xx permanent (`upstream::classify_anthropic`).

use std::time::Duration;

use futures::future::BoxFuture;
use reviewlane_core::job::ReviewDepth;
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_shared::Region;
use secrecy::{ExposeSecret, SecretString};

use super::{Provider, ProviderRequest};
use crate::upstream::{UpstreamOutcome, classify_anthropic};

/// The API version this adapter speaks.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// The tool the model must call with the findings.
const TOOL: &str = "report_findings";

pub struct AnthropicProvider {
    http: reqwest::Client,
    endpoint: String,
    model: String,
    api_key: Option<SecretString>,
    region: Region,
    hint_ceiling: Duration,
    max_response_bytes: usize,
    max_tokens: u32,
    /// Each known schema version in Anthropic's dialect: full, and compact for reviews
    /// at degraded depth.
    schemas: super::DialectSchemas,
}

/// Where and how to call.
pub struct AnthropicEndpoint {
    pub base_url: String,
    pub model: String,
    pub api_key: Option<SecretString>,
    pub region: Region,
    /// Output token limit of one call.
    pub max_tokens: u32,
}

impl AnthropicProvider {
    pub fn new(e: AnthropicEndpoint, timeout: Duration, hint_ceiling: Duration, max_response_bytes: usize) -> Self {
        let http = super::http_client(timeout);
        AnthropicProvider {
            http,
            endpoint: format!("{}/v1/messages", e.base_url.trim_end_matches('/')),
            model: e.model,
            api_key: e.api_key,
            region: e.region,
            hint_ceiling,
            max_response_bytes,
            max_tokens: e.max_tokens,
            schemas: super::DialectSchemas::new(SchemaDialect::Anthropic),
        }
    }

    fn body(&self, req: &ProviderRequest<'_>) -> serde_json::Value {
        let degraded = req.review_depth == ReviewDepth::ChangedHunks;
        let schema = self.schemas.for_request(req).clone();
        serde_json::json!({
            "model": self.model,
            // At degraded depth a quarter of the output budget.
            "max_tokens": if degraded { (self.max_tokens / 4).max(256) } else { self.max_tokens },
            "temperature": 0,
            "system": super::instructions(req),
            "messages": [{"role": "user", "content": req.diff_text}],
            "tools": [{
                "name": TOOL,
                "description": "Report the review's findings.",
                "input_schema": schema,
            }],
            "tool_choice": {"type": "tool", "name": TOOL},
        })
    }

    /// One request of a Message Batch (`/v1/messages/batches`): the same parameters as
    /// the synchronous call — the forced findings tool included — under the item's
    /// `custom_id` (`reviewlane_core::batch::custom_id`).
    pub fn batch_request(&self, custom_id: &str, req: &ProviderRequest<'_>) -> serde_json::Value {
        serde_json::json!({ "custom_id": custom_id, "params": self.body(req) })
    }

    async fn call(&self, req: &ProviderRequest<'_>) -> UpstreamOutcome {
        let mut rb = super::identify(self.http.post(&self.endpoint), req)
            .header("anthropic-version", ANTHROPIC_VERSION)
            .json(&self.body(req));
        if let Some(key) = &self.api_key {
            rb = rb.header("x-api-key", key.expose_secret());
        }
        super::send(rb, self.max_response_bytes, self.hint_ceiling, classify_anthropic).await
    }
}

impl Provider for AnthropicProvider {
    fn name(&self) -> &'static str {
        "anthropic"
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

    #[test]
    fn a_batch_request_carries_the_synchronous_parameters_under_its_custom_id() {
        let text = "diff --git a/a.rs b/a.rs\n--- a/a.rs\n+++ b/a.rs\n@@ -1,1 +1,2 @@\n fn a() {}\n+fn b() {}\n";
        let parsed = reviewlane_core::diff::parse(text).unwrap();
        let provider = AnthropicProvider::new(
            AnthropicEndpoint {
                base_url: "http://127.0.0.1:1".into(),
                model: "claude".into(),
                api_key: None,
                region: Region::Eu,
                max_tokens: 2048,
            },
            Duration::from_secs(1),
            Duration::from_secs(1),
            1024,
        );
        let req = ProviderRequest {
            job_id: "eu_0123",
            region: Region::Eu,
            schema_version: reviewlane_core::findings::LATEST_SCHEMA,
            diff_text: text,
            diff: &parsed,
            review_depth: ReviewDepth::Full,
            part: None,
        };
        let request = provider.batch_request("eu_0123", &req);
        assert_eq!(request["custom_id"], "eu_0123");
        assert_eq!(request["params"], provider.body(&req));
        assert_eq!(request["params"]["tool_choice"]["name"], TOOL);
        assert_eq!(request["params"]["max_tokens"], 2048);
    }
}
