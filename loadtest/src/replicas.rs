//! The `replicas` scenario: a fleet of extractor replicas that share one provider key.
//! Three extractor processes in the US region, two tenants (acme, beta) on one key whose
//! provider answers 429 above 4 calls in flight; one replica is killed (-9, not
//! restarted) a third of the way through and a new one started at two thirds. The
//! fleet must stay within the key's limit whatever the number of replicas, and the
//! survivors must take the dead replica's share at once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reviewlane_api::proto::JobState;
use reviewlane_core::region::{Lane, Region};
use serde::Serialize;

use crate::corpus::{self, Size};
use crate::load::{self, Job, Pace, Sent, Tenant};
use crate::procs::ProcStack;
use crate::simprovider::{OverCap, SimConfig};
use crate::stack::StackOptions;

/// The bearer key `extractor-us-1` (the replica killed) calls the provider with.
const KILLED_KEY: &str = "sk-load-1";

#[derive(Debug, Clone)]
pub struct ReplicasConfig {
    /// Jobs per tenant (two tenants).
    pub jobs_per_tenant: usize,
    pub provider_latency: Duration,
    /// The provider's limit on the key: calls in flight above it are answered 429.
    pub provider_cap: usize,
    /// What the deployment is told the key's limit is (`REVIEWLANE_KEY_LIMIT`).
    pub key_limit: u32,
    pub lease: Duration,
}

impl ReplicasConfig {
    /// The scenario of record: 2 × 100 jobs of 1 s against a cap of 4 (50 s at the limit).
    pub fn full() -> Self {
        ReplicasConfig {
            jobs_per_tenant: 100,
            provider_latency: Duration::from_secs(1),
            provider_cap: 4,
            key_limit: 4,
            lease: Duration::from_secs(3),
        }
    }

    /// The test suite's: 2 × 20 jobs of 300 ms.
    pub fn small() -> Self {
        ReplicasConfig {
            jobs_per_tenant: 20,
            provider_latency: Duration::from_millis(300),
            provider_cap: 4,
            key_limit: 4,
            lease: Duration::from_secs(2),
        }
    }

    pub fn options(&self) -> StackOptions {
        let sim = SimConfig {
            latency: self.provider_latency,
            concurrency_cap: Some(self.provider_cap),
            over_cap: OverCap::Reject { headers: vec![("retry-after".into(), "1".into())] },
            ..Default::default()
        };
        StackOptions {
            extractors: 3,
            lease: self.lease,
            us_provider: sim.clone(),
            eu_provider: sim,
            extractor_concurrency: 8,
            key_limit: self.key_limit,
            heartbeat: Duration::from_millis(500),
            ..Default::default()
        }
    }

    /// Jobs × latency / the provider's cap.
    pub fn physical_limit(&self) -> Duration {
        self.provider_latency * (2 * self.jobs_per_tenant) as u32 / self.provider_cap as u32
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ReplicasReport {
    pub jobs: usize,
    pub published: usize,
    pub lost: usize,
    pub terminal: BTreeMap<String, usize>,
    pub paid_calls: u64,
    /// Paid again with no fault to excuse it.
    pub paid_twice: u64,
    /// Paid again because the first paid answer reached the killed replica (excused).
    pub repaid_after_kill: u64,
    pub provider_calls: u64,
    pub calls_429: u64,
    pub share_429: f64,
    /// Most calls the provider saw in flight at once.
    pub provider_max_concurrent: usize,
    pub makespan_s: f64,
    pub physical_limit_s: f64,
    pub ratio_to_physical: f64,
    /// Jobs published per tenant.
    pub published_by_tenant: BTreeMap<String, usize>,
    pub killed: String,
    pub killed_at_s: f64,
    pub started: String,
    pub started_at_s: f64,
}

/// Runs the scenario on a `ProcStack` started with `cfg.options()`.
pub async fn run(stack: &mut ProcStack, cfg: &ReplicasConfig) -> anyhow::Result<ReplicasReport> {
    let channel = load::connect(stack.ingress).await?;
    let n = cfg.jobs_per_tenant;
    let jobs: Arc<Vec<Job>> = Arc::new(
        (0..2 * n)
            .map(|i| Job {
                tenant: if i % 2 == 0 { Tenant::Acme } else { Tenant::Beta },
                lane: Lane::Interactive,
                idempotency_key: format!("replicas-{i}"),
                diff: corpus::generate(50_000 + i as u64, Size::Small),
            })
            .collect(),
    );
    let start = Instant::now();
    let pace = Pace { concurrency: 16, rate: None, timeout: Duration::from_secs(10) };
    let submitted = load::submit(&channel, &jobs, (0..jobs.len()).collect(), pace).await;
    let limit = cfg.physical_limit();
    // A third of the way: one replica killed, not restarted.
    tokio::time::sleep((limit / 3).saturating_sub(start.elapsed())).await;
    let killed = "extractor-us-1".to_string();
    let killed_at = start.elapsed();
    let killed_unix_ms = reviewlane_shared::telemetry::now_ms();
    if let Some(s) = stack.service(&killed) {
        s.signal("KILL")?;
    }
    // Two thirds: a new one.
    tokio::time::sleep((limit * 2 / 3).saturating_sub(start.elapsed())).await;
    let started_at = start.elapsed();
    let started = stack.spawn_extractor(Region::Us)?;

    let accepted: Vec<_> = submitted.iter().filter(|s| s.sent == Sent::Accepted).cloned().collect();
    let finals = load::follow(&channel, &jobs, &accepted, Duration::from_secs(300)).await;
    let published = finals.values().filter(|f| f.state == JobState::Published).count();
    let deadline = Instant::now() + Duration::from_secs(5);
    while load::deliveries(&stack.webhook).len() < published && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deliveries = load::deliveries(&stack.webhook);
    let makespan =
        deliveries.values().map(|(_, at)| at.saturating_duration_since(start)).max().unwrap_or_default().as_secs_f64();
    let mut terminal = BTreeMap::new();
    for f in finals.values().filter(|f| f.state == JobState::Terminal) {
        *terminal.entry(f.reason.clone()).or_default() += 1;
    }
    let mut published_by_tenant = BTreeMap::new();
    for s in &accepted {
        if finals.get(&s.job_id).is_some_and(|f| f.state == JobState::Published) {
            *published_by_tenant.entry(jobs[s.job].tenant.id().to_string()).or_default() += 1;
        }
    }
    let stats = stack.us.provider.stats();
    let paid: u64 = stats.paid_by_job.values().sum();
    // A repeat payment is excused when the earlier paid answer went to the killed
    // replica while its call ran or right before the kill (before it could keep it).
    let (mut paid_twice, mut repaid_after_kill) = (0u64, 0u64);
    let mut by_job: BTreeMap<&str, Vec<&crate::simprovider::PaidCall>> = BTreeMap::new();
    for c in &stats.paid_calls {
        by_job.entry(c.job.as_str()).or_default().push(c);
    }
    for calls in by_job.values().filter(|c| c.len() > 1) {
        let earlier = &calls[..calls.len() - 1];
        let died_with_caller = earlier.iter().all(|c| {
            c.key == KILLED_KEY
                && killed_unix_ms + 500 >= c.started_unix_ms
                && killed_unix_ms <= c.answered_unix_ms + 2_000
        });
        if died_with_caller {
            repaid_after_kill += (calls.len() - 1) as u64;
        } else {
            paid_twice += (calls.len() - 1) as u64;
        }
    }
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    Ok(ReplicasReport {
        jobs: jobs.len(),
        published,
        lost: accepted.len().saturating_sub(published) + (jobs.len() - accepted.len()),
        terminal,
        paid_calls: paid,
        paid_twice,
        repaid_after_kill,
        provider_calls: stats.total_calls,
        calls_429: stats.calls_429,
        share_429: round(stats.calls_429 as f64 / stats.total_calls.max(1) as f64),
        provider_max_concurrent: stats.max_concurrent,
        makespan_s: round(makespan),
        physical_limit_s: round(limit.as_secs_f64()),
        ratio_to_physical: round(makespan / limit.as_secs_f64()),
        published_by_tenant,
        killed,
        killed_at_s: round(killed_at.as_secs_f64()),
        started,
        started_at_s: round(started_at.as_secs_f64()),
    })
}

pub fn print(r: &ReplicasReport) {
    println!(
        "replicas: {} jobs, {} published, {} lost, terminal {:?}, by tenant {:?}",
        r.jobs, r.published, r.lost, r.terminal, r.published_by_tenant
    );
    println!(
        "  provider: {} calls, {} answered 429 ({:.1}%), {} paid, {} paid twice, {} paid again after the kill, at most {} in flight",
        r.provider_calls,
        r.calls_429,
        r.share_429 * 100.0,
        r.paid_calls,
        r.paid_twice,
        r.repaid_after_kill,
        r.provider_max_concurrent
    );
    println!(
        "  last result {:.2} s against the physical limit {:.2} s: {:.3}x; {} killed at {:.1} s, {} started at {:.1} s",
        r.makespan_s, r.physical_limit_s, r.ratio_to_physical, r.killed, r.killed_at_s, r.started, r.started_at_s
    );
}
