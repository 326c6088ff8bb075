//! `cargo run --release -p loadtest -- <scenario> [--jobs N] [--secs N] [--in-process] [--provider openai|anthropic]`
//!
//! Brings up what the scenario needs — two provisioned nats-servers, the simulated
//! provider of each region with the scenario's knobs, a webhook receiver, and the
//! ingress, extractors and publishers as real processes (built first if needed) —
//! runs it, checks correctness, prints a table, writes each service's `/metrics` page
//! to `target/loadtest/<scenario>.metrics.txt`, stops everything, and prints one JSON
//! object as its last line. Exits 1 when correctness is violated.
//!
//! Scenarios: lab, storm, dup, overhead, flood, fairness, soak, idle (one job at a
//! time, its time split by stage) (see `scenarios.rs` and BENCHMARKS.md); `chaos`,
//! `replicas` (`--key-limit 8`: the deployment told more than the provider allows),
//! `quota-fleet` (1, 4, 16 and 32 replicas of the quota client on one key's buckets),
//! `large` (reviews split into parts: on a fresh and an idle account, and beside two
//! other tenants' interactive reviews), `sweep` (5,000 items through the provider's
//! batch API beside interactive reviews, then through the lanes), and `tpm` (an account metering requests or
//! tokens per minute: `openai-48000-tpm`, `anthropic-itpm-otpm`, `openai-20-rpm`). `--in-process` runs the
//! services inside this process instead (no RSS or CPU figures). `--provider anthropic` runs the extractors through the Anthropic
//! Messages adapter against the simulated provider's Anthropic mode (default: the
//! OpenAI-compatible adapter).

use std::path::Path;

use anyhow::{Context, bail};
use loadtest::procs::{ProcStack, ensure_built};
use loadtest::scenarios::{self, Overrides, Scale, Scenario};
use loadtest::stack::Stack;

fn usage() -> String {
    let names: Vec<&str> = Scenario::ALL.iter().map(|s| s.name()).collect();
    format!(
        "usage: loadtest <{}|chaos|replicas [--key-limit N] [--variant alive|killed|tenants]|large|sweep|tpm [variant]|gateway|quota-fleet|pool> [--jobs N] [--secs N] [--in-process] [--provider openai|anthropic]",
        names.join("|")
    )
}

/// `replicas`: three extractor processes sharing one provider key; `key_limit`: what
/// the deployment is told the key allows (default: the provider's cap, 4).
async fn replicas(key_limit: Option<u32>, only: Option<String>) -> anyhow::Result<()> {
    use loadtest::replicas::{ReplicasConfig, Variant};
    loadtest::procs::ensure_nats_server()?;
    ensure_built()?;
    let mut reports = Vec::new();
    for variant in Variant::ALL.into_iter().filter(|v| only.as_deref().is_none_or(|o| o == v.name())) {
        let mut cfg = ReplicasConfig::full(variant);
        cfg.key_limit = key_limit.unwrap_or(cfg.key_limit);
        let mut stack = ProcStack::start(cfg.options()).await?;
        let report = loadtest::replicas::run(&mut stack, &cfg).await;
        stack.keep_logs();
        println!("  service logs: {}", stack.log_dir().display());
        let _ = stack.shutdown();
        let report = report?;
        loadtest::replicas::print(&report);
        reports.push(report);
    }
    println!("{}", serde_json::to_string(&reports)?);
    if reports.iter().any(|r| r.lost > 0 || r.paid_twice > 0) {
        std::process::exit(1);
    }
    Ok(())
}

/// `tpm`: reviews against an account metering requests or tokens per minute, its
/// limits learned from the headers; every variant, or the one named.
async fn tpm(only: Option<String>) -> anyhow::Result<()> {
    use loadtest::tpm::{TpmConfig, Variant};
    loadtest::procs::ensure_nats_server()?;
    ensure_built()?;
    let mut reports = Vec::new();
    for variant in Variant::ALL.into_iter().filter(|v| only.as_deref().is_none_or(|o| o == v.name())) {
        let cfg = TpmConfig::full(variant);
        let stack = ProcStack::start(cfg.options()).await?;
        let report = loadtest::tpm::run(&stack, &cfg).await;
        let _ = stack.shutdown();
        let report = report?;
        loadtest::tpm::print(&report);
        reports.push(report);
    }
    println!("{}", serde_json::to_string(&reports)?);
    if reports.iter().any(|r| r.published != r.reviews) {
        std::process::exit(1);
    }
    Ok(())
}

/// `gateway`: reviews through a LiteLLM-style proxy with fixed windows and hint-less 429s.
async fn gateway() -> anyhow::Result<()> {
    let cfg = loadtest::gateway::GatewayRun::full();
    loadtest::procs::ensure_nats_server()?;
    let report = loadtest::gateway::run(&cfg).await?;
    loadtest::gateway::print(&report);
    println!("{}", serde_json::to_string(&report)?);
    if !report.ok() {
        std::process::exit(1);
    }
    Ok(())
}

/// `pool`: a `fast` class over two deployments beside a `deep` one's sweep, then the
/// larger `fast` one out of quota mid-run.
async fn pool() -> anyhow::Result<()> {
    let cfg = loadtest::pool::PoolRun::full();
    loadtest::procs::ensure_nats_server()?;
    let normal = loadtest::pool::run(&cfg, false).await?;
    loadtest::pool::print("normal", &normal);
    let failover = loadtest::pool::run(&cfg, true).await?;
    loadtest::pool::print("failover", &failover);
    println!("{}", serde_json::json!({ "normal": normal, "failover": failover }));
    if normal.lost + failover.lost + normal.sweep.lost as usize + failover.sweep.lost as usize > 0 {
        std::process::exit(1);
    }
    Ok(())
}

/// `large`: reviews far larger than the model's context, end to end.
async fn large() -> anyhow::Result<()> {
    let cfg = loadtest::large::LargeConfig::full();
    loadtest::procs::ensure_nats_server()?;
    ensure_built()?;
    let stack = ProcStack::start(cfg.options()).await?;
    let report = loadtest::large::run(&stack, &cfg).await;
    let _ = stack.shutdown();
    let report = report?;
    loadtest::large::print(&report);
    println!("{}", serde_json::to_string(&report)?);
    if !report.ok() {
        std::process::exit(1);
    }
    Ok(())
}

/// `sweep`: a sweep of 5,000 items through the provider's batch API beside
/// interactive reviews, then through the lanes.
async fn sweep() -> anyhow::Result<()> {
    let cfg = loadtest::sweep::SweepConfig::full();
    loadtest::procs::ensure_nats_server()?;
    ensure_built()?;
    let stack = ProcStack::start(cfg.options()).await?;
    let report = loadtest::sweep::run(&stack, &cfg).await;
    let _ = stack.shutdown();
    let report = report?;
    loadtest::sweep::print(&report);
    println!("{}", serde_json::to_string(&report)?);
    if !report.ok() {
        std::process::exit(1);
    }
    Ok(())
}

/// `quota-fleet`: 1, 4, 16 and 32 replicas of the quota client on one key's budgets.
async fn quota_fleet() -> anyhow::Result<()> {
    loadtest::procs::ensure_nats_server()?;
    let runs = loadtest::quota_fleet::run(&loadtest::quota_fleet::FleetConfig::full()).await?;
    loadtest::quota_fleet::print(&runs);
    println!("{}", serde_json::to_string(&runs)?);
    Ok(())
}

/// `chaos`: the services as processes, killed, frozen and restarted under load.
async fn chaos(jobs: Option<usize>) -> anyhow::Result<()> {
    let mut cfg = loadtest::chaos::ChaosConfig::full();
    cfg.jobs = jobs.unwrap_or(cfg.jobs);
    loadtest::procs::ensure_nats_server()?;
    ensure_built()?;
    let mut stack = ProcStack::start(cfg.options()).await?;
    let report = loadtest::chaos::run(&mut stack, &cfg).await;
    stack.keep_logs();
    println!("  service logs: {}", stack.log_dir().display());
    let _ = stack.shutdown();
    let report = report?;
    loadtest::chaos::print(&report);
    println!("{}", serde_json::to_string(&report)?);
    if !report.correct() {
        std::process::exit(1);
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("chaos") {
        let jobs = match args.get(1..).unwrap_or_default() {
            [] => None,
            [flag, n] if flag == "--jobs" => Some(n.parse()?),
            _ => bail!(usage()),
        };
        return chaos(jobs).await;
    }
    if args.first().map(String::as_str) == Some("replicas") {
        let (mut key_limit, mut only) = (None, None);
        let mut it = args.iter().skip(1);
        while let Some(a) = it.next() {
            match a.as_str() {
                "--key-limit" => key_limit = Some(it.next().context("--key-limit N")?.parse()?),
                "--variant" => only = Some(it.next().context("--variant alive|killed|tenants")?.clone()),
                _ => bail!(usage()),
            }
        }
        return replicas(key_limit, only).await;
    }
    if args.first().map(String::as_str) == Some("tpm") {
        return tpm(args.get(1).cloned()).await;
    }
    if args.first().map(String::as_str) == Some("gateway") {
        return gateway().await;
    }
    if args.first().map(String::as_str) == Some("pool") {
        return pool().await;
    }
    if args.first().map(String::as_str) == Some("large") {
        return large().await;
    }
    if args.first().map(String::as_str) == Some("sweep") {
        return sweep().await;
    }
    if args.first().map(String::as_str) == Some("quota-fleet") {
        return quota_fleet().await;
    }
    let Some(scenario) = args.first().and_then(|a| Scenario::parse(a)) else { bail!(usage()) };
    let mut over = Overrides::default();
    let mut in_process = false;
    let mut anthropic = false;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--jobs" => over.jobs = Some(it.next().context("--jobs N")?.parse()?),
            "--secs" => over.duration = Some(std::time::Duration::from_secs(it.next().context("--secs N")?.parse()?)),
            "--in-process" => in_process = true,
            "--provider" => match it.next().map(String::as_str) {
                Some("anthropic") => anthropic = true,
                Some("openai") => anthropic = false,
                _ => bail!(usage()),
            },
            _ => bail!(usage()),
        }
    }
    loadtest::procs::ensure_nats_server()?;
    let mut opts = scenarios::options(scenario, Scale::Full);
    opts.anthropic = anthropic;
    let report = if in_process {
        let stack = Stack::start_with(opts).await;
        let report = scenarios::run(scenario, Scale::Full, over, &stack).await?;
        stack.shutdown().await;
        report
    } else {
        ensure_built()?;
        let stack = ProcStack::start(opts).await?;
        let report = scenarios::run(scenario, Scale::Full, over, &stack).await;
        let mut pages = String::new();
        for (name, addr) in &stack.admin {
            pages.push_str(&format!("# ---- {name} ----\n{}", loadtest::stack::http_get(*addr, "/metrics").await));
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/loadtest");
        std::fs::create_dir_all(&dir)?;
        let file = dir.join(format!("{}.metrics.txt", scenario.name()));
        std::fs::write(&file, pages)?;
        let codes = stack.shutdown();
        let unclean: Vec<_> = codes.iter().filter(|(_, c)| **c != Some(0)).collect();
        if !unclean.is_empty() {
            eprintln!("services that did not exit 0 on SIGTERM: {unclean:?}");
        }
        println!("  metrics pages: {}", file.display());
        report?
    };
    scenarios::print_table(&report);
    println!("{}", serde_json::to_string(&report)?);
    if !report.correct() {
        std::process::exit(1);
    }
    Ok(())
}
