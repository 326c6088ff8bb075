//! Schema dialects against providers that enforce their documented rules: every schema
//! version, at both depths, projected into every dialect and sent by the real adapters
//! to the simulated provider refusing what each provider refuses. The default,
//! `portable`, is accepted by all of them, and the answers validate whole.

use std::time::Duration;

use reviewlane_core::job::ReviewDepth;
use reviewlane_core::region::Region;
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_core::{diff, findings};
use reviewlane_extractor::provider::anthropic::{AnthropicEndpoint, AnthropicProvider};
use reviewlane_extractor::provider::openai::OpenAiProvider;
use reviewlane_extractor::provider::{Provider, ProviderRequest};
use reviewlane_extractor::upstream::UpstreamOutcome;
use reviewlane_testkit::simprovider::{SimConfig, SimProvider};

use crate::harness::sample_diff;

/// Sends one review through `provider` for every schema version and depth; returns
/// what each (version, depth) came back as, with the answer validated.
async fn each_version(provider: &dyn Provider, text: &str) -> Vec<(String, Result<usize, String>)> {
    let parsed = diff::parse(text).unwrap();
    let mut out = Vec::new();
    for version in findings::known_schemas() {
        for depth in [ReviewDepth::Full, ReviewDepth::ChangedHunks] {
            let req = ProviderRequest {
                job_id: "us_00000000000000000000000000000001",
                region: Region::Us,
                schema_version: version,
                diff_text: text,
                diff: &parsed,
                review_depth: depth,
                part: None,
            };
            let got = match provider.review(&req).await {
                UpstreamOutcome::Ok { output, .. } => match findings::validate(version, &output, &parsed) {
                    Ok(v) if v.quarantined.is_empty() => Ok(v.findings.len()),
                    Ok(v) => Err(format!("quarantined {:?}", v.quarantined)),
                    Err(e) => Err(format!("invalid output: {e}")),
                },
                other => Err(format!("{other:?}")),
            };
            out.push((format!("{version} at {}", depth.as_str()), got));
        }
    }
    out
}

fn openai(base_url: String, dialect: SchemaDialect) -> OpenAiProvider {
    let s = Duration::from_secs(5);
    OpenAiProvider::new(&base_url, "gpt-4o".into(), None, Region::Us, s, s, 1 << 20).with_schema_dialect(dialect)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_schema_version_through_every_dialect_to_every_provider() {
    let text = sample_diff("dialects");
    // The rules of OpenAI (base and fine-tuned models), of Anthropic's behind an
    // OpenAI-compatible proxy (LiteLLM), and of a server that takes any schema (vLLM,
    // Ollama: `None`).
    let every =
        [Some(SchemaDialect::OpenAi), Some(SchemaDialect::OpenAiFineTuned), Some(SchemaDialect::Anthropic), None];
    for rules in every {
        let sim = SimProvider::start(SimConfig { enforce_dialect: rules, ..Default::default() }).await;
        for dialect in SchemaDialect::ALL {
            let results = each_version(&openai(sim.base_url(), dialect), &text).await;
            let must_pass = dialect == SchemaDialect::Portable || rules.is_none() || rules == Some(dialect);
            for (what, got) in results {
                if must_pass {
                    let n = got.unwrap_or_else(|e| panic!("{what} as {dialect} to {rules:?}: {e}"));
                    assert!(n > 0, "{what} as {dialect} to {rules:?}: no findings");
                } else if dialect == SchemaDialect::Full {
                    assert!(got.is_err(), "{what}: the full schema passed {rules:?}'s rules");
                }
            }
        }
        if rules.is_some() {
            assert!(sim.stats().schemas_refused > 0, "{rules:?} refuses the full schema");
        }
    }
    // Anthropic's adapter always sends its own dialect.
    let sim =
        SimProvider::start(SimConfig { enforce_dialect: Some(SchemaDialect::Anthropic), ..Default::default() }).await;
    let anthropic = AnthropicProvider::new(
        AnthropicEndpoint {
            base_url: format!("http://{}", sim.addr()),
            model: "claude".into(),
            api_key: None,
            region: Region::Us,
            max_tokens: 4096,
        },
        Duration::from_secs(5),
        Duration::from_secs(5),
        1 << 20,
    );
    for (what, got) in each_version(&anthropic, &text).await {
        assert!(got.is_ok_and(|n| n > 0), "{what} to Anthropic");
    }
    assert_eq!(sim.stats().schemas_refused, 0);
}
