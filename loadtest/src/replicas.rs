//! The `replicas` scenario: a fleet of extractor replicas that share one provider key.
//! Three extractor processes in the US region on one key whose provider answers 429
//! above 4 calls in flight. Three variants (`Variant`): all three alive with one tenant;
//! one tenant with one replica killed (-9, not restarted) a third of the way through and
//! a new one started at two thirds; two tenants (acme, beta) sharing the key, all
//! alive. The fleet must stay within the key's limit whatever the number of replicas,
//! and the survivors must take the dead replica's share at once.
//!
//! Each report says where the time above the physical limit went: the provider's
//! capacity (calls it allows × the run) left unused, split by what the run was doing
//! then (`Unused`).

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

/// What the fleet goes through during the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// Three replicas alive throughout, one tenant.
    Alive,
    /// One tenant; a replica killed at a third, a new one started at two thirds.
    Killed,
    /// Two tenants sharing the key, three replicas alive throughout.
    Tenants,
    /// Two tenants, and a replica killed and another started (the test suite's).
    KilledTenants,
}

impl Variant {
    /// The variants of record.
    pub const ALL: [Variant; 3] = [Variant::Alive, Variant::Killed, Variant::Tenants];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Alive => "alive",
            Variant::Killed => "killed",
            Variant::Tenants => "tenants",
            Variant::KilledTenants => "killed_tenants",
        }
    }

    pub fn tenants(self) -> usize {
        if matches!(self, Variant::Tenants | Variant::KilledTenants) { 2 } else { 1 }
    }

    pub fn kills(self) -> bool {
        matches!(self, Variant::Killed | Variant::KilledTenants)
    }
}

#[derive(Debug, Clone)]
pub struct ReplicasConfig {
    pub variant: Variant,
    /// Jobs in all (spread over the variant's tenants).
    pub jobs: usize,
    pub provider_latency: Duration,
    /// The provider's limit on the key: calls in flight above it are answered 429.
    pub provider_cap: usize,
    /// What the deployment is told the key's limit is (`REVIEWLANE_KEY_LIMIT`).
    pub key_limit: u32,
    pub lease: Duration,
}

impl ReplicasConfig {
    /// The scenario of record: 200 jobs of 1 s against a cap of 4 (50 s at the limit).
    pub fn full(variant: Variant) -> Self {
        ReplicasConfig {
            variant,
            jobs: 200,
            provider_latency: Duration::from_secs(1),
            provider_cap: 4,
            key_limit: 4,
            lease: Duration::from_secs(3),
        }
    }

    /// The test suite's: 40 jobs of 300 ms, two tenants, a replica killed.
    pub fn small() -> Self {
        ReplicasConfig {
            variant: Variant::KilledTenants,
            jobs: 40,
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
        self.provider_latency * self.jobs as u32 / self.provider_cap as u32
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ReplicasReport {
    pub variant: Variant,
    /// Where the time above the physical limit went.
    pub unused: Unused,
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
    pub killed_at_s: Option<f64>,
    pub started: String,
    pub started_at_s: Option<f64>,
}

/// Runs the scenario on a `ProcStack` started with `cfg.options()`.
pub async fn run(stack: &mut ProcStack, cfg: &ReplicasConfig) -> anyhow::Result<ReplicasReport> {
    let channel = load::connect(stack.ingress).await?;
    let tenants = cfg.variant.tenants();
    let jobs: Arc<Vec<Job>> = Arc::new(
        (0..cfg.jobs)
            .map(|i| Job {
                tenant: if i % tenants == 0 { Tenant::Acme } else { Tenant::Beta },
                lane: Lane::Interactive,
                idempotency_key: format!("replicas-{i}"),
                diff: corpus::generate(50_000 + i as u64, Size::Small),
            })
            .collect(),
    );
    let start = Instant::now();
    let start_unix_ms = reviewlane_shared::telemetry::now_ms();
    let pace = Pace { concurrency: 16, rate: None, timeout: Duration::from_secs(10) };
    let submitted = load::submit(&channel, &jobs, (0..jobs.len()).collect(), pace).await;
    let limit = cfg.physical_limit();
    let (mut killed, mut killed_at, mut killed_unix_ms) = (String::new(), None, u64::MAX);
    let (mut started, mut started_at) = (String::new(), None);
    if cfg.variant.kills() {
        // A third of the way: one replica killed, not restarted.
        tokio::time::sleep((limit / 3).saturating_sub(start.elapsed())).await;
        killed = "extractor-us-1".to_string();
        killed_at = Some(start.elapsed());
        killed_unix_ms = reviewlane_shared::telemetry::now_ms();
        if let Some(s) = stack.service(&killed) {
            s.signal("KILL")?;
        }
        // Two thirds: a new one.
        tokio::time::sleep((limit * 2 / 3).saturating_sub(start.elapsed())).await;
        started_at = Some(start.elapsed());
        started = stack.spawn_extractor(Region::Us)?;
    }

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
    let kill_ms = killed_at.map(|k| k.as_millis() as u64);
    let unused = unused(&stats, start_unix_ms, (makespan * 1000.0) as u64, cfg, kill_ms);
    Ok(ReplicasReport {
        variant: cfg.variant,
        unused,
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
        killed_at_s: killed_at.map(|d| round(d.as_secs_f64())),
        started,
        started_at_s: started_at.map(|d| round(d.as_secs_f64())),
    })
}

/// The provider's capacity the run left unused, in seconds of the run (capacity-seconds
/// over the calls it allows at once), by what the run was doing then: ramping up before
/// the provider first ran at its cap; within 3 s after a 429 (its pause and the window's
/// regain); from a kill until the dead replica's lease has run out and a second more;
/// the tail, once fewer jobs were left than the cap allows; and the rest.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Unused {
    /// When the calls answered 429 started, in seconds of the run.
    pub refused_at_s: Vec<f64>,
    pub ramp_s: f64,
    pub after_429_s: f64,
    pub after_kill_s: f64,
    pub tail_s: f64,
    pub other_s: f64,
}

fn unused(
    stats: &crate::simprovider::Stats,
    start_unix_ms: u64,
    makespan_ms: u64,
    cfg: &ReplicasConfig,
    kill_ms: Option<u64>,
) -> Unused {
    let cap = cfg.provider_cap as f64;
    let rel = |unix_ms: u64| unix_ms.saturating_sub(start_unix_ms);
    // Paid calls in flight, per 10 ms step of the run.
    let steps = (makespan_ms / 10) as usize + 1;
    let mut busy = vec![0u32; steps];
    for c in &stats.paid_calls {
        let (a, b) = ((rel(c.started_unix_ms) / 10) as usize, (rel(c.answered_unix_ms) / 10) as usize);
        for slot in busy.iter_mut().take(b.min(steps)).skip(a) {
            *slot += 1;
        }
    }
    // The refused calls' times: a job's calls run one after another and only its last
    // is paid, so its calls before the paid ones were refused (or lost with a killed
    // replica); on the provider's clock, moved to the run's by a paid call seen on both.
    let offset = stats.paid_calls.first().map(|c| c.started_unix_ms as i64 - (c.started_us / 1000) as i64);
    let mut refused = Vec::new();
    for (job, times) in &stats.call_times_ms {
        let paid = stats.paid_by_job.get(job).copied().unwrap_or(0) as usize;
        let mut times = times.clone();
        times.sort();
        for t in &times[..times.len().saturating_sub(paid)] {
            refused.extend(offset.map(|o| rel((*t as i64 + o).max(0) as u64)));
        }
    }
    let ramp_end = busy.iter().position(|b| f64::from(*b) >= cap).unwrap_or(steps) as u64 * 10;
    let tail_from = {
        let mut ends: Vec<u64> = stats.paid_calls.iter().map(|c| rel(c.started_unix_ms)).collect();
        ends.sort();
        ends.iter().rev().nth(cfg.provider_cap.saturating_sub(1)).copied().unwrap_or(makespan_ms)
    };
    let kill_window = kill_ms.map(|k| (k, k + cfg.lease.as_millis() as u64 + 1_000));
    let mut u = Unused::default();
    for (i, b) in busy.iter().enumerate() {
        let t = i as u64 * 10;
        let idle = (cap - f64::from(*b)).max(0.0) * 0.01 / cap;
        let slot = if t < ramp_end {
            &mut u.ramp_s
        } else if t >= tail_from {
            &mut u.tail_s
        } else if kill_window.is_some_and(|(a, b)| (a..b).contains(&t)) {
            &mut u.after_kill_s
        } else if refused.iter().any(|r| (*r..*r + 3_000).contains(&t)) {
            &mut u.after_429_s
        } else {
            &mut u.other_s
        };
        *slot += idle;
    }
    let round = |x: f64| (x * 100.0).round() / 100.0;
    refused.sort();
    Unused {
        refused_at_s: refused.iter().map(|ms| round(*ms as f64 / 1000.0)).collect(),
        ramp_s: round(u.ramp_s),
        after_429_s: round(u.after_429_s),
        after_kill_s: round(u.after_kill_s),
        tail_s: round(u.tail_s),
        other_s: round(u.other_s),
    }
}

pub fn print(r: &ReplicasReport) {
    println!(
        "replicas ({}): {} jobs, {} published, {} lost, terminal {:?}, by tenant {:?}",
        r.variant.name(),
        r.jobs,
        r.published,
        r.lost,
        r.terminal,
        r.published_by_tenant
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
        "  last result {:.2} s against the physical limit {:.2} s: {:.3}x",
        r.makespan_s, r.physical_limit_s, r.ratio_to_physical
    );
    if let (Some(k), Some(s)) = (r.killed_at_s, r.started_at_s) {
        println!("  {} killed at {k:.1} s, {} started at {s:.1} s", r.killed, r.started);
    }
    let u = &r.unused;
    println!(
        "  capacity unused, in seconds of the run: ramp {:.2}, after a 429 {:.2}, after the kill {:.2}, tail {:.2}, other {:.2}; 429s at {:?} s",
        u.ramp_s, u.after_429_s, u.after_kill_s, u.tail_s, u.other_s, u.refused_at_s
    );
}
