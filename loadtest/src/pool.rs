//! The `pool` run: one region whose class of interactive reviews has two deployments —
//! an OpenAI-style account metered by tokens per minute (the simulated provider's
//! buckets) and an Azure OpenAI deployment metered by requests per 10-second window
//! (`testkit::simazure`) — each configured with its own budget. Reviews are submitted at
//! once; reported per run: calls per deployment against its share of the combined
//! budget, 429s, the makespan against the combined physical limit, each review paid
//! once. The `failover` run is the same with the OpenAI account answering
//! `insufficient_quota` once a third of the reviews are published: what was in flight
//! there, how long until no call went to it, and the rest against the Azure
//! deployment's limit alone.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use reviewlane_api::proto::JobState;
use reviewlane_core::meter::Dimension;
use reviewlane_core::region::Region;
use reviewlane_extractor::config::{AzureAuth, AzureDeployment, DeploymentConfig, ProviderConfig};
use reviewlane_testkit::simazure::{self, AzureConfig, SimAzure};
use reviewlane_testkit::simmeter::SimLimits;
use serde::Serialize;

use crate::simprovider::{Scripted, SimConfig};
use crate::stack::{Stack, StackOptions, US_KEY, sample_diff, submit};

#[derive(Debug, Clone)]
pub struct PoolRun {
    pub reviews: usize,
    /// The OpenAI-style account's tokens per minute.
    pub tpm: u64,
    /// The Azure deployment's requests per minute (a sixth of them per 10 s).
    pub rpm: u32,
    pub latency: Duration,
}

impl PoolRun {
    /// 180 reviews; about one call a second on each deployment.
    pub fn full() -> Self {
        PoolRun { reviews: 180, tpm: 300_000, rpm: 60, latency: Duration::from_millis(50) }
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
}

const AZURE: &str = "azure-us";

pub async fn run(cfg: &PoolRun, failover: bool) -> anyhow::Result<PoolReport> {
    let openai =
        SimConfig { latency: cfg.latency, limits: Some(SimLimits::openai(None, Some(cfg.tpm))), ..Default::default() };
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
    let mut stack = Stack::start_with(StackOptions {
        us_provider: openai,
        key_budgets: vec![(Dimension::Tokens, cfg.tpm)],
        extractors: 0,
        ..Default::default()
    })
    .await;
    let mut xc = stack.extractor_config(Region::Us);
    xc.pool = vec![DeploymentConfig {
        id: AZURE.into(),
        class: xc.quota.model_class.clone(),
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
    }];
    stack.start_extractor_with(Region::Us, xc).await;

    let epoch = stack.us.provider.epoch();
    let started = Instant::now();
    let mut client = stack.client().await;
    let mut ids = Vec::new();
    for i in 0..cfg.reviews {
        ids.push(submit(&mut client, US_KEY, &format!("pool-{i}"), &sample_diff(&format!("pool {i}"))).await.job_id);
    }
    // The failover: once a third are published, the OpenAI account is out of money.
    let mut failed_at: Option<(Instant, usize)> = None;
    let mut published = 0;
    let mut pending = ids.clone();
    let deadline = started + Duration::from_secs(600);
    while !pending.is_empty() && Instant::now() < deadline {
        let mut still = Vec::new();
        for id in pending {
            let Ok(r) = crate::stack::get(&mut client, US_KEY, &id).await else {
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
        if failover && failed_at.is_none() && published >= cfg.reviews / 3 {
            stack.us.provider.script((0..10_000).map(|_| Scripted::insufficient_quota()));
            failed_at = Some((Instant::now(), cfg.reviews - published));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let makespan = started.elapsed();
    let (first, second) = (stack.us.provider.stats(), azure.stats());
    stack.shutdown().await;

    let second_calls = second.deployments[AZURE].calls;
    let second_429 = second.deployments[AZURE].rate_limited;
    let scripted_ms = failed_at.map(|(at, _)| at.duration_since(epoch).as_millis() as u64);
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
    // What each lets through at once: the account's full bucket, Azure's first window.
    let burst = cfg.tpm as f64 / tokens_per_call.max(1.0) + f64::from(cfg.rpm) / 6.0;
    let physical = match failed_at {
        None => (cfg.reviews as f64 - burst).max(1.0) / (rate_first + rate_second),
        Some((at, left)) => {
            at.duration_since(started).as_secs_f64() + (left as f64 - f64::from(cfg.rpm) / 6.0).max(1.0) / rate_second
        }
    };
    let total_calls = first.total_calls + second_calls;
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    let (in_flight_at_failure, first_quota_to_last_call_s) = match failed_at {
        None => (None, None),
        Some((at, _)) => {
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
    Ok(PoolReport {
        reviews: cfg.reviews,
        published,
        lost: cfg.reviews - published,
        paid_twice: paid.values().filter(|n| **n > 1).count(),
        calls_per_deployment: BTreeMap::from([
            ("openai".to_string(), first.total_calls),
            (AZURE.to_string(), second_calls),
        ]),
        budget_share: BTreeMap::from([
            ("openai".to_string(), round(rate_first / (rate_first + rate_second))),
            (AZURE.to_string(), round(rate_second / (rate_first + rate_second))),
        ]),
        calls_429: first_429 + second_429,
        share_429: round((first_429 + second_429) as f64 / total_calls.max(1) as f64),
        makespan_s: round(makespan.as_secs_f64()),
        physical_s: round(physical),
        ratio_to_physical: round(makespan.as_secs_f64() / physical),
        in_flight_at_failure,
        first_quota_to_last_call_s,
    })
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
}
