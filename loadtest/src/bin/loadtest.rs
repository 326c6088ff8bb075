//! `cargo run --release -p loadtest -- <scenario>`: runs a scenario against a whole
//! in-process deployment (real nats-servers, simulated provider, webhook receiver),
//! checks correctness, prints a table, and ends with one JSON line.
//!
//! Scenarios so far: `storm` — 40 jobs, provider cap 2 with 429 + `retry-after: 2` over
//! the cap, 3 s per call, extractor concurrency configured at 8 (a misconfigured pool).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use loadtest::simprovider::{OverCap, SimConfig};
use loadtest::stack::{Stack, StackOptions, US_KEY, sample_diff, submit_req, wait_final_within};
use reviewlane_shared::proto::JobState;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    match scenario.as_str() {
        "storm" => storm().await,
        _ => bail!("usage: loadtest <scenario>; scenarios: storm"),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn storm() -> anyhow::Result<()> {
    let (jobs, latency, cap, concurrency) = (40usize, Duration::from_secs(3), 2usize, 8usize);
    let stack = Stack::start_with(StackOptions {
        extractor_concurrency: concurrency,
        scope_limit: concurrency as u32,
        lease: Duration::from_secs(30),
        us_provider: SimConfig {
            latency,
            concurrency_cap: Some(cap),
            over_cap: OverCap::Reject { headers: vec![("retry-after".into(), "2".into())] },
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let started = Instant::now();
    let mut ids = Vec::new();
    let mut submit_ms = Vec::new();
    for i in 0..jobs {
        let t = Instant::now();
        let r = client.submit_review(submit_req(US_KEY, &format!("storm-{i}"), &sample_diff(&format!("s{i}")))).await?;
        submit_ms.push(t.elapsed().as_secs_f64() * 1000.0);
        ids.push(r.into_inner().review.expect("review").job_id);
    }
    let mut completed = 0;
    for id in &ids {
        // Jobs finish in queue order over about a minute; watched one after another.
        if wait_final_within(&mut client, US_KEY, id, Duration::from_secs(300)).await.state
            == JobState::Published as i32
        {
            completed += 1;
        }
    }
    // Deliveries may trail the final state by a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while stack.webhook.received().len() < completed && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let received = stack.webhook.received();
    let makespan = received.iter().map(|r| r.at.duration_since(started)).max().unwrap_or_default().as_secs_f64();
    let mut deliveries: BTreeMap<String, u32> = BTreeMap::new();
    for r in &received {
        *deliveries.entry(r.idempotency_key.clone().unwrap_or_default()).or_default() += 1;
    }
    let stats = stack.us.provider.stats();
    let paid: u64 = stats.paid_by_job.values().sum();
    let duplicate_paid = stats.paid_by_job.values().filter(|&&n| n > 1).count();
    let duplicate_deliveries = deliveries.values().filter(|&&n| n > 1).count();
    let lost = ids.iter().filter(|id| !deliveries.contains_key(*id)).count();
    let physical = jobs as f64 * latency.as_secs_f64() / cap as f64;
    submit_ms.sort_by(f64::total_cmp);

    println!(
        "scenario storm: {jobs} jobs, provider cap {cap} (429 + retry-after: 2 over it), {}s per call, extractor concurrency {concurrency}",
        latency.as_secs()
    );
    println!("  completed            {completed}/{jobs}   lost {lost}");
    println!(
        "  makespan             {makespan:.1} s   (physical limit {physical:.0} s, ratio {:.3})",
        makespan / physical
    );
    println!(
        "  provider calls       {}   paid {paid}   429s {} ({:.1}% of calls)",
        stats.total_calls,
        stats.calls_429,
        100.0 * stats.calls_429 as f64 / stats.total_calls.max(1) as f64
    );
    println!("  duplicates           paid calls {duplicate_paid}   deliveries {duplicate_deliveries}");
    println!("  max concurrent calls {}", stats.max_concurrent);
    if std::env::var_os("LOADTEST_TIMELINE").is_some() {
        let mut spans = stats.call_spans_ms.clone();
        spans.sort();
        for (a, b) in spans {
            println!("    call {:>6.1}s .. {:>6.1}s", a as f64 / 1000.0, b as f64 / 1000.0);
        }
        let mut at: Vec<f64> = received.iter().map(|r| r.at.duration_since(started).as_secs_f64()).collect();
        at.sort_by(f64::total_cmp);
        println!("    deliveries at {:?}", at.iter().map(|t| (t * 10.0).round() / 10.0).collect::<Vec<_>>());
    }
    println!("  submit p50/p99       {:.2} / {:.2} ms", percentile(&submit_ms, 0.5), percentile(&submit_ms, 0.99));
    println!(
        "{}",
        serde_json::json!({
            "scenario": "storm", "jobs": jobs, "completed": completed, "lost": lost,
            "duplicate_paid_calls": duplicate_paid, "duplicate_deliveries": duplicate_deliveries,
            "paid_calls": paid, "calls_429": stats.calls_429, "provider_calls": stats.total_calls,
            "makespan_s": (makespan * 10.0).round() / 10.0, "physical_limit_s": physical,
            "submit_p50_ms": percentile(&submit_ms, 0.5), "submit_p99_ms": percentile(&submit_ms, 0.99),
        })
    );
    stack.shutdown().await;
    if lost > 0 || duplicate_paid > 0 || duplicate_deliveries > 0 {
        bail!("storm: correctness violated");
    }
    Ok(())
}
