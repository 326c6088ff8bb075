//! The load scenarios: what each brings up (provider knobs, extractor settings), the
//! workload it drives through the load generator, the correctness checks every
//! scenario shares (every job final, none lost, no duplicate paid call, no duplicate
//! delivery) and the figures it reports. A scenario runs against any `Deployment`: the
//! service processes (`procs::ProcStack`, for measurements) or the in-process stack
//! (`stack::Stack`, for the CI correctness run).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reviewlane_api::proto::JobState;
use reviewlane_core::region::{Lane, Region};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::corpus::{self, Size};
use crate::load::{self, Job, Pace, Sent, Submitted, Tenant, percentile};
use crate::simprovider::{OverCap, SimConfig, SimProvider};
use crate::stack::{RegionStack, StackOptions};
use crate::webhook::WebhookReceiver;

/// What a scenario needs of a running deployment.
pub trait Deployment: Sync {
    fn ingress(&self) -> SocketAddr;
    fn region(&self, region: Region) -> &RegionStack;
    fn webhook(&self) -> &WebhookReceiver;
    /// (service, RSS now MiB, peak MiB); empty when the services share this process.
    fn rss(&self) -> Vec<(String, f64, f64)>;
    fn provider(&self, region: Region) -> &SimProvider {
        &self.region(region).provider
    }
    fn nats_url(&self, region: Region) -> &str {
        self.region(region).nats.url()
    }
    /// Each service's admin address (`/metrics`).
    fn admin(&self) -> Vec<(String, SocketAddr)>;
    /// CPU seconds used so far by each service process and nats-server; empty when the
    /// services share this process.
    fn cpu(&self) -> Vec<(String, f64)> {
        Vec::new()
    }
}

/// Messages each service has sent to NATS so far (`reviewlane_nats_messages_total`,
/// direction `sent`): every JetStream request, publish, acknowledgement and pull.
async fn nats_messages_sent(d: &dyn Deployment) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (name, addr) in d.admin() {
        let page = crate::stack::http_get(addr, "/metrics").await;
        let sent: f64 = page
            .lines()
            .filter(|l| l.starts_with("reviewlane_nats_messages_total{") && l.contains("direction=\"sent\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        *out.entry(name).or_default() += sent;
    }
    out
}

impl Deployment for crate::stack::Stack {
    fn ingress(&self) -> SocketAddr {
        self.ingress
    }
    fn region(&self, region: Region) -> &RegionStack {
        crate::stack::Stack::region(self, region)
    }
    fn webhook(&self) -> &WebhookReceiver {
        &self.webhook
    }
    fn rss(&self) -> Vec<(String, f64, f64)> {
        Vec::new()
    }
    fn admin(&self) -> Vec<(String, SocketAddr)> {
        let mut out = vec![("ingress".to_string(), self.ingress_admin)];
        out.extend(self.extractor_admin.iter().map(|(r, a)| (format!("extractor-{r}"), *a)));
        out.extend(self.publisher_admin.iter().map(|(r, a)| (format!("publisher-{r}"), *a)));
        out
    }
}

impl Deployment for crate::procs::ProcStack {
    fn ingress(&self) -> SocketAddr {
        self.ingress
    }
    fn region(&self, region: Region) -> &RegionStack {
        if region == Region::Us { &self.us } else { &self.eu }
    }
    fn webhook(&self) -> &WebhookReceiver {
        &self.webhook
    }
    fn rss(&self) -> Vec<(String, f64, f64)> {
        crate::procs::ProcStack::rss(self)
    }
    fn admin(&self) -> Vec<(String, SocketAddr)> {
        self.admin.clone()
    }
    fn cpu(&self) -> Vec<(String, f64)> {
        crate::procs::ProcStack::cpu(self)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    Lab,
    Storm,
    Dup,
    Overhead,
    Flood,
    Fairness,
    Soak,
    Idle,
}

impl Scenario {
    pub const ALL: [Scenario; 8] = [
        Scenario::Lab,
        Scenario::Storm,
        Scenario::Dup,
        Scenario::Overhead,
        Scenario::Flood,
        Scenario::Fairness,
        Scenario::Soak,
        Scenario::Idle,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Lab => "lab",
            Scenario::Storm => "storm",
            Scenario::Dup => "dup",
            Scenario::Overhead => "overhead",
            Scenario::Flood => "flood",
            Scenario::Fairness => "fairness",
            Scenario::Soak => "soak",
            Scenario::Idle => "idle",
        }
    }

    pub fn parse(s: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|x| x.name() == s)
    }
}

/// `Full`: the numbers of the issue (measurements). `Ci`: a small correctness-only run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    Full,
    Ci,
}

/// Knobs a run may override: job count and soak duration.
#[derive(Debug, Clone, Copy, Default)]
pub struct Overrides {
    pub jobs: Option<usize>,
    pub duration: Option<Duration>,
}

/// What a scenario reports; printed as a table and as the last line (JSON).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: &'static str,
    pub jobs: usize,
    pub completed: usize,
    pub lost: usize,
    pub duplicate_paid_calls: u64,
    pub duplicate_deliveries: u64,
    pub paid_calls: u64,
    pub calls_429: u64,
    pub provider_calls: u64,
    pub makespan_s: f64,
    pub physical_limit_s: Option<f64>,
    pub submit_p50_ms: f64,
    pub submit_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    pub rss_peak_mib: BTreeMap<String, f64>,
    pub rss_idle_mib: BTreeMap<String, f64>,
    /// The scenario's own figures.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Report {
    /// Correctness every scenario must keep: nothing lost, nothing paid or delivered twice.
    pub fn correct(&self) -> bool {
        self.lost == 0 && self.duplicate_paid_calls == 0 && self.duplicate_deliveries == 0
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0 * 100.0).round() / 100.0
}

fn round(x: f64, places: i32) -> f64 {
    let f = 10f64.powi(places);
    (x * f).round() / f
}

/// The deployment a scenario needs.
pub fn options(s: Scenario, scale: Scale) -> StackOptions {
    let ci = scale == Scale::Ci;
    let sim = |latency_ms: u64, cap: Option<usize>, over_cap: OverCap| SimConfig {
        latency: Duration::from_millis(latency_ms),
        concurrency_cap: cap,
        over_cap,
        ..Default::default()
    };
    let reject = || OverCap::Reject { headers: vec![("retry-after".into(), if ci { "1" } else { "2" }.into())] };
    let mut o = StackOptions { lease: Duration::from_secs(30), ..Default::default() };
    let (provider, concurrency) = match s {
        Scenario::Lab => (sim(if ci { 300 } else { 3000 }, Some(2), OverCap::Queue), 8),
        Scenario::Storm => (sim(if ci { 300 } else { 3000 }, Some(2), reject()), 8),
        Scenario::Dup => (sim(100, None, OverCap::Queue), 8),
        Scenario::Overhead | Scenario::Idle => (sim(0, None, OverCap::Queue), 32),
        Scenario::Flood | Scenario::Fairness => (sim(if ci { 20 } else { 200 }, None, OverCap::Queue), 8),
        Scenario::Soak => (sim(100, None, OverCap::Queue), 16),
    };
    o.us_provider = provider.clone();
    o.eu_provider = provider;
    o.extractor_concurrency = concurrency;
    o.key_limit = concurrency as u32;
    if s == Scenario::Flood {
        // The lane bounds (10k) hold the flood.
        o.lane_max_messages = Some(20_000);
    }
    o
}

/// Runs scenario `s` against `d`, checks correctness, and reports.
pub async fn run(s: Scenario, scale: Scale, over: Overrides, d: &dyn Deployment) -> anyhow::Result<Report> {
    let rss_idle: BTreeMap<String, f64> = d.rss().into_iter().map(|(n, now, _)| (n, round(now, 1))).collect();
    let channel = load::connect(d.ingress()).await?;
    let ci = scale == Scale::Ci;
    let sent_before = nats_messages_sent(d).await;
    let cpu_before: BTreeMap<String, f64> = d.cpu().into_iter().collect();
    let start = Instant::now();
    let mut extra = Map::new();
    let opts = options(s, scale);
    let latency = opts.us_provider.latency.as_secs_f64();
    let (jobs, submitted, physical) = match s {
        Scenario::Lab => {
            let n = over.jobs.unwrap_or(10);
            let jobs = uniform(n, Tenant::Acme, Lane::Interactive, "lab", Size::Small);
            let pace = Pace { concurrency: n, rate: None, timeout: Duration::from_secs(10) };
            let sub = load::submit(&channel, &jobs, (0..n).collect(), pace).await;
            extra.insert("answered".into(), json!(sub.iter().filter(|x| x.sent == Sent::Accepted).count()));
            extra.insert("client_timeouts".into(), json!(sub.iter().filter(|x| x.sent == Sent::Timeout).count()));
            let lat: Vec<f64> = sub.iter().map(|x| x.submit_ms).collect();
            extra.insert("submit_p95_ms".into(), json!(round(percentile(&lat, 0.95), 2)));
            (jobs, sub, Some(n as f64 * latency / 2.0))
        }
        Scenario::Storm => {
            let n = over.jobs.unwrap_or(if ci { 10 } else { 40 });
            let jobs = uniform(n, Tenant::Acme, Lane::Interactive, "storm", Size::Small);
            let pace = Pace { concurrency: 8, rate: None, timeout: Duration::from_secs(10) };
            let sub = load::submit(&channel, &jobs, (0..n).collect(), pace).await;
            (jobs, sub, Some(n as f64 * latency / 2.0))
        }
        Scenario::Dup => {
            // 10 submits with one key, and 10 keys sent 3 times each, all at once.
            let diff = |i: usize| corpus::generate(7_000 + i as u64, Size::Small);
            let mut jobs: Vec<Job> = (0..10)
                .map(|_| Job {
                    tenant: Tenant::Acme,
                    lane: Lane::Interactive,
                    idempotency_key: "dup-one".into(),
                    diff: diff(0),
                })
                .collect();
            for k in 0..10 {
                for _ in 0..3 {
                    jobs.push(Job {
                        tenant: Tenant::Acme,
                        lane: Lane::Interactive,
                        idempotency_key: format!("dup-{k}"),
                        diff: diff(k + 1),
                    });
                }
            }
            let jobs = Arc::new(jobs);
            let pace = Pace { concurrency: jobs.len(), rate: None, timeout: Duration::from_secs(10) };
            let sub = load::submit(&channel, &jobs, (0..jobs.len()).collect(), pace).await;
            let created: std::collections::BTreeSet<&str> = sub.iter().map(|x| x.job_id.as_str()).collect();
            extra.insert("submits".into(), json!(sub.len()));
            extra.insert("jobs_created".into(), json!(created.len()));
            extra.insert("expected_jobs".into(), json!(11));
            (jobs, sub, None)
        }
        Scenario::Overhead => {
            let n = over.jobs.unwrap_or(if ci { 200 } else { 10_000 });
            let jobs = mixed(n, "overhead");
            // First one at a time (the latency of a submit on a quiet system), then
            // the rest 64 at a time (the throughput).
            let probe = (n / 50).clamp(1, 200);
            let pace = Pace { concurrency: 1, rate: None, timeout: Duration::from_secs(10) };
            let mut sub = load::submit(&channel, &jobs, (0..probe).collect(), pace).await;
            let lat: Vec<f64> = sub.iter().map(|x| x.submit_ms).collect();
            extra.insert("one_at_a_time_submits".into(), json!(probe));
            extra.insert("one_at_a_time_submit_p50_ms".into(), json!(round(percentile(&lat, 0.5), 2)));
            extra.insert("one_at_a_time_submit_p99_ms".into(), json!(round(percentile(&lat, 0.99), 2)));
            let pace = Pace { concurrency: 64, rate: None, timeout: Duration::from_secs(10) };
            let t = Instant::now();
            let flood = load::submit(&channel, &jobs, (probe..n).collect(), pace).await;
            let submit_s = t.elapsed().as_secs_f64();
            let flood_lat: Vec<f64> = flood.iter().map(|x| x.submit_ms).collect();
            extra.insert("loaded_submit_p50_ms".into(), json!(round(percentile(&flood_lat, 0.5), 2)));
            extra.insert("loaded_submit_p99_ms".into(), json!(round(percentile(&flood_lat, 0.99), 2)));
            let accepted = flood.iter().filter(|x| x.sent == Sent::Accepted).count();
            sub.extend(flood);
            extra.insert("submit_phase_s".into(), json!(round(submit_s, 2)));
            extra.insert("ingress_jobs_per_s".into(), json!(round(accepted as f64 / submit_s, 1)));
            (jobs, sub, None)
        }
        Scenario::Flood => {
            let batch = over.jobs.unwrap_or(if ci { 100 } else { 2_000 });
            let interactive = if ci { 5 } else { 30 };
            let mut all = (*uniform(batch, Tenant::Acme, Lane::Batch, "flood-batch", Size::Small)).clone();
            all.extend((*uniform(interactive, Tenant::Beta, Lane::Interactive, "flood-int", Size::Small)).clone());
            let jobs = Arc::new(all);
            let pace = Pace { concurrency: 64, rate: None, timeout: Duration::from_secs(10) };
            let mut sub = load::submit(&channel, &jobs, (0..batch).collect(), pace).await;
            extra.insert("batch_queued_s".into(), json!(round(start.elapsed().as_secs_f64(), 2)));
            let pace = Pace { concurrency: 4, rate: Some(1.0), timeout: Duration::from_secs(10) };
            sub.extend(load::submit(&channel, &jobs, (batch..batch + interactive).collect(), pace).await);
            (jobs, sub, Some((batch + interactive) as f64 * latency / opts.extractor_concurrency as f64))
        }
        Scenario::Fairness => {
            let flood = over.jobs.unwrap_or(if ci { 60 } else { 400 });
            let few = 5;
            let mut all = (*uniform(flood, Tenant::Acme, Lane::Interactive, "fair-flood", Size::Small)).clone();
            all.extend((*uniform(few, Tenant::Beta, Lane::Interactive, "fair-few", Size::Small)).clone());
            let jobs = Arc::new(all);
            let pace = Pace { concurrency: 64, rate: None, timeout: Duration::from_secs(10) };
            let mut sub = load::submit(&channel, &jobs, (0..flood).collect(), pace).await;
            let pace = Pace { concurrency: few, rate: None, timeout: Duration::from_secs(10) };
            sub.extend(load::submit(&channel, &jobs, (flood..flood + few).collect(), pace).await);
            (jobs, sub, Some((flood + few) as f64 * latency / opts.extractor_concurrency as f64))
        }
        Scenario::Idle => {
            // One job at a time on an otherwise idle stack, the next submitted once the
            // previous one is published; each job's time split at the points this
            // process sees: the submit's answer, the provider call, the sink delivery.
            let n = over.jobs.unwrap_or(if ci { 20 } else { 300 });
            let jobs = uniform(n, Tenant::Acme, Lane::Interactive, "idle", Size::Small);
            let provider = d.provider(Region::Us);
            let epoch = provider.epoch();
            let pace = Pace { concurrency: 1, rate: None, timeout: Duration::from_secs(10) };
            let mut sub = Vec::with_capacity(n);
            let mut stages: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
            for i in 0..n {
                let one = load::submit(&channel, &jobs, vec![i], pace).await;
                let Some(x) = one.into_iter().next() else { continue };
                let accepted = x.sent == Sent::Accepted;
                let id = x.job_id.clone();
                sub.push(x);
                if !accepted {
                    continue;
                }
                let Some(got) = d.webhook().wait_for(&id, Duration::from_secs(10)).await else { continue };
                let x = sub.last().expect("just pushed");
                if let Some(c) = provider.stats().paid_calls.iter().find(|c| c.job == id) {
                    split_by_stage(&mut stages, x, c, epoch, got.at);
                }
                // Idle again before the next: the job's last writes (after the delivery) done.
                let _ = load::watch_final(&channel, &jobs[i], Duration::from_secs(5)).await;
            }
            extra.insert("stages".into(), stage_percentiles(&stages));
            (jobs, sub, None)
        }
        Scenario::Soak => {
            let secs = over.duration.unwrap_or(Duration::from_secs(if ci { 20 } else { 600 })).as_secs_f64();
            let rate = if ci { 5.0 } else { 20.0 };
            let n = (secs * rate) as usize;
            let jobs = mixed(n, "soak");
            // 429 bursts: every 60 s (10 s in CI) the providers answer 429 for 5 s (2 s).
            let (every, burst) = if ci { (10.0, 2.0) } else { (60.0, 5.0) };
            let samples = Arc::new(std::sync::Mutex::new(Vec::new()));
            let stop = tokio_util::sync::CancellationToken::new();
            let chaos = async {
                while !stop.is_cancelled() {
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs_f64(every - burst)) => {}
                        _ = stop.cancelled() => break,
                    }
                    for r in [Region::Us, Region::Eu] {
                        d.provider(r).set_throttled(Some(1));
                    }
                    tokio::time::sleep(Duration::from_secs_f64(burst)).await;
                    for r in [Region::Us, Region::Eu] {
                        d.provider(r).set_throttled(None);
                    }
                }
            };
            let sampler = async {
                let mut tick = tokio::time::interval(Duration::from_secs(if ci { 2 } else { 10 }));
                while !stop.is_cancelled() {
                    tokio::select! { _ = tick.tick() => {}, _ = stop.cancelled() => break }
                    let row: Vec<(String, f64)> = d.rss().into_iter().map(|(n, now, _)| (n, round(now, 1))).collect();
                    samples.lock().expect("samples").push((round(start.elapsed().as_secs_f64(), 0), row));
                }
            };
            let work = async {
                let pace = Pace { concurrency: 64, rate: Some(rate), timeout: Duration::from_secs(10) };
                let sub = load::submit(&channel, &jobs, (0..n).collect(), pace).await;
                stop.cancel();
                sub
            };
            let (sub, _, _) = tokio::join!(work, chaos, sampler);
            d.provider(Region::Us).set_throttled(None);
            d.provider(Region::Eu).set_throttled(None);
            let samples = samples.lock().expect("samples").clone();
            extra.insert("rss_over_time_mib".into(), json!(samples));
            extra.insert("rate_per_s".into(), json!(rate));
            (jobs, sub, None)
        }
    };

    let within = Duration::from_secs(match s {
        Scenario::Overhead | Scenario::Flood | Scenario::Soak => 600,
        _ => 300,
    });
    // The pipeline's own cost, measured before the client starts reading results back:
    // wait for the deliveries (or for them to stop coming), then read each service's
    // NATS messages and CPU time.
    let accepted_n = submitted.iter().filter(|x| x.sent == Sent::Accepted).count();
    d.webhook().wait_count(accepted_n, Duration::from_secs(3), within).await;
    let sent_after = nats_messages_sent(d).await;
    let cpu_after: BTreeMap<String, f64> = d.cpu().into_iter().collect();
    let finals = load::follow(&channel, &jobs, &submitted, within).await;
    // Deliveries may trail the final state by a moment.
    let published = finals.values().filter(|f| f.state == JobState::Published).count();
    let deadline = Instant::now() + Duration::from_secs(5);
    while load::deliveries(d.webhook()).len() < published && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deliveries = load::deliveries(d.webhook());

    // Each job id once, with its first submit.
    let mut first: BTreeMap<&str, &Submitted> = BTreeMap::new();
    for x in &submitted {
        let e = first.entry(x.job_id.as_str()).or_insert(x);
        if x.started < e.started {
            *e = x;
        }
    }
    let accepted: Vec<&str> = first
        .iter()
        .filter(|(id, _)| submitted.iter().any(|x| x.job_id == **id && x.sent == Sent::Accepted))
        .map(|(id, _)| *id)
        .collect();
    let completed = accepted.iter().filter(|id| finals.contains_key(**id)).count();
    let lost = accepted.len() - completed;
    // NATS messages sent per finished job, by service (idle polling included: a bound on
    // the round trips a job costs, tight under load).
    let per_job: BTreeMap<String, f64> = sent_after
        .iter()
        .map(|(name, after)| {
            let before = sent_before.get(name).copied().unwrap_or(0.0);
            (name.clone(), round((after - before) / completed.max(1) as f64, 2))
        })
        .collect();
    extra.insert("nats_messages_sent_per_job_total".into(), json!(round(per_job.values().sum::<f64>(), 2)));
    extra.insert("nats_messages_sent_per_job".into(), json!(per_job));
    // CPU microseconds per finished job, by process.
    let cpu_per_job: BTreeMap<String, f64> = cpu_after
        .iter()
        .map(|(name, after)| {
            let before = cpu_before.get(name).copied().unwrap_or(0.0);
            (name.clone(), round((after - before) * 1e6 / completed.max(1) as f64, 0))
        })
        .collect();
    if !cpu_per_job.is_empty() {
        extra.insert("cpu_us_per_job".into(), json!(cpu_per_job));
    }
    let e2e_of = |id: &str| -> Option<f64> {
        let (_, at) = deliveries.get(id)?;
        Some(ms(at.duration_since(first.get(id)?.started)))
    };
    let e2e: Vec<f64> = accepted.iter().filter_map(|id| e2e_of(id)).collect();
    let submit_ms: Vec<f64> = submitted.iter().map(|x| x.submit_ms).collect();
    let makespan = deliveries
        .values()
        .map(|(_, at)| at.saturating_duration_since(start))
        .chain(std::iter::once(Duration::ZERO))
        .max()
        .unwrap_or_default()
        .as_secs_f64();

    let (mut paid, mut dup_paid, mut calls_429, mut calls) = (0, 0, 0, 0);
    for r in [Region::Us, Region::Eu] {
        let st = d.provider(r).stats();
        paid += st.paid_by_job.values().sum::<u64>();
        dup_paid += st.paid_by_job.values().map(|n| n.saturating_sub(1)).sum::<u64>();
        calls_429 += st.calls_429;
        calls += st.total_calls;
    }
    let dup_deliveries: u64 = deliveries.values().map(|(n, _)| u64::from(n.saturating_sub(1))).sum();

    // Scenario figures that need the outcome.
    match s {
        Scenario::Lab | Scenario::Storm => {
            extra.insert("last_result_s".into(), json!(round(makespan, 1)));
        }
        Scenario::Flood => {
            let int: Vec<f64> =
                accepted.iter().filter_map(|id| lane_e2e(&jobs, &first, id, Lane::Interactive, &e2e_of)).collect();
            extra.insert("interactive_e2e_p50_ms".into(), json!(round(percentile(&int, 0.5), 1)));
            extra.insert("interactive_e2e_p99_ms".into(), json!(round(percentile(&int, 0.99), 1)));
            extra.insert("interactive_jobs".into(), json!(int.len()));
            // Where an interactive job's time went.
            let provider = d.provider(Region::Us);
            let (epoch, calls) = (provider.epoch(), provider.stats().paid_calls);
            let mut stages = BTreeMap::new();
            for id in
                accepted.iter().filter(|id| first.get(**id).is_some_and(|x| jobs[x.job].lane == Lane::Interactive))
            {
                let (Some(x), Some((_, at)), Some(c)) =
                    (first.get(*id), deliveries.get(*id), calls.iter().find(|c| c.job == **id))
                else {
                    continue;
                };
                split_by_stage(&mut stages, x, c, epoch, *at);
            }
            extra.insert("interactive_stages".into(), stage_percentiles(&stages));
        }
        Scenario::Fairness => {
            let of = |t: Tenant| -> Vec<f64> {
                accepted
                    .iter()
                    .filter(|id| first.get(**id).is_some_and(|x| jobs[x.job].tenant == t))
                    .filter_map(|id| e2e_of(id))
                    .collect()
            };
            let (flooder, other) = (of(Tenant::Acme), of(Tenant::Beta));
            extra.insert("small_tenant_e2e_ms".into(), json!(other.iter().map(|v| round(*v, 0)).collect::<Vec<_>>()));
            extra.insert("small_tenant_e2e_max_ms".into(), json!(round(other.iter().cloned().fold(0.0, f64::max), 0)));
            extra.insert("flooder_e2e_p50_ms".into(), json!(round(percentile(&flooder, 0.5), 0)));
            extra.insert("flooder_e2e_max_ms".into(), json!(round(flooder.iter().cloned().fold(0.0, f64::max), 0)));
        }
        Scenario::Overhead => {
            let raw = raw_jetstream_rate(d.nats_url(Region::Us), &jobs, if ci { 200 } else { 10_000 }, 64).await?;
            // One at a time: the round trip a submit pays three times (record, lane, CAS).
            let one = raw_jetstream_rate(d.nats_url(Region::Us), &jobs, if ci { 50 } else { 1_000 }, 1).await?;
            extra.insert("raw_jetstream_one_at_a_time_ms".into(), json!(round(1000.0 / one, 3)));
            let ours = extra["ingress_jobs_per_s"].as_f64().unwrap_or(0.0);
            extra.insert("raw_jetstream_publishes_per_s".into(), json!(round(raw, 1)));
            extra.insert("ratio_to_raw_jetstream".into(), json!(round(ours / raw, 3)));
            extra.insert("published_jobs_per_s".into(), json!(round(completed as f64 / makespan.max(0.001), 1)));
        }
        Scenario::Dup => {
            extra.insert("paid_calls_expected".into(), json!(11));
        }
        Scenario::Soak | Scenario::Idle => {}
    }
    let terminal: BTreeMap<String, usize> =
        finals.values().filter(|f| f.state == JobState::Terminal).fold(BTreeMap::new(), |mut m, f| {
            *m.entry(f.reason.clone()).or_default() += 1;
            m
        });
    extra.insert("terminal".into(), json!(terminal));
    let refused = submitted.iter().filter(|x| matches!(x.sent, Sent::Refused(_))).count();
    extra.insert("refused_submits".into(), json!(refused));

    Ok(Report {
        scenario: s.name(),
        jobs: accepted.len(),
        completed,
        lost,
        duplicate_paid_calls: dup_paid,
        duplicate_deliveries: dup_deliveries,
        paid_calls: paid,
        calls_429,
        provider_calls: calls,
        makespan_s: round(makespan, 2),
        physical_limit_s: physical.map(|p| round(p, 2)),
        submit_p50_ms: round(percentile(&submit_ms, 0.5), 2),
        submit_p99_ms: round(percentile(&submit_ms, 0.99), 2),
        e2e_p50_ms: round(percentile(&e2e, 0.5), 1),
        e2e_p99_ms: round(percentile(&e2e, 0.99), 1),
        rss_peak_mib: d.rss().into_iter().map(|(n, _, peak)| (n, round(peak, 1))).collect(),
        rss_idle_mib: rss_idle,
        extra,
    })
}

/// Splits one job's time at the points this process sees: the submit's answer, the
/// provider call's start and end (the first paid call), the sink's delivery at `sunk`.
fn split_by_stage(
    stages: &mut BTreeMap<&'static str, Vec<f64>>,
    x: &Submitted,
    call: &crate::simprovider::PaidCall,
    epoch: Instant,
    sunk: Instant,
) {
    let answered = x.started + Duration::from_secs_f64(x.submit_ms / 1000.0);
    let called = epoch + Duration::from_micros(call.started_us);
    let done = epoch + Duration::from_micros(call.answered_us);
    let e2e = sunk.saturating_duration_since(x.started);
    let took = done.saturating_duration_since(called);
    stages.entry("submit").or_default().push(x.submit_ms);
    stages.entry("answer_to_provider").or_default().push(ms(called.saturating_duration_since(answered)));
    stages.entry("provider").or_default().push(ms(took));
    stages.entry("provider_to_sink").or_default().push(ms(sunk.saturating_duration_since(done)));
    stages.entry("e2e").or_default().push(ms(e2e));
    stages.entry("overhead").or_default().push(ms(e2e.saturating_sub(took)));
}

fn stage_percentiles(stages: &BTreeMap<&'static str, Vec<f64>>) -> Value {
    let pct: BTreeMap<String, Value> = stages
        .iter()
        .map(|(k, v)| {
            let p = |q| round(percentile(v, q), 2);
            ((*k).to_string(), json!({"p50_ms": p(0.5), "p90_ms": p(0.9), "p99_ms": p(0.99), "max_ms": p(1.0)}))
        })
        .collect();
    json!(pct)
}

fn lane_e2e(
    jobs: &[Job],
    first: &BTreeMap<&str, &Submitted>,
    id: &str,
    lane: Lane,
    e2e_of: &dyn Fn(&str) -> Option<f64>,
) -> Option<f64> {
    let x = first.get(id)?;
    if jobs[x.job].lane != lane {
        return None;
    }
    e2e_of(id)
}

/// `n` jobs of one tenant and lane, each with its own diff of `size`.
fn uniform(n: usize, tenant: Tenant, lane: Lane, tag: &str, size: Size) -> Arc<Vec<Job>> {
    let seed = seed_of(tag);
    Arc::new(
        (0..n)
            .map(|i| Job {
                tenant,
                lane,
                idempotency_key: format!("{tag}-{i}"),
                diff: corpus::generate(seed + i as u64, size),
            })
            .collect(),
    )
}

/// `n` jobs over the three tenants (acme 45%, beta 25%, euro 30%), 80% interactive,
/// sizes from `Size::mix`.
fn mixed(n: usize, tag: &str) -> Arc<Vec<Job>> {
    let seed = seed_of(tag);
    Arc::new(
        (0..n)
            .map(|i| Job {
                tenant: match i % 20 {
                    0..=8 => Tenant::Acme,
                    9..=13 => Tenant::Beta,
                    _ => Tenant::Euro,
                },
                lane: if i % 5 == 4 { Lane::Batch } else { Lane::Interactive },
                idempotency_key: format!("{tag}-{i}"),
                diff: corpus::generate(seed + i as u64, Size::mix(i)),
            })
            .collect(),
    )
}

fn seed_of(tag: &str) -> u64 {
    tag.bytes().fold(1_000_003u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))) % 1_000_000_007
}

/// Publishes-with-ack per second a plain JetStream client reaches on the same server:
/// `n` messages the size of the average review message, `in_flight` at a time, to a
/// scratch stream deleted afterwards.
pub async fn raw_jetstream_rate(url: &str, jobs: &[Job], n: usize, in_flight: usize) -> anyhow::Result<f64> {
    use futures::StreamExt;
    let client = async_nats::connect(url).await?;
    let js = async_nats::jetstream::new(client);
    let name = "LOADTEST_RAW";
    let _ = js.delete_stream(name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.into(),
        subjects: vec!["loadtest.raw.>".into()],
        storage: async_nats::jetstream::stream::StorageType::File,
        ..Default::default()
    })
    .await
    .map_err(|e| anyhow::anyhow!(e))?;
    let avg = jobs.iter().map(|j| j.diff.len() + 400).sum::<usize>() / jobs.len().max(1);
    let payload = bytes::Bytes::from(vec![b'x'; avg]);
    let started = Instant::now();
    let results = futures::stream::iter(0..n)
        .map(|i| {
            let js = js.clone();
            let payload = payload.clone();
            async move {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(async_nats::header::NATS_MESSAGE_ID, format!("raw-{i}").as_str());
                js.publish_with_headers(format!("loadtest.raw.{}", i % 3), headers, payload).await?.await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(in_flight)
        .collect::<Vec<_>>()
        .await;
    let elapsed = started.elapsed().as_secs_f64();
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let _ = js.delete_stream(name).await;
    Ok(ok as f64 / elapsed)
}

/// The human table of a report.
pub fn print_table(r: &Report) {
    println!("scenario {}", r.scenario);
    println!("  jobs {}   completed {}   lost {}", r.jobs, r.completed, r.lost);
    println!(
        "  duplicates: paid calls {}   deliveries {}   ({})",
        r.duplicate_paid_calls,
        r.duplicate_deliveries,
        if r.correct() { "correct" } else { "VIOLATED" }
    );
    println!("  provider calls {}   paid {}   429s {}", r.provider_calls, r.paid_calls, r.calls_429);
    match r.physical_limit_s {
        Some(p) => {
            println!("  makespan {:.1} s   physical limit {:.1} s   ratio {:.3}", r.makespan_s, p, r.makespan_s / p)
        }
        None => println!("  makespan {:.1} s", r.makespan_s),
    }
    println!("  submit p50 / p99   {:.2} / {:.2} ms", r.submit_p50_ms, r.submit_p99_ms);
    println!("  e2e    p50 / p99   {:.1} / {:.1} ms  (submit to delivery at the sink)", r.e2e_p50_ms, r.e2e_p99_ms);
    for (name, peak) in &r.rss_peak_mib {
        let idle = r.rss_idle_mib.get(name).copied().unwrap_or(0.0);
        println!("  rss {name:<14} idle {idle:>6.1} MiB   peak {peak:>6.1} MiB");
    }
    for (k, v) in &r.extra {
        if k != "rss_over_time_mib" {
            println!("  {k} = {v}");
        }
    }
    if let Some(Value::Array(rows)) = r.extra.get("rss_over_time_mib") {
        println!("  rss over time (s: service MiB ...):");
        for row in rows {
            println!("    {row}");
        }
    }
}
