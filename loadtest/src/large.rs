//! The `large` run: reviews far larger than the model's context, end to end through the
//! real processes — split into parts, the parts called concurrently as far as admission
//! allows, merged, published once — reported as parts, calls, tokens and time:
//!
//! - `cold`: the first review on a fresh deployment (the key's window starts at two
//!   calls and grows by slow start);
//! - `idle`: the next one on the same idle account, its window grown to the key limit;
//! - `shared`: another one while two other tenants send small interactive reviews at a
//!   steady rate, their submit-to-published times beside the same reviews with no large
//!   review running (`alone`).

use std::time::{Duration, Instant};

use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_api::proto::{self, JobState};
use serde::Serialize;
use tonic::transport::Channel;

use crate::load::percentile;
use crate::procs::ProcStack;
use crate::simprovider::SimConfig;
use crate::stack::{StackOptions, US_KEY, US_SECRET, submit, wait_final_within};

/// The two tenants sending interactive reviews beside the large one.
pub const OTHER_TENANTS: [(&str, &str); 2] = [("delta", "key-delta-us"), ("omega", "key-omega-us")];

#[derive(Debug, Clone)]
pub struct LargeConfig {
    pub files: usize,
    pub lines_per_file: usize,
    pub provider_latency: Duration,
    /// The extractors' `REVIEWLANE_CONTEXT_TOKENS`.
    pub context_tokens: usize,
    /// The key's limit on calls in flight (and the extractor's call slots).
    pub key_limit: u32,
    /// Each other tenant submits one small review this often.
    pub interactive_every: Duration,
    /// How long the other tenants send reviews with no large review running.
    pub alone_for: Duration,
}

impl LargeConfig {
    /// 40 files, about 2.2 MB (14 parts); 1 s per call; a 100,000-token context; a key
    /// limit of 8; each other tenant one review every 500 ms.
    pub fn full() -> Self {
        LargeConfig {
            files: 40,
            lines_per_file: 1000,
            provider_latency: Duration::from_secs(1),
            context_tokens: 100_000,
            key_limit: 8,
            interactive_every: Duration::from_millis(500),
            alone_for: Duration::from_secs(15),
        }
    }

    pub fn options(&self) -> StackOptions {
        let extra_tenants = OTHER_TENANTS
            .iter()
            .map(|(id, key)| {
                format!(
                    "[[tenants]]\nid = \"{id}\"\nregion = \"us\"\napi_key_sha256 = [\"{}\"]\nsink = {{ kind = \"webhook\", url = \"{{webhook_url}}\", secret = \"{US_SECRET}\" }}\nallow_private_webhook = true\n",
                    reviewlane_core::tenants::hash_api_key(key)
                )
            })
            .collect::<Vec<_>>()
            .join("\n");
        StackOptions {
            max_diff_bytes: 8 * 1024 * 1024,
            context_tokens: Some(self.context_tokens),
            us_provider: SimConfig { latency: self.provider_latency, ..Default::default() },
            key_limit: self.key_limit,
            extractor_concurrency: self.key_limit as usize,
            extra_tenants,
            ..Default::default()
        }
    }
}

/// One large review.
#[derive(Debug, Clone, Serialize)]
pub struct LargeRun {
    pub parts: u32,
    pub calls: u64,
    pub paid_calls: u64,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub findings: usize,
    pub published: bool,
    pub deliveries: usize,
    pub submit_to_published_secs: f64,
    /// `submit_to_published_secs` over ceil(parts / key limit) call times.
    pub ratio_to_rounds: f64,
}

/// The other tenants' small reviews: how many, how many published, their
/// submit-to-published times, and the p99 of each stage of it.
#[derive(Debug, Clone, Serialize)]
pub struct Interactive {
    pub reviews: usize,
    pub published: usize,
    pub p50_secs: f64,
    pub p99_secs: f64,
    pub stages_p99_secs: Stages,
    /// The mean stages of the reviews at or above the p99: where the slowest went.
    pub slowest_stages_secs: Stages,
}

/// Where a review's time went, as its `WatchReview` saw the states come: `submit` the
/// submit's answer; `waiting` from it to `running` first seen (the lane, the pull, the
/// lease); `call` from there to `validated` (the provider call, the result kept and
/// validated); `delivery` from there to `published` (the publisher, the sink). A state
/// the watch did not show starts when the next one seen does.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Stages {
    pub submit: f64,
    pub waiting: f64,
    pub call: f64,
    pub delivery: f64,
}

impl Stages {
    /// The mean of each stage over `some`.
    fn mean(some: &[Stages]) -> Stages {
        let n = some.len().max(1) as f64;
        let m = |f: fn(&Stages) -> f64| some.iter().map(f).sum::<f64>() / n;
        Stages { submit: m(|s| s.submit), waiting: m(|s| s.waiting), call: m(|s| s.call), delivery: m(|s| s.delivery) }
    }

    /// The p99 of each stage over `all` (each stage's own quantile).
    fn p99(all: &[Stages]) -> Stages {
        let q = |f: fn(&Stages) -> f64| {
            let mut v: Vec<f64> = all.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            percentile(&v, 0.99)
        };
        Stages { submit: q(|s| s.submit), waiting: q(|s| s.waiting), call: q(|s| s.call), delivery: q(|s| s.delivery) }
    }
}

/// Submits one small review and follows it to a final state (at most `limit`): whether
/// it was published, and its stages.
async fn submit_and_follow(
    client: &mut ReviewServiceClient<Channel>,
    key: &str,
    idem: &str,
    diff: &str,
    limit: Duration,
) -> (bool, Stages) {
    let started = Instant::now();
    let job = submit(client, key, idem, diff).await;
    let answered = Instant::now();
    let deadline = tokio::time::Instant::now() + limit;
    let req = crate::stack::authed(key, proto::WatchReviewRequest { job_id: job.job_id.clone() });
    let mut stream = client.watch_review(req).await.expect("watch starts").into_inner();
    // First seen: running (or later), validated (or published), published.
    let mut seen: [Option<Instant>; 3] = [None; 3];
    let mut last = job.state;
    loop {
        match tokio::time::timeout_at(deadline, stream.message()).await {
            Ok(Ok(Some(m))) => {
                let Some(r) = m.review else { continue };
                let now = Instant::now();
                let reached = [
                    [JobState::Running, JobState::RetryScheduled, JobState::Validated, JobState::Published]
                        .map(|s| s as i32)
                        .contains(&r.state),
                    [JobState::Validated, JobState::Published].map(|s| s as i32).contains(&r.state),
                    r.state == JobState::Published as i32,
                ];
                for (at, hit) in seen.iter_mut().zip(reached) {
                    if hit && at.is_none() {
                        *at = Some(now);
                    }
                }
                last = r.state;
            }
            Ok(Ok(None)) => break,
            Ok(Err(e)) => panic!("watching job {} failed: {e}", job.job_id),
            Err(_) => panic!("job {} did not reach a final state within {limit:?}", job.job_id),
        }
    }
    let end = Instant::now();
    let at = |i: usize| seen[i..].iter().flatten().next().copied().unwrap_or(end);
    let secs = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
    let stages = Stages {
        submit: secs(started, answered),
        waiting: secs(answered, at(0)),
        call: secs(at(0), at(1)),
        delivery: secs(at(1), at(2)),
    };
    (last == JobState::Published as i32, stages)
}

#[derive(Debug, Clone, Serialize)]
pub struct LargeReport {
    pub diff_bytes: usize,
    pub files: usize,
    pub key_limit: u32,
    pub provider_latency_secs: f64,
    pub cold: LargeRun,
    pub idle: LargeRun,
    pub shared: LargeRun,
    /// The other tenants' reviews with no large review running, and beside `shared`.
    pub alone: Interactive,
    pub beside_large: Interactive,
    /// `beside_large.p50_secs` over `alone.p50_secs`.
    pub p50_ratio: f64,
}

impl LargeReport {
    /// Every large review published once, each part paid once, every other review
    /// published.
    pub fn ok(&self) -> bool {
        [&self.cold, &self.idle, &self.shared]
            .iter()
            .all(|r| r.published && r.deliveries == 1 && r.paid_calls == u64::from(r.parts))
            && self.alone.published == self.alone.reviews
            && self.beside_large.published == self.beside_large.reviews
    }
}

/// A small review of one added line, distinct per `(tenant, i)`.
fn small_diff(tenant: &str, i: usize) -> String {
    format!(
        "diff --git a/src/{tenant}_{i}.rs b/src/{tenant}_{i}.rs\n--- a/src/{tenant}_{i}.rs\n+++ b/src/{tenant}_{i}.rs\n@@ -1,2 +1,3 @@\n fn main() {{\n+    let value = compute({i}).unwrap_or_default();\n }}\n"
    )
}

async fn large_review(
    stack: &ProcStack,
    channel: &Channel,
    cfg: &LargeConfig,
    name: &str,
) -> anyhow::Result<(LargeRun, usize)> {
    let mut client = ReviewServiceClient::new(channel.clone());
    let diff = reviewlane_testkit::diffs::large_salted(cfg.files, cfg.lines_per_file, name);
    let started = Instant::now();
    let job = submit(&mut client, US_KEY, name, &diff).await;
    let done = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(600)).await;
    let took = started.elapsed();
    // The delivery follows the record's `published` at once; wait for it, bounded.
    let deadline = Instant::now() + Duration::from_secs(10);
    while stack.webhook.for_job(&job.job_id).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = stack.us.provider.stats();
    let tokens = done.tokens.unwrap_or_default();
    let rounds = u64::from(done.parts_total).div_ceil(u64::from(cfg.key_limit)).max(1);
    let run = LargeRun {
        parts: done.parts_total,
        calls: stats.calls_by_job.get(&job.job_id).copied().unwrap_or(0),
        paid_calls: stats.paid_by_job.get(&job.job_id).copied().unwrap_or(0),
        tokens_in: tokens.input,
        tokens_out: tokens.output,
        findings: done.findings.len(),
        published: done.state == JobState::Published as i32,
        deliveries: stack.webhook.for_job(&job.job_id).len(),
        submit_to_published_secs: took.as_secs_f64(),
        ratio_to_rounds: took.as_secs_f64() / (rounds as f64 * cfg.provider_latency.as_secs_f64()),
    };
    Ok((run, diff.len()))
}

/// The other tenants each submit one small review every `every` until `until`
/// resolves; each review is followed to its final state.
pub async fn interactive_reviews(
    channel: &Channel,
    every: Duration,
    round: &str,
    until: impl std::future::Future<Output = ()>,
) -> Interactive {
    let mut followers = tokio::task::JoinSet::new();
    let mut tick = tokio::time::interval(every);
    tokio::pin!(until);
    let mut i = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut until => break,
        }
        for (tenant, key) in OTHER_TENANTS {
            let mut client = ReviewServiceClient::new(channel.clone());
            let diff = small_diff(&format!("{tenant}_{round}"), i);
            let idem = format!("{round}-{i}");
            followers.spawn(async move {
                let started = Instant::now();
                let (published, stages) =
                    submit_and_follow(&mut client, key, &idem, &diff, Duration::from_secs(120)).await;
                (published, started.elapsed().as_secs_f64(), stages)
            });
        }
        i += 1;
    }
    let mut runs = Vec::new();
    let mut published = 0;
    while let Some(r) = followers.join_next().await {
        let (ok, secs, stages) = r.expect("follower runs");
        published += usize::from(ok);
        runs.push((secs, stages));
    }
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let times: Vec<f64> = runs.iter().map(|r| r.0).collect();
    let stages: Vec<Stages> = runs.iter().map(|r| r.1).collect();
    let p99 = percentile(&times, 0.99);
    let slowest: Vec<Stages> = runs.iter().filter(|r| r.0 >= p99).map(|r| r.1).collect();
    Interactive {
        reviews: times.len(),
        published,
        p50_secs: percentile(&times, 0.5),
        p99_secs: p99,
        stages_p99_secs: Stages::p99(&stages),
        slowest_stages_secs: Stages::mean(&slowest),
    }
}

pub async fn run(stack: &ProcStack, cfg: &LargeConfig) -> anyhow::Result<LargeReport> {
    let channel = crate::load::connect(stack.ingress).await?;
    let (cold, diff_bytes) = large_review(stack, &channel, cfg, "large-cold").await?;
    let (idle, _) = large_review(stack, &channel, cfg, "large-idle").await?;
    let alone = interactive_reviews(&channel, cfg.interactive_every, "alone", tokio::time::sleep(cfg.alone_for)).await;
    // The other tenants send from before the large review until it is published.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let beside = interactive_reviews(&channel, cfg.interactive_every, "beside", async {
        let _ = done_rx.await;
    });
    let large = async {
        // Their first reviews are under way when the large one arrives.
        tokio::time::sleep(cfg.interactive_every * 2).await;
        let r = large_review(stack, &channel, cfg, "large-shared").await;
        let _ = done_tx.send(());
        r
    };
    let (beside_large, shared) = tokio::join!(beside, large);
    let (shared, _) = shared?;
    let p50_ratio = beside_large.p50_secs / alone.p50_secs.max(f64::EPSILON);
    Ok(LargeReport {
        diff_bytes,
        files: cfg.files,
        key_limit: cfg.key_limit,
        provider_latency_secs: cfg.provider_latency.as_secs_f64(),
        cold,
        idle,
        shared,
        alone,
        beside_large,
        p50_ratio,
    })
}

pub fn print(r: &LargeReport) {
    println!(
        "large reviews: {} files, {} bytes; key limit {}; calls of {:.1} s",
        r.files, r.diff_bytes, r.key_limit, r.provider_latency_secs
    );
    for (name, run) in [("cold", &r.cold), ("idle", &r.idle), ("shared", &r.shared)] {
        println!(
            "  {name:<7} parts {}  calls/paid {}/{}  findings {} (deliveries {})  submit -> published {:.2} s ({:.2}x ceil(parts / limit) call times)",
            run.parts,
            run.calls,
            run.paid_calls,
            run.findings,
            run.deliveries,
            run.submit_to_published_secs,
            run.ratio_to_rounds
        );
    }
    for (name, i) in [("alone", &r.alone), ("beside", &r.beside_large)] {
        let s = &i.stages_p99_secs;
        println!(
            "  other tenants' reviews {name:<7} {} ({} published)  p50 {:.2} s  p99 {:.2} s  (stages' p99: submit {:.3}, waiting {:.3}, call {:.3}, delivery {:.3})",
            i.reviews, i.published, i.p50_secs, i.p99_secs, s.submit, s.waiting, s.call, s.delivery
        );
    }
    println!("  p50 beside the large review / alone: {:.3}", r.p50_ratio);
}
