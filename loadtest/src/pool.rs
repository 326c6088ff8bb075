//! The `pool` run: one region with two model classes. Class `fast` serves a tenant's
//! interactive reviews on two deployments — an OpenAI-style account metered by tokens
//! per minute (the simulated provider's buckets) and an Azure OpenAI deployment metered
//! by requests per 10-second window (`testkit::simazure`) — each configured with its own
//! budget. Class `deep`, an Anthropic-style deployment (the region's first), serves the
//! tenant's batch lane and runs its sweep through Message Batches. The interactive
//! reviews and a sweep are submitted at once; reported per run: calls per deployment
//! against its share of the combined budget, 429s, the makespan against the combined
//! physical limit, each review and each sweep item paid once, and what the `deep`
//! deployment was asked. The `failover` run is the same with the OpenAI account
//! answering `insufficient_quota` once a third of the interactive reviews are
//! published: what was in flight there, how long until no call went to it, and the
//! rest against the Azure deployment's limit alone.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use reviewlane_api::proto::JobState;
use reviewlane_core::meter::Dimension;
use reviewlane_core::region::Region;
use reviewlane_extractor::config::{AzureAuth, AzureDeployment, DeploymentConfig, ProviderConfig};
use reviewlane_testkit::simazure::{self, AzureConfig, SimAzure};
use reviewlane_testkit::simmeter::SimLimits;
use serde::Serialize;

use reviewlane_api::proto::{
    self, AddSweepItemsRequest, CreateSweepRequest, GetSweepRequest, SealSweepRequest, SweepItemState, SweepMode,
};

use crate::simprovider::{Scripted, SimConfig};
use crate::stack::{Stack, StackOptions, US_SECRET, authed, sample_diff, submit};

#[derive(Debug, Clone)]
pub struct PoolRun {
    pub reviews: usize,
    /// Items of the tenant's sweep (class `deep`, through the provider's batch API).
    pub sweep_items: usize,
    /// The OpenAI-style account's tokens per minute.
    pub tpm: u64,
    /// The Azure deployment's requests per minute (a sixth of them per 10 s).
    pub rpm: u32,
    pub latency: Duration,
}

impl PoolRun {
    /// 100 interactive reviews and a 500-item sweep; about half a call a second on the
    /// OpenAI-style account, one on the Azure deployment.
    pub fn full() -> Self {
        PoolRun { reviews: 100, sweep_items: 500, tpm: 150_000, rpm: 60, latency: Duration::from_millis(50) }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PoolReport {
    pub reviews: usize,
    pub published: usize,
    pub lost: usize,
    pub paid_twice: usize,
    pub calls_per_deployment: BTreeMap<String, u64>,
    /// Each deployment's share of the combined physical rate.
    pub budget_share: BTreeMap<String, f64>,
    pub calls_429: u64,
    pub share_429: f64,
    pub makespan_s: f64,
    pub physical_s: f64,
    pub ratio_to_physical: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_flight_at_failure: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_quota_to_last_call_s: Option<f64>,
    /// How far into Azure's 10-s window the run started, and the calls Azure let through
    /// in each window from then on: where a window went unused.
    pub azure_phase_at_start_s: f64,
    pub azure_calls_by_window: Vec<u64>,
    pub sweep: SweepOutcome,
}

/// The `deep` class's sweep beside the interactive reviews.
#[derive(Debug, Clone, Serialize)]
pub struct SweepOutcome {
    pub items: u64,
    pub published: u64,
    pub failed: u64,
    pub lost: u64,
    /// Batch lines paid, and items paid more than once.
    pub paid_lines: u64,
    pub paid_twice: u64,
    /// From the seal to every item final.
    pub seal_to_reconciled_s: f64,
    /// Calls to the `deep` deployment outside its batches (its class's lanes had none to
    /// make), and calls of the sweep's items to the `fast` deployments (must be 0).
    pub deep_lane_calls: u64,
    pub fast_calls_for_items: u64,
}

/// The tenant whose classes the run uses, and its key.
const TENANT: &str = "pooled";
const KEY: &str = "pooled-key";
const AZURE: &str = "azure-us";
const OPENAI: &str = "openai-fast";
const FAST: &str = "fast";
const DEEP: &str = "deep";

pub async fn run(cfg: &PoolRun, failover: bool) -> anyhow::Result<PoolReport> {
    let fast_openai = crate::simprovider::SimProvider::start(SimConfig {
        latency: cfg.latency,
        limits: Some(SimLimits::openai(None, Some(cfg.tpm))),
        ..Default::default()
    })
    .await;
    let deployment = simazure::AzureDeployment {
        name: AZURE.into(),
        model: "sim".into(),
        rpm: Some(cfg.rpm),
        tpm: None,
        global_batch: false,
        enqueued_token_limit: None,
    };
    let azure = SimAzure::start(AzureConfig {
        deployments: vec![deployment],
        provider: SimConfig { latency: cfg.latency, ..Default::default() },
        ..Default::default()
    })
    .await;
    // The region's first deployment is the Anthropic-style `deep` one (the stack's
    // simulated provider, with Message Batches); the tenant's interactive lane is `fast`.
    let tenant = format!(
        "[[tenants]]\nid = \"{TENANT}\"\nregion = \"us\"\napi_key_sha256 = [\"{}\"]\nsink = {{ kind = \"webhook\", url = \"{{webhook_url}}\", secret = \"{US_SECRET}\" }}\nallow_private_webhook = true\nclasses = {{ interactive = \"{FAST}\", batch = \"{DEEP}\" }}\n",
        reviewlane_core::tenants::hash_api_key(KEY)
    );
    let mut stack = Stack::start_with(StackOptions {
        us_provider: SimConfig { latency: cfg.latency, ..Default::default() },
        anthropic: true,
        extractors: 0,
        extra_tenants: tenant,
        provider_batch: "poll=500ms..2s".into(),
        ..Default::default()
    })
    .await;
    let mut xc = stack.extractor_config(Region::Us);
    xc.quota.model_class = DEEP.into();
    xc.pool = vec![
        DeploymentConfig {
            id: OPENAI.into(),
            class: FAST.into(),
            provider: ProviderConfig::OpenAi {
                base_url: fast_openai.base_url(),
                model: "sim".into(),
                api_key: Some("sk-fast".to_string().into()),
                endpoint_region: Region::Us,
                schema_dialect: Default::default(),
            },
            key_limit: 8,
            budgets: vec![(Dimension::Tokens, cfg.tpm)],
            price: None,
            preference: 0,
        },
        DeploymentConfig {
            id: AZURE.into(),
            class: FAST.into(),
            provider: ProviderConfig::AzureOpenAi(AzureDeployment {
                endpoint: azure.base_url(),
                deployment: AZURE.into(),
                model: "sim".into(),
                api_version: "2024-10-21".into(),
                auth: AzureAuth::ApiKey(Some(simazure::SIM_API_KEY.to_string().into())),
                endpoint_region: Region::Us,
                schema_dialect: Default::default(),
                batch_deployment: None,
            }),
            key_limit: 8,
            budgets: vec![(Dimension::Requests, u64::from(cfg.rpm))],
            price: None,
            preference: 0,
        },
    ];
    stack.start_extractor_with(Region::Us, xc).await;

    let epoch = fast_openai.epoch();
    // Every run starts its reviews the same way into Azure's window, 1 s after a mark:
    // started at random, a run begun in a window's last moments is credited that window
    // by the physical limit, though no call reaches it in time (the requests bucket
    // lends nothing in a window's last 250 ms).
    let unix_ms =
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
    let to_phase = (AZURE_WINDOW_MS + START_PHASE_MS - unix_ms() % AZURE_WINDOW_MS) % AZURE_WINDOW_MS;
    tokio::time::sleep(Duration::from_millis(to_phase)).await;
    let started = Instant::now();
    let started_unix_ms = unix_ms();
    let mut client = stack.client().await;
    let mut ids = Vec::new();
    for i in 0..cfg.reviews {
        ids.push(submit(&mut client, KEY, &format!("pool-{i}"), &sample_diff(&format!("pool {i}"))).await.job_id);
    }
    let sweep_id = sealed_sweep(&mut client, cfg.sweep_items).await?;
    let sealed = Instant::now();
    // The failover: once a third are published, the OpenAI account is out of money.
    let mut failed_at: Option<Instant> = None;
    let mut published = 0;
    let mut pending = ids.clone();
    let mut makespan = None;
    let mut sweep_done: Option<(proto::Sweep, Duration)> = None;
    let deadline = started + Duration::from_secs(900);
    while (makespan.is_none() || sweep_done.is_none()) && Instant::now() < deadline {
        let mut still = Vec::new();
        for id in pending {
            let Ok(r) = crate::stack::get(&mut client, KEY, &id).await else {
                still.push(id);
                continue;
            };
            match JobState::try_from(r.state) {
                Ok(JobState::Published) => published += 1,
                Ok(JobState::Terminal) => {}
                _ => still.push(id),
            }
        }
        pending = still;
        if pending.is_empty() && makespan.is_none() {
            makespan = Some(started.elapsed());
        }
        if failover && failed_at.is_none() && published >= cfg.reviews / 3 {
            fast_openai.script((0..10_000).map(|_| Scripted::insufficient_quota()));
            failed_at = Some(Instant::now());
        }
        if sweep_done.is_none() {
            let got = client.get_sweep(authed(KEY, GetSweepRequest { sweep_id: sweep_id.clone() })).await;
            if let Some(s) = got.ok().and_then(|r| r.into_inner().sweep)
                && s.percent_done == 100.0
            {
                sweep_done = Some((s, sealed.elapsed()));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let makespan = makespan.unwrap_or_else(|| started.elapsed());
    let (first, second, deep) = (fast_openai.stats(), azure.stats(), stack.us.provider.stats());
    let batches = stack.us.provider.batch_stats();
    stack.shutdown().await;

    let second_calls = second.deployments[AZURE].calls;
    let second_429 = second.deployments[AZURE].rate_limited;
    let scripted_ms = failed_at.map(|at| at.duration_since(epoch).as_millis() as u64);
    let quota_answers = scripted_ms.map_or(0, |ms| first.call_spans_ms.iter().filter(|(b, _)| *b >= ms).count() as u64);
    let first_429 = first.calls_429.saturating_sub(quota_answers);
    let mut paid: BTreeMap<&String, u64> = BTreeMap::new();
    for (job, n) in first.paid_by_job.iter().chain(second.paid_by_job.iter()) {
        *paid.entry(job).or_default() += n;
    }
    // Physical rates, calls a second: the account's tokens per call as it charged them.
    let tokens_per_call = first.tokens_charged as f64 / first.paid_by_job.values().sum::<u64>().max(1) as f64;
    let rate_first = cfg.tpm as f64 / 60.0 / tokens_per_call.max(1.0);
    let rate_second = f64::from(cfg.rpm) / 60.0;
    // What each lets through: the account's full bucket at once, then its refill;
    // Azure, a sixth of its requests per minute in each 10-second window on the clock's
    // marks (`simazure`), the first (partial) window included.
    let burst = cfg.tpm as f64 / tokens_per_call.max(1.0);
    let phase_ms = (started_unix_ms % AZURE_WINDOW_MS) as f64;
    let per_window = f64::from(cfg.rpm) / 6.0;
    let physical = match failed_at {
        None => physical_limit(cfg.reviews as f64, (burst, rate_first), (per_window, phase_ms / 1000.0, 0.0)),
        // From the failure on, the calls not yet started on Azure alone: what its window
        // at the failure had not let through yet, then a full window at each mark.
        Some(at) => {
            let f = at.duration_since(started).as_secs_f64();
            let phase = (phase_ms / 1000.0 + f) % (AZURE_WINDOW_MS as f64 / 1000.0);
            let failed_unix_ms = started_unix_ms + at.duration_since(started).as_millis() as u64;
            let window_start = failed_unix_ms - failed_unix_ms % AZURE_WINDOW_MS;
            let through = |c: &&simazure::AzureCall| c.status != 429 && c.at_ms < failed_unix_ms;
            let used = second.calls.iter().filter(through).filter(|c| c.at_ms >= window_start).count() as f64;
            let scripted_ms = at.duration_since(epoch).as_millis() as u64;
            let started_calls = first.call_spans_ms.iter().filter(|(b, _)| *b < scripted_ms).count()
                + second.calls.iter().filter(through).count();
            let left = cfg.reviews.saturating_sub(started_calls);
            f + physical_limit(left as f64, (0.0, 0.0), (per_window, phase, used.min(per_window)))
        }
    };
    let total_calls = first.total_calls + second_calls;
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    let (in_flight_at_failure, first_quota_to_last_call_s) = match failed_at {
        None => (None, None),
        Some(at) => {
            // Calls that reached the account after it ran out were answered
            // insufficient_quota; the first answer is the failure.
            let scripted_ms = at.duration_since(epoch).as_millis() as u64;
            let mut iq: Vec<(u64, u64)> =
                first.call_spans_ms.iter().copied().filter(|(b, _)| *b >= scripted_ms).collect();
            iq.sort();
            match iq.first() {
                None => (Some(0), Some(0.0)),
                Some(&(_, first_answer)) => {
                    let running = first.call_spans_ms.iter().filter(|(b, e)| *b < first_answer && *e > first_answer);
                    let last_call = iq.iter().map(|(b, _)| *b).max().unwrap_or(first_answer);
                    let after = last_call.saturating_sub(first_answer) as f64 / 1000.0;
                    (Some(running.count() as u64), Some(round(after)))
                }
            }
        }
    };
    let interactive: std::collections::HashSet<&String> = ids.iter().collect();
    let count = |s: &proto::Sweep, state: SweepItemState| {
        s.items.iter().find(|c| c.state == state as i32).map_or(0, |c| c.count)
    };
    let (items, published_items, failed_items, took) = match &sweep_done {
        Some((s, took)) => {
            (s.items_total, count(s, SweepItemState::Published), count(s, SweepItemState::Failed), *took)
        }
        None => (cfg.sweep_items as u64, 0, 0, sealed.elapsed()),
    };
    let sweep = SweepOutcome {
        items,
        published: published_items,
        failed: failed_items,
        lost: items - published_items - failed_items,
        paid_lines: batches.paid_lines.values().sum(),
        paid_twice: batches.paid_lines.values().filter(|n| **n > 1).count() as u64,
        seal_to_reconciled_s: round(took.as_secs_f64()),
        deep_lane_calls: deep.total_calls,
        fast_calls_for_items: first
            .calls_by_job
            .keys()
            .chain(second.calls_by_job.keys())
            .filter(|j| !interactive.contains(j))
            .count() as u64,
    };
    Ok(PoolReport {
        reviews: cfg.reviews,
        published,
        lost: cfg.reviews - published,
        paid_twice: paid.values().filter(|n| **n > 1).count(),
        calls_per_deployment: BTreeMap::from([
            (OPENAI.to_string(), first.total_calls),
            (AZURE.to_string(), second_calls),
            ("anthropic".to_string(), deep.total_calls),
        ]),
        budget_share: BTreeMap::from([
            (OPENAI.to_string(), round(rate_first / (rate_first + rate_second))),
            (AZURE.to_string(), round(rate_second / (rate_first + rate_second))),
        ]),
        calls_429: first_429 + second_429,
        share_429: round((first_429 + second_429) as f64 / total_calls.max(1) as f64),
        makespan_s: round(makespan.as_secs_f64()),
        physical_s: round(physical),
        ratio_to_physical: round(makespan.as_secs_f64() / physical),
        in_flight_at_failure,
        first_quota_to_last_call_s,
        azure_phase_at_start_s: round(phase_ms / 1000.0),
        azure_calls_by_window: by_window(&second.deployments[AZURE].requests_by_window, started_unix_ms),
        sweep,
    })
}

/// Azure's requests window (`simazure`'s default).
const AZURE_WINDOW_MS: u64 = 10_000;

/// How far into Azure's window a run starts its reviews.
const START_PHASE_MS: u64 = 1_000;

/// The calls let through in each window (keyed by its start, ms by the clock), from the
/// window running at `from_ms` to the last, an unused window as 0.
fn by_window(windows: &BTreeMap<u64, u64>, from_ms: u64) -> Vec<u64> {
    let first = from_ms - from_ms % AZURE_WINDOW_MS;
    let last = windows.keys().next_back().copied().unwrap_or(first).max(first);
    (first..=last).step_by(AZURE_WINDOW_MS as usize).map(|w| windows.get(&w).copied().unwrap_or(0)).collect()
}

/// The earliest time, in seconds from the start, by which two deployments can have
/// started `calls` calls: the OpenAI-style account's `(burst, rate per s)`, and Azure's
/// `(per window, phase, used)` — `per_window` calls at each 10-s mark, the first mark
/// `10 - phase` s in, and at the start what the window then running has left
/// (`per_window - used`).
fn physical_limit(calls: f64, (burst, rate): (f64, f64), (per_window, phase, used): (f64, f64, f64)) -> f64 {
    let window = AZURE_WINDOW_MS as f64 / 1000.0;
    let azure = |t: f64| per_window * (1.0 + ((t + phase) / window).floor()) - used;
    let mut t = 0.0;
    while burst + rate * t + azure(t) < calls && t < 3_600.0 {
        t += 0.01;
    }
    t.max(0.01)
}

/// The tenant's sweep of `items` files through the provider's batch API, sealed; its id.
async fn sealed_sweep(
    client: &mut reviewlane_api::proto::review_service_client::ReviewServiceClient<tonic::transport::Channel>,
    items: usize,
) -> anyhow::Result<String> {
    let create = CreateSweepRequest {
        idempotency_key: "pool-sweep".into(),
        mode: SweepMode::ProviderBatch as i32,
        ..Default::default()
    };
    let sweep = client.create_sweep(authed(KEY, create)).await?.into_inner().sweep.expect("a sweep");
    let id = sweep.sweep_id;
    for start in (0..items).step_by(250) {
        let page = (start..(start + 250).min(items)).map(|i| crate::sweep::item("pool", i)).collect();
        client.add_sweep_items(authed(KEY, AddSweepItemsRequest { sweep_id: id.clone(), items: page })).await?;
    }
    client.seal_sweep(authed(KEY, SealSweepRequest { sweep_id: id.clone() })).await?;
    Ok(id)
}

pub fn print(name: &str, r: &PoolReport) {
    println!(
        "pool {name}: {} reviews, {} published, {} lost, {} paid twice; calls {:?} (budget shares {:?}); {} answered 429 ({:.1}%)",
        r.reviews,
        r.published,
        r.lost,
        r.paid_twice,
        r.calls_per_deployment,
        r.budget_share,
        r.calls_429,
        r.share_429 * 100.0
    );
    println!(
        "  makespan {:.2} s against the physical limit {:.2} s: {:.3}x",
        r.makespan_s, r.physical_s, r.ratio_to_physical
    );
    if let (Some(n), Some(s)) = (r.in_flight_at_failure, r.first_quota_to_last_call_s) {
        println!("  failover: {n} calls in flight at the first insufficient_quota; last call to it {s:.3} s after");
    }
    let s = &r.sweep;
    println!(
        "  deep sweep: {} items, {} published, {} failed, {} lost; {} lines paid ({} twice); seal -> reconciled {:.2} s; {} lane calls to deep, {} item calls to fast",
        s.items,
        s.published,
        s.failed,
        s.lost,
        s.paid_lines,
        s.paid_twice,
        s.seal_to_reconciled_s,
        s.deep_lane_calls,
        s.fast_calls_for_items
    );
}

#[cfg(test)]
mod tests {
    use super::physical_limit;

    #[test]
    fn azure_alone_lets_a_window_through_at_each_mark_and_what_the_running_one_has_left() {
        let close = |a: f64, b: f64| (a - b).abs() < 0.02;
        // A fresh window at the start: 10 at once, 10 more at the first mark.
        assert!(close(physical_limit(10.0, (0.0, 0.0), (10.0, 0.0, 0.0)), 0.01));
        assert!(close(physical_limit(20.0, (0.0, 0.0), (10.0, 0.0, 0.0)), 10.0));
        // 4 s into a window 7 of whose 10 calls were taken: 3 now, the next 10 at 6 s.
        assert!(close(physical_limit(3.0, (0.0, 0.0), (10.0, 4.0, 7.0)), 0.01));
        assert!(close(physical_limit(13.0, (0.0, 0.0), (10.0, 4.0, 7.0)), 6.0));
        // The account's burst and refill beside it.
        assert!(close(physical_limit(15.0, (10.0, 1.0), (10.0, 0.0, 10.0)), 5.0));
    }
}
