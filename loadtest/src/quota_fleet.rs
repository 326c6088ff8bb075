//! `quota-fleet`: N replicas of the extractor's quota client (`Quota`) in one process,
//! on one nats-server, spending one key's requests- and tokens-per-minute budgets
//! (about 300 calls/s) under 400 calls/s offered, against an instant provider that
//! answers 429 over its own exact buckets. Both the provider's buckets and the fleet's
//! start empty, so what is measured is the pacing at the refill rate, not the first
//! minute's burst. Per N: calls/s against the buckets' physical rate, the provider's
//! 429s, the quota's KV reads, writes and compare-and-set conflicts per call, and the
//! time one reservation takes (`reserve_call`; a refused one returns its wait, which
//! is not counted in it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reviewlane_core::meter::{Cost, Dimension, Reading};
use reviewlane_extractor::quota::bucket::{Bucket, Refused};
use reviewlane_extractor::quota::{KeyConfig, Limited, Quota};
use reviewlane_extractor::upstream::Meter;
use reviewlane_shared::Region;
use reviewlane_shared::testing::NatsServer;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// The run.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub replicas: Vec<usize>,
    /// Calls offered per second, over the whole fleet.
    pub offered_per_s: f64,
    pub rpm: u64,
    pub tpm: u64,
    /// What a call reserves: its prompt and its output limit (counted at start).
    pub cost: Cost,
    /// What its answer reports: the prompt counted exactly, less output than the limit.
    pub used: Cost,
    /// Calls one replica runs at once at most.
    pub per_replica: usize,
    pub warmup: Duration,
    pub measure: Duration,
}

impl FleetConfig {
    pub fn full() -> FleetConfig {
        let cost = Cost { input: 1_000, output: 200 };
        FleetConfig {
            replicas: vec![1, 4, 16, 32],
            offered_per_s: 400.0,
            rpm: 18_000,
            // 300 calls/s of 1,200 tokens (the prompt and the output limit, counted at start).
            tpm: 300 * 60 * 1_200,
            cost,
            used: Cost { input: 1_000, output: 120 },
            // The extractor's default call slots (`REVIEWLANE_CONCURRENCY`).
            per_replica: 8,
            warmup: Duration::from_secs(5),
            measure: Duration::from_secs(20),
        }
    }

    /// The calls per second the buckets let through.
    pub fn physical_per_s(&self) -> f64 {
        let tokens = (self.cost.input + self.cost.output.max(self.used.output)) as f64;
        (self.rpm as f64 / 60.0).min(self.tpm as f64 / 60.0 / tokens)
    }
}

/// One N's figures.
#[derive(Debug, Clone, Serialize)]
pub struct FleetRun {
    pub replicas: usize,
    pub calls_per_s: f64,
    pub physical_calls_per_s: f64,
    pub ratio_to_physical: f64,
    pub share_429: f64,
    pub calls: u64,
    pub rate_limited: u64,
    pub kv_reads_per_call: f64,
    pub kv_writes_per_call: f64,
    pub cas_conflicts_per_call: f64,
    pub reserve_p50_ms: f64,
    pub reserve_p99_ms: f64,
    pub reservations: usize,
}

/// The provider's own buckets: exact, continuous refill, no burst above capacity.
struct Provider {
    buckets: Mutex<[(f64, f64, f64); 2]>, // (level, capacity, per ms) of requests, tokens
    at: Mutex<Instant>,
    calls: AtomicU64,
    limited: AtomicU64,
    measuring: std::sync::atomic::AtomicBool,
}

enum Answer {
    Ok(Meter),
    RateLimited(Dimension, Duration),
}

impl Provider {
    fn new(rpm: u64, tpm: u64) -> Provider {
        Provider {
            buckets: Mutex::new([(0.0, rpm as f64, rpm as f64 / 60_000.0), (0.0, tpm as f64, tpm as f64 / 60_000.0)]),
            at: Mutex::new(Instant::now()),
            calls: AtomicU64::new(0),
            limited: AtomicU64::new(0),
            measuring: Default::default(),
        }
    }

    fn call(&self, tokens: u64) -> Answer {
        let mut b = self.buckets.lock().expect("provider lock");
        let mut at = self.at.lock().expect("provider clock");
        let ms = at.elapsed().as_secs_f64() * 1000.0;
        *at = Instant::now();
        for (level, cap, rate) in b.iter_mut() {
            *level = (*level + *rate * ms).min(*cap);
        }
        let count = self.measuring.load(Ordering::Relaxed);
        let need = [1.0, tokens as f64];
        for (i, dim) in [Dimension::Requests, Dimension::Tokens].into_iter().enumerate() {
            if b[i].0 < need[i] {
                if count {
                    self.limited.fetch_add(1, Ordering::Relaxed);
                }
                let wait = ((need[i] - b[i].0) / b[i].2).ceil() as u64;
                return Answer::RateLimited(dim, Duration::from_millis(wait.max(1)));
            }
        }
        for i in 0..2 {
            b[i].0 -= need[i];
        }
        if count {
            self.calls.fetch_add(1, Ordering::Relaxed);
        }
        let reading = |(level, cap, rate): (f64, f64, f64)| Reading {
            limit: Some(cap as u64),
            remaining: Some(level.max(0.0) as u64),
            reset: Some(Duration::from_millis(((cap - level) / rate).ceil() as u64)),
        };
        Answer::Ok(Meter::from([(Dimension::Requests, reading(b[0])), (Dimension::Tokens, reading(b[1]))]))
    }
}

/// Runs every N in turn, each on a fresh nats-server.
pub async fn run(cfg: &FleetConfig) -> anyhow::Result<Vec<FleetRun>> {
    let mut runs = Vec::new();
    for &n in &cfg.replicas {
        runs.push(run_one(cfg, n).await?);
    }
    Ok(runs)
}

async fn run_one(cfg: &FleetConfig, n: usize) -> anyhow::Result<FleetRun> {
    let nats = NatsServer::start_provisioned(Region::Us).await;
    let client = async_nats::connect(nats.url()).await?;
    let js = async_nats::jetstream::new(client.clone());
    let layout = reviewlane_shared::layout::ensure(&js, Region::Us, &Default::default())
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let clock = reviewlane_core::clock::system();
    let key = "openai.fleet";
    // The fleet's buckets start empty, as the provider's do.
    let now = clock.now_ms();
    for (dim, cap) in [(Dimension::Requests, cfg.rpm), (Dimension::Tokens, cfg.tpm)] {
        let empty = Bucket { level: 0.0, ..Bucket::full_over(cap, 60_000, now) };
        layout.quota.put(format!("bucket.{key}.{}", dim.as_str()), serde_json::to_vec(&empty)?.into()).await?;
    }
    let provider = Arc::new(Provider::new(cfg.rpm, cfg.tpm));
    let stop = CancellationToken::new();
    let mut replicas = Vec::new();
    for _ in 0..n {
        // Each replica its own connection, as each extractor process has.
        let client = async_nats::connect(nats.url()).await?;
        let kv = async_nats::jetstream::new(client.clone()).get_key_value(layout.quota.name.clone()).await?;
        let config = KeyConfig {
            key: key.into(),
            // Calls in flight on the key at most (`REVIEWLANE_KEY_LIMIT`).
            limit: 64,
            tenant_limits: Default::default(),
            weights: Default::default(),
        };
        let q = Quota::new(kv, client, config, Duration::from_secs(1), Duration::from_secs(60), clock.clone())
            .with_budgets(vec![(Dimension::Requests, cfg.rpm), (Dimension::Tokens, cfg.tpm)]);
        q.start(stop.clone()).await?;
        replicas.push(q);
    }
    let reserve_ms = Arc::new(Mutex::new(Vec::<f64>::new()));
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let per_replica_rate = cfg.offered_per_s / n as f64;
    let mut tasks = Vec::new();
    for q in &replicas {
        let (tx, rx) = tokio::sync::mpsc::channel::<()>((per_replica_rate * 2.0).ceil() as usize + 1);
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let offer_stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_replica_rate));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            loop {
                tokio::select! {
                    _ = tick.tick() => { let _ = tx.try_send(()); }
                    _ = offer_stop.cancelled() => return,
                }
            }
        }));
        for _ in 0..cfg.per_replica {
            let (q, rx, provider, stop) = (q.clone(), rx.clone(), provider.clone(), stop.clone());
            let (reserve_ms, measuring, cfg) = (reserve_ms.clone(), measuring.clone(), cfg.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let got = tokio::select! {
                        got = async { rx.lock().await.recv().await } => got,
                        _ = stop.cancelled() => return,
                    };
                    if got.is_none() {
                        return;
                    }
                    if !one_call(&q, &provider, &cfg, &reserve_ms, &measuring, &stop).await {
                        return;
                    }
                }
            }));
        }
    }
    tokio::time::sleep(cfg.warmup).await;
    let kv_before = replicas.iter().map(Quota::kv_counts).fold(Default::default(), sum);
    reserve_ms.lock().expect("samples").clear();
    provider.measuring.store(true, Ordering::Relaxed);
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(cfg.measure).await;
    provider.measuring.store(false, Ordering::Relaxed);
    measuring.store(false, Ordering::Relaxed);
    let took = started.elapsed().as_secs_f64();
    let kv_after = replicas.iter().map(Quota::kv_counts).fold(Default::default(), sum);
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    let calls = provider.calls.load(Ordering::Relaxed);
    let limited = provider.limited.load(Ordering::Relaxed);
    let mut samples = std::mem::take(&mut *reserve_ms.lock().expect("samples"));
    samples.sort_by(f64::total_cmp);
    let pct = |p: f64| samples.get(((samples.len() as f64 * p) as usize).min(samples.len().saturating_sub(1))).copied();
    let per_call = |v: u64| v as f64 / calls.max(1) as f64;
    let physical = cfg.physical_per_s();
    let calls_per_s = calls as f64 / took;
    Ok(FleetRun {
        replicas: n,
        calls_per_s,
        physical_calls_per_s: physical,
        ratio_to_physical: calls_per_s / physical,
        share_429: limited as f64 / (calls + limited).max(1) as f64,
        calls,
        rate_limited: limited,
        kv_reads_per_call: per_call(kv_after.reads - kv_before.reads),
        kv_writes_per_call: per_call(kv_after.writes - kv_before.writes),
        cas_conflicts_per_call: per_call(kv_after.conflicts - kv_before.conflicts),
        reserve_p50_ms: pct(0.5).unwrap_or(0.0),
        reserve_p99_ms: pct(0.99).unwrap_or(0.0),
        reservations: samples.len(),
    })
}

fn sum(
    a: reviewlane_extractor::quota::KvCounts,
    b: reviewlane_extractor::quota::KvCounts,
) -> reviewlane_extractor::quota::KvCounts {
    reviewlane_extractor::quota::KvCounts {
        reads: a.reads + b.reads,
        writes: a.writes + b.writes,
        conflicts: a.conflicts + b.conflicts,
    }
}

/// One offered call: waits out the key's pause, reserves (waiting as long as it is
/// told, bounded by the run), calls, and tells the quota what the answer said, as the
/// extractor's worker does. `false` when the run stopped.
async fn one_call(
    q: &Quota,
    provider: &Provider,
    cfg: &FleetConfig,
    reserve_ms: &Mutex<Vec<f64>>,
    measuring: &std::sync::atomic::AtomicBool,
    stop: &CancellationToken,
) -> bool {
    loop {
        if let Some(p) = q.paused_for() {
            tokio::select! {
                _ = tokio::time::sleep(p) => continue,
                _ = stop.cancelled() => return false,
            }
        }
        let t0 = Instant::now();
        let reserved = q.budgets().reserve_call(cfg.cost).await;
        if measuring.load(Ordering::Relaxed) {
            reserve_ms.lock().expect("samples").push(t0.elapsed().as_secs_f64() * 1000.0);
        }
        let reserved = match reserved {
            Ok(r) => r,
            Err(Refused::Wait(d)) => {
                tokio::select! {
                    _ = tokio::time::sleep(d) => continue,
                    _ = q.budgets().given_back.notified() => continue,
                    _ = stop.cancelled() => return false,
                }
            }
            Err(Refused::TooLarge { .. }) => return false,
        };
        let started_ms = q.now_ms();
        let tokens = cfg.cost.input + cfg.cost.output;
        match provider.call(tokens) {
            Answer::Ok(meter) => {
                q.budgets().correct_call(&reserved, cfg.used).await;
                q.budgets().follow_readings(&meter).await;
                q.succeeded(started_ms).await;
                return true;
            }
            Answer::RateLimited(dim, hint) => {
                // As the worker does: a 429's reservation stays spent, its bucket drains
                // and the key pauses for the hint.
                drop(reserved);
                let limited = Limited { pause: hint, started_ms, in_flight: None, bucket: Some(dim) };
                let _ = q.rate_limited(limited).await;
            }
        }
    }
}

pub fn print(runs: &[FleetRun]) {
    println!(
        "{:>8} {:>9} {:>9} {:>7} {:>7} {:>10} {:>11} {:>10} {:>11} {:>11}",
        "replicas",
        "calls/s",
        "physical",
        "ratio",
        "429s",
        "kv reads",
        "kv writes",
        "conflicts",
        "reserve p50",
        "reserve p99"
    );
    for r in runs {
        println!(
            "{:>8} {:>9.1} {:>9.1} {:>7.3} {:>6.2}% {:>10.3} {:>11.3} {:>10.3} {:>9.3}ms {:>9.3}ms",
            r.replicas,
            r.calls_per_s,
            r.physical_calls_per_s,
            r.ratio_to_physical,
            r.share_429 * 100.0,
            r.kv_reads_per_call,
            r.kv_writes_per_call,
            r.cas_conflicts_per_call,
            r.reserve_p50_ms,
            r.reserve_p99_ms
        );
    }
}
