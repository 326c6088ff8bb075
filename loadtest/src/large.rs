//! The `large` run: one review far larger than the model's context, end to end through
//! the real processes — split into parts, one call per part, merged, published once —
//! reported as parts, calls, tokens and time.

use std::time::{Duration, Instant};

use reviewlane_api::proto::JobState;
use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use serde::Serialize;

use crate::procs::ProcStack;
use crate::simprovider::SimConfig;
use crate::stack::{StackOptions, US_KEY, submit, wait_final_within};

#[derive(Debug, Clone)]
pub struct LargeConfig {
    pub files: usize,
    pub lines_per_file: usize,
    pub provider_latency: Duration,
    /// The extractors' `REVIEWLANE_CONTEXT_TOKENS`.
    pub context_tokens: usize,
}

impl LargeConfig {
    /// 40 files, about 2.2 MB; 1 s per call; a 100,000-token context.
    pub fn full() -> Self {
        LargeConfig {
            files: 40,
            lines_per_file: 1000,
            provider_latency: Duration::from_secs(1),
            context_tokens: 100_000,
        }
    }

    pub fn options(&self) -> StackOptions {
        StackOptions {
            max_diff_bytes: 8 * 1024 * 1024,
            context_tokens: Some(self.context_tokens),
            us_provider: SimConfig { latency: self.provider_latency, ..Default::default() },
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LargeReport {
    pub diff_bytes: usize,
    pub files: usize,
    pub parts: u32,
    pub calls: u64,
    pub paid_calls: u64,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub findings: usize,
    pub published: bool,
    pub deliveries: usize,
    pub submit_to_published_secs: f64,
    pub provider_latency_secs: f64,
}

/// `files` new files of `lines` added lines each (about 56 bytes a line).
pub fn large_diff(files: usize, lines: usize) -> String {
    let mut out = String::new();
    for f in 0..files {
        let path = format!("src/module_{f:02}.rs");
        out.push_str(&format!(
            "diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{lines} @@\n"
        ));
        for i in 0..lines {
            out.push_str(&format!("+    let value_{i:04} = compute_{f:02}({i}, \"padding for size\");\n"));
        }
    }
    out
}

pub async fn run(stack: &ProcStack, cfg: &LargeConfig) -> anyhow::Result<LargeReport> {
    let mut client = ReviewServiceClient::connect(format!("http://{}", stack.ingress)).await?;
    let diff = large_diff(cfg.files, cfg.lines_per_file);
    let started = Instant::now();
    let job = submit(&mut client, US_KEY, "large-review", &diff).await;
    let done = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(600)).await;
    let took = started.elapsed();
    // The delivery follows the record's `published` at once; wait for it, bounded.
    let deadline = Instant::now() + Duration::from_secs(10);
    while stack.webhook.for_job(&job.job_id).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = stack.us.provider.stats();
    let tokens = done.tokens.unwrap_or_default();
    Ok(LargeReport {
        diff_bytes: diff.len(),
        files: cfg.files,
        parts: done.parts_total,
        calls: stats.calls_by_job.get(&job.job_id).copied().unwrap_or(0),
        paid_calls: stats.paid_by_job.get(&job.job_id).copied().unwrap_or(0),
        tokens_in: tokens.input,
        tokens_out: tokens.output,
        findings: done.findings.len(),
        published: done.state == JobState::Published as i32,
        deliveries: stack.webhook.for_job(&job.job_id).len(),
        submit_to_published_secs: took.as_secs_f64(),
        provider_latency_secs: cfg.provider_latency.as_secs_f64(),
    })
}

pub fn print(r: &LargeReport) {
    println!("large review: {} files, {} bytes", r.files, r.diff_bytes);
    println!("  parts          {}", r.parts);
    println!("  calls / paid   {} / {}", r.calls, r.paid_calls);
    println!("  tokens in/out  {} / {}", r.tokens_in, r.tokens_out);
    println!("  findings       {} (deliveries: {})", r.findings, r.deliveries);
    println!(
        "  submit -> published  {:.2} s ({} calls of {:.1} s each)",
        r.submit_to_published_secs, r.paid_calls, r.provider_latency_secs
    );
}
