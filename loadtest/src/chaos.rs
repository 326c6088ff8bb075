//! The chaos scenario: jobs over both regions while a driver kill -9s a random service
//! every few seconds and starts it again, freezes one extractor (SIGSTOP) past its lease
//! once, and kill -9s and restarts one nats-server once. The client behaves as a real
//! one: a submit that fails for want of a server is sent again with the same
//! idempotency key.
//!
//! What it reports: jobs lost (accepted, never published), stranded (not final at the
//! end), paid twice (a second paid answer for a job whose earlier answer reached a live
//! worker), re-paid because the earlier answer died with its caller (the call was in
//! flight on a replica killed or frozen at that moment: the provider answered a process
//! that no longer listened), duplicate webhook deliveries (each carries the job id as
//! `Idempotency-Key`), and the time to drain after the last fault.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use reviewlane_api::proto::JobState;
use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_core::region::{Lane, Region};
use reviewlane_shared::telemetry::now_ms;
use serde::Serialize;
use serde_json::json;

use crate::corpus::{self, Size};
use crate::load::{self, Job, Sent, Submitted, Tenant};
use crate::procs::ProcStack;
use crate::simprovider::SimConfig;
use crate::stack::StackOptions;

#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub jobs: usize,
    /// Submits per second.
    pub rate: f64,
    /// A kill -9 of a random service this often.
    pub fault_every: Duration,
    /// The extractors' lease; the frozen one stays stopped for twice that.
    pub lease: Duration,
    pub provider_latency: Duration,
    /// How long the jobs may take to end after the last fault.
    pub drain_limit: Duration,
    /// The first faults, in order; then random kill -9s for as long as submits go on.
    pub script: Vec<Scripted>,
}

/// A fault the driver is told to cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scripted {
    /// kill -9 this service and start it again.
    Kill(&'static str),
    /// kill -9 a service picked at random and start it again.
    KillAny,
    /// SIGSTOP this extractor for twice the lease, then SIGCONT.
    Freeze(&'static str),
    /// kill -9 the US nats-server and start it again on its store.
    RestartNats,
}

impl ChaosConfig {
    /// The scenario of record: 1,000 jobs at 25/s, a fault every 3 s: each kind of
    /// service killed at least once, then kills at random while submits go on.
    pub fn full() -> Self {
        ChaosConfig {
            jobs: 1_000,
            rate: 25.0,
            fault_every: Duration::from_secs(3),
            lease: Duration::from_secs(5),
            provider_latency: Duration::from_millis(200),
            drain_limit: Duration::from_secs(180),
            script: vec![
                Scripted::Kill("extractor-us-1"),
                Scripted::Kill("publisher-us"),
                Scripted::Freeze("extractor-us"),
                Scripted::Kill("ingress"),
                Scripted::RestartNats,
                Scripted::Kill("publisher-eu"),
                Scripted::Kill("extractor-eu"),
            ],
        }
    }

    /// The test suite's: 80 jobs over 16 s, each kind of fault on each kind of service
    /// while jobs are in flight.
    pub fn small() -> Self {
        ChaosConfig {
            jobs: 80,
            rate: 5.0,
            fault_every: Duration::from_secs(1),
            lease: Duration::from_secs(2),
            provider_latency: Duration::from_millis(300),
            drain_limit: Duration::from_secs(90),
            script: vec![
                Scripted::Kill("ingress"),
                Scripted::Kill("extractor-eu"),
                Scripted::Freeze("extractor-us"),
                Scripted::Kill("publisher-us"),
                Scripted::RestartNats,
                Scripted::Kill("extractor-us-1"),
                Scripted::Kill("publisher-eu"),
            ],
        }
    }

    /// Two extractors per region (one can be frozen while the other works).
    pub fn options(&self) -> StackOptions {
        let sim = SimConfig { latency: self.provider_latency, ..Default::default() };
        StackOptions {
            extractors: 2,
            lease: self.lease,
            us_provider: sim.clone(),
            eu_provider: sim,
            extractor_concurrency: 8,
            key_limit: 8,
            publish_lease: self.lease,
            ..Default::default()
        }
    }
}

/// One fault the driver caused.
#[derive(Debug, Clone, Serialize)]
pub struct Fault {
    pub kind: &'static str,
    pub target: String,
    pub at_unix_ms: u64,
    /// When the target was whole again (restarted, thawed).
    pub until_unix_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    pub jobs: usize,
    pub accepted: usize,
    pub published: usize,
    pub terminal: BTreeMap<String, usize>,
    pub lost: usize,
    pub stranded: usize,
    /// Stranded jobs by region, and the state each was last seen in.
    pub stranded_by_region: BTreeMap<String, usize>,
    pub paid_calls: usize,
    pub paid_twice: usize,
    pub repaid_after_caller_fault: usize,
    pub duplicate_deliveries: u64,
    pub submit_retries: usize,
    /// Submits never accepted, by the last status (or `timeout`).
    pub not_accepted: BTreeMap<String, usize>,
    pub faults: Vec<Fault>,
    pub drain_after_last_fault_s: f64,
    pub run_s: f64,
}

impl ChaosReport {
    pub fn correct(&self) -> bool {
        self.accepted == self.jobs && self.lost == 0 && self.stranded == 0 && self.paid_twice == 0
    }
}

const SERVICES: [&str; 7] =
    ["ingress", "extractor-us", "extractor-us-1", "publisher-us", "extractor-eu", "extractor-eu-1", "publisher-eu"];

/// Which provider key a replica calls with (`procs`: `sk-load-<n>`), and its region.
fn caller_of(service: &str) -> Option<(Region, &'static str)> {
    match service {
        "extractor-us" => Some((Region::Us, "sk-load-0")),
        "extractor-us-1" => Some((Region::Us, "sk-load-1")),
        "extractor-eu" => Some((Region::Eu, "sk-load-0")),
        "extractor-eu-1" => Some((Region::Eu, "sk-load-1")),
        _ => None,
    }
}

fn jobs(n: usize) -> Arc<Vec<Job>> {
    let tenants = [Tenant::Acme, Tenant::Euro, Tenant::Beta, Tenant::Euro];
    Arc::new(
        (0..n)
            .map(|i| Job {
                tenant: tenants[i % tenants.len()],
                lane: if i % 5 == 4 { Lane::Batch } else { Lane::Interactive },
                idempotency_key: format!("chaos-{i}"),
                diff: corpus::generate(90_000 + i as u64, Size::Small),
            })
            .collect(),
    )
}

/// Submits every job, sending a failed submit again with the same key (as a client
/// does when the ingress restarts) until it is answered.
async fn submit_all(channel: tonic::transport::Channel, jobs: Arc<Vec<Job>>, rate: f64) -> (Vec<Submitted>, usize) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut tasks = Vec::new();
    for i in 0..jobs.len() {
        tick.tick().await;
        let (channel, jobs) = (channel.clone(), jobs.clone());
        tasks.push(tokio::spawn(async move {
            let job = &jobs[i];
            let started = Instant::now();
            let mut retries = 0;
            let deadline = started + Duration::from_secs(120);
            loop {
                let mut client = ReviewServiceClient::new(channel.clone());
                let req = load::request(job);
                match tokio::time::timeout(Duration::from_secs(5), client.submit_review(req)).await {
                    Ok(Ok(_)) => {
                        let submit_ms = started.elapsed().as_secs_f64() * 1000.0;
                        return (
                            Submitted { job: i, job_id: job.job_id(), started, submit_ms, sent: Sent::Accepted },
                            retries,
                        );
                    }
                    Ok(Err(status)) if !retryable(status.code()) || Instant::now() > deadline => {
                        let sent = Sent::Refused(status.code());
                        return (Submitted { job: i, job_id: job.job_id(), started, submit_ms: 0.0, sent }, retries);
                    }
                    _ if Instant::now() > deadline => {
                        let sent = Sent::Timeout;
                        return (Submitted { job: i, job_id: job.job_id(), started, submit_ms: 0.0, sent }, retries);
                    }
                    other => {
                        retries += 1;
                        // A refusal names its retry delay (`RetryInfo`); an outage does not.
                        let wait = match other {
                            Ok(Err(status)) => {
                                tonic_types::StatusExt::get_details_retry_info(&status).and_then(|r| r.retry_delay)
                            }
                            _ => None,
                        };
                        tokio::time::sleep(wait.unwrap_or(Duration::from_millis(200))).await;
                    }
                }
            }
        }));
    }
    let mut out = Vec::new();
    let mut retries = 0;
    for t in tasks {
        let (s, r) = t.await.expect("submit task");
        out.push(s);
        retries += r;
    }
    (out, retries)
}

/// Worth sending again with the same key: the server was away, or refused for now
/// (`RESOURCE_EXHAUSTED`, after its retry delay).
fn retryable(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::Internal
            | tonic::Code::ResourceExhausted
    )
}

/// Causes the scripted faults, then random kill -9s while `submitting` holds.
async fn drive(
    stack: &mut ProcStack,
    cfg: &ChaosConfig,
    submitting: &tokio::sync::watch::Receiver<bool>,
) -> Vec<Fault> {
    let mut faults = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut script = cfg.script.iter().copied();
    loop {
        tokio::time::sleep(cfg.fault_every).await;
        let next = match script.next() {
            Some(p) => p,
            None if *submitting.borrow() => Scripted::KillAny,
            None => return faults,
        };
        let at = now_ms();
        let (kind, target) = match next {
            Scripted::Freeze(target) => {
                if let Some(s) = stack.service(target) {
                    let _ = s.signal("STOP");
                    tokio::time::sleep(cfg.lease * 2).await;
                    let _ = s.signal("CONT");
                }
                ("sigstop", target)
            }
            Scripted::RestartNats => {
                stack.us.nats.restart();
                ("nats_restart", "nats-us")
            }
            Scripted::Kill(target) => (kill(stack, target), target),
            Scripted::KillAny => {
                let target = SERVICES[rng.random_range(0..SERVICES.len())];
                (kill(stack, target), target)
            }
        };
        faults.push(Fault { kind, target: target.into(), at_unix_ms: at, until_unix_ms: now_ms() });
    }
}

fn kill(stack: &mut ProcStack, target: &str) -> &'static str {
    if let Some(s) = stack.service_mut(target)
        && let Err(e) = s.kill_and_restart()
    {
        eprintln!("chaos: restarting {target} failed: {e}");
    }
    "kill9"
}

/// Runs the chaos scenario on a started `ProcStack` (see `ChaosConfig::options`).
pub async fn run(stack: &mut ProcStack, cfg: &ChaosConfig) -> anyhow::Result<ChaosReport> {
    let channel = load::connect_lazy(stack.ingress)?;
    let jobs = jobs(cfg.jobs);
    let start = Instant::now();
    let (done_tx, done_rx) = tokio::sync::watch::channel(true);
    let load = {
        let (channel, jobs, rate) = (channel.clone(), jobs.clone(), cfg.rate);
        async move {
            let r = submit_all(channel, jobs, rate).await;
            let _ = done_tx.send(false);
            r
        }
    };
    let ((submitted, submit_retries), faults) = tokio::join!(load, drive(stack, cfg, &done_rx));
    let last_fault = Instant::now();

    let accepted_only: Vec<Submitted> = submitted.iter().filter(|s| s.sent == Sent::Accepted).cloned().collect();
    let finals = load::follow(&channel, &jobs, &accepted_only, cfg.drain_limit).await;
    let drained = Instant::now();
    // Deliveries may trail the final state by a moment.
    let published = finals.values().filter(|f| f.state == JobState::Published).count();
    let deadline = Instant::now() + Duration::from_secs(5);
    while load::deliveries(&stack.webhook).len() < published && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let accepted: Vec<&Submitted> = accepted_only.iter().collect();
    let mut not_accepted = BTreeMap::new();
    for s in &submitted {
        match s.sent {
            Sent::Accepted => {}
            Sent::Timeout => *not_accepted.entry("timeout".to_string()).or_default() += 1,
            Sent::Refused(code) => *not_accepted.entry(format!("{code:?}")).or_default() += 1,
        }
    }
    let stranded = accepted.iter().filter(|s| !finals.contains_key(&s.job_id)).count();
    let mut stranded_by_region = BTreeMap::new();
    for s in accepted.iter().filter(|s| !finals.contains_key(&s.job_id)) {
        *stranded_by_region.entry(s.job_id[..2].to_string()).or_default() += 1;
    }
    let lost = accepted.iter().filter(|s| finals.get(&s.job_id).is_none_or(|f| f.state != JobState::Published)).count();
    let mut terminal = BTreeMap::new();
    for f in finals.values().filter(|f| f.state == JobState::Terminal) {
        *terminal.entry(f.reason.clone()).or_default() += 1;
    }
    let deliveries = load::deliveries(&stack.webhook);
    let duplicate_deliveries = deliveries.values().map(|(n, _)| u64::from(n.saturating_sub(1))).sum();

    // A repeat payment is excused when the earlier paid answer went to a replica that
    // was killed or frozen while the call ran or right after (before it could keep it).
    let (mut paid_calls, mut paid_twice, mut excused) = (0, 0, 0);
    for region in [Region::Us, Region::Eu] {
        let stats = if region == Region::Us { &stack.us } else { &stack.eu }.provider.stats();
        paid_calls += stats.paid_calls.len();
        let mut by_job: BTreeMap<&str, Vec<_>> = BTreeMap::new();
        for c in &stats.paid_calls {
            by_job.entry(c.job.as_str()).or_default().push(c);
        }
        for calls in by_job.values().filter(|c| c.len() > 1) {
            let earlier = &calls[..calls.len() - 1];
            let died_with_caller = earlier.iter().all(|c| {
                faults.iter().any(|f| {
                    matches!(f.kind, "kill9" | "sigstop")
                        && caller_of(&f.target) == Some((region, c.key.as_str()))
                        && f.at_unix_ms + 500 >= c.started_unix_ms
                        && f.at_unix_ms <= c.answered_unix_ms + 2_000
                })
            });
            if died_with_caller {
                excused += calls.len() - 1;
            } else {
                paid_twice += calls.len() - 1;
            }
        }
    }
    let drain = drained.duration_since(last_fault).as_secs_f64();
    Ok(ChaosReport {
        jobs: cfg.jobs,
        accepted: accepted.len(),
        published,
        terminal,
        lost,
        stranded,
        stranded_by_region,
        paid_calls,
        paid_twice,
        repaid_after_caller_fault: excused,
        duplicate_deliveries,
        submit_retries,
        not_accepted,
        faults,
        drain_after_last_fault_s: (drain * 10.0).round() / 10.0,
        run_s: (start.elapsed().as_secs_f64() * 10.0).round() / 10.0,
    })
}

pub fn print(r: &ChaosReport) {
    println!(
        "chaos: {} jobs, {} accepted ({} submits sent again; never accepted: {}), run {:.1} s",
        r.jobs,
        r.accepted,
        r.submit_retries,
        json!(r.not_accepted),
        r.run_s
    );
    let kinds = r.faults.iter().fold(BTreeMap::<&str, usize>::new(), |mut m, f| {
        *m.entry(f.kind).or_default() += 1;
        m
    });
    println!("  faults: {}", json!(kinds));
    println!("  published {}  lost {}  stranded {}  terminal {}", r.published, r.lost, r.stranded, json!(r.terminal));
    println!(
        "  paid calls {}  paid twice {}  re-paid after the caller was killed or frozen mid-call {}",
        r.paid_calls, r.paid_twice, r.repaid_after_caller_fault
    );
    println!("  duplicate webhook deliveries {} (same Idempotency-Key)", r.duplicate_deliveries);
    println!("  drained {:.1} s after the last fault", r.drain_after_last_fault_s);
}
