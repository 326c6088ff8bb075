//! The `tpm` run: reviews against an account that meters requests and tokens per minute
//! rather than calls in flight, with no limit configured in the deployment — the limits
//! are learned from the answers' headers, as a new user would run it. Three variants:
//! OpenAI-style tokens per minute (48,000; `x-ratelimit-*` headers, no `retry-after`, the
//! output limit counted at start), Anthropic-style input and output tokens per minute
//! (30,000 and 40,000; `anthropic-ratelimit-*` headers), and OpenAI-style requests per
//! minute (20).
//! Reported: published, 429s and their share, makespan beside the bucket's physical
//! limit.

use std::time::{Duration, Instant};

use reviewlane_api::proto::JobState;
use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use serde::Serialize;

use crate::procs::ProcStack;
use crate::simmeter::SimLimits;
use crate::simprovider::SimConfig;
use crate::stack::{StackOptions, US_KEY, submit, wait_final_within};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Variant {
    OpenAiTokens,
    AnthropicTokens,
    OpenAiRequests,
}

impl Variant {
    pub const ALL: [Variant; 3] = [Variant::OpenAiTokens, Variant::AnthropicTokens, Variant::OpenAiRequests];

    pub fn name(self) -> &'static str {
        match self {
            Variant::OpenAiTokens => "openai-48000-tpm",
            Variant::AnthropicTokens => "anthropic-itpm-otpm",
            Variant::OpenAiRequests => "openai-20-rpm",
        }
    }

    fn limits(self) -> SimLimits {
        match self {
            Variant::OpenAiTokens => SimLimits::openai(None, Some(48_000)),
            // Input tokens per minute binding; output tokens estimated from max_tokens at
            // start (about nine calls' worth) and adjusted to what was produced.
            Variant::AnthropicTokens => SimLimits::anthropic(None, Some(30_000), Some(40_000)),
            Variant::OpenAiRequests => SimLimits::openai(Some(20), None),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TpmConfig {
    pub variant: Variant,
    pub reviews: usize,
    /// Added lines per review.
    pub lines: usize,
    pub provider_latency: Duration,
}

impl TpmConfig {
    /// 30 reviews of 1 s calls: one added line (about 4,500 tokens as OpenAI counts a
    /// call, with its output limit), or 80 (about 2,000 input tokens) for Anthropic.
    pub fn full(variant: Variant) -> Self {
        let lines = if variant == Variant::AnthropicTokens { 80 } else { 1 };
        TpmConfig { variant, reviews: 30, lines, provider_latency: Duration::from_secs(1) }
    }

    pub fn options(&self) -> StackOptions {
        StackOptions {
            anthropic: self.variant == Variant::AnthropicTokens,
            us_provider: SimConfig {
                latency: self.provider_latency,
                limits: Some(self.variant.limits()),
                ..Default::default()
            },
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TpmReport {
    pub variant: &'static str,
    pub reviews: usize,
    pub published: usize,
    pub terminal: Vec<String>,
    pub calls: u64,
    pub calls_429: u64,
    pub share_429: f64,
    /// Per review, what the binding bucket counted (tokens or requests).
    pub cost_per_review: f64,
    pub bucket: u64,
    pub makespan_s: f64,
    /// (total - bucket) / rate + one call.
    pub physical_limit_s: f64,
    pub ratio_to_physical: f64,
}

/// A review of `lines` added lines (about 60 bytes each), distinct per index.
fn review(i: usize, lines: usize) -> String {
    let mut out = format!(
        "diff --git a/src/tpm_{i}.rs b/src/tpm_{i}.rs\n--- a/src/tpm_{i}.rs\n+++ b/src/tpm_{i}.rs\n@@ -1,2 +1,{} @@\n fn main() {{\n",
        lines + 2
    );
    for l in 0..lines {
        out.push_str(&format!("+    let value_{l:03} = compute({i}, {l}).unwrap_or_default();\n"));
    }
    out.push_str(" }\n");
    out
}

pub async fn run(stack: &ProcStack, cfg: &TpmConfig) -> anyhow::Result<TpmReport> {
    let mut client = ReviewServiceClient::connect(format!("http://{}", stack.ingress)).await?;
    let started = Instant::now();
    let mut ids = Vec::new();
    for i in 0..cfg.reviews {
        let diff = review(i, cfg.lines);
        ids.push(submit(&mut client, US_KEY, &format!("{}-{i}", cfg.variant.name()), &diff).await.job_id);
    }
    let mut published = 0;
    let mut terminal = Vec::new();
    let mut last = Duration::ZERO;
    for id in &ids {
        let done = wait_final_within(&mut client, US_KEY, id, Duration::from_secs(600)).await;
        if done.state == JobState::Published as i32 {
            published += 1;
        } else {
            terminal.push(done.terminal_reason.clone());
        }
        last = last.max(started.elapsed());
    }
    let stats = stack.us.provider.stats();
    let paid = stats.paid_calls.len() as u64;
    let limits = cfg.variant.limits();
    // What the binding bucket counts per review, as the provider counts it.
    let (bucket, cost) = match cfg.variant {
        Variant::OpenAiRequests => (limits.requests.unwrap_or(1), 1.0),
        Variant::OpenAiTokens => (limits.tokens.unwrap_or(1), stats.tokens_charged as f64 / paid.max(1) as f64),
        Variant::AnthropicTokens => {
            (limits.input_tokens.unwrap_or(1), stats.input_tokens_charged as f64 / paid.max(1) as f64)
        }
    };
    let total = cost * cfg.reviews as f64;
    let rate_per_s = bucket as f64 / 60.0;
    let physical = ((total - bucket as f64).max(0.0) / rate_per_s) + cfg.provider_latency.as_secs_f64();
    Ok(TpmReport {
        variant: cfg.variant.name(),
        reviews: cfg.reviews,
        published,
        terminal,
        calls: stats.total_calls,
        calls_429: stats.calls_429,
        share_429: stats.calls_429 as f64 / stats.total_calls.max(1) as f64,
        cost_per_review: cost,
        bucket,
        makespan_s: last.as_secs_f64(),
        physical_limit_s: physical,
        ratio_to_physical: last.as_secs_f64() / physical,
    })
}

pub fn print(r: &TpmReport) {
    println!("tpm {}: {} reviews against a bucket of {}", r.variant, r.reviews, r.bucket);
    println!("  published       {} (ended otherwise: {:?})", r.published, r.terminal);
    println!("  calls / 429s    {} / {} ({:.1} %)", r.calls, r.calls_429, 100.0 * r.share_429);
    println!("  cost per review {:.0}", r.cost_per_review);
    println!(
        "  makespan        {:.1} s; physical limit {:.1} s; ratio {:.3}",
        r.makespan_s, r.physical_limit_s, r.ratio_to_physical
    );
}
