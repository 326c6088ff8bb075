//! The `gateway` run: reviews through a LiteLLM-style proxy in front of the provider
//! (`testkit::simgateway`): 20 requests per fixed minute, 200s that carry the limit and
//! what remains but no reset, 429s without any hint. 30 reviews submitted at once, the
//! gateway's window starting with the run, so one window and a call is the floor.
//! Reported: published, calls, 429s and their share, the last result against the floor.

use std::time::{Duration, Instant};

use reviewlane_api::proto::JobState;
use reviewlane_core::region::Region;
use reviewlane_testkit::simgateway::{GatewayConfig, SimGateway};
use serde::Serialize;

use crate::simprovider::SimConfig;
use crate::stack::{Stack, StackOptions, US_KEY, sample_diff, submit, wait_final_within};

#[derive(Debug, Clone)]
pub struct GatewayRun {
    pub reviews: usize,
    pub rpm: u64,
    pub window: Duration,
    pub latency: Duration,
}

impl GatewayRun {
    pub fn full() -> Self {
        GatewayRun { reviews: 30, rpm: 20, window: Duration::from_secs(60), latency: Duration::from_secs(1) }
    }

    /// One window and a call for every window the reviews need beyond the first.
    pub fn floor(&self) -> Duration {
        let windows = (self.reviews as u64).div_ceil(self.rpm).saturating_sub(1) as u32;
        self.window * windows + self.latency
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct GatewayReport {
    pub reviews: usize,
    pub published: usize,
    pub calls: u64,
    pub calls_429: u64,
    pub share_429: f64,
    pub congestion_retries: u32,
    pub last_result_s: f64,
    pub floor_s: f64,
    pub ratio_to_floor: f64,
}

impl GatewayReport {
    pub fn ok(&self) -> bool {
        self.published == self.reviews
    }
}

pub async fn run(cfg: &GatewayRun) -> anyhow::Result<GatewayReport> {
    let gateway = SimGateway::start(GatewayConfig {
        rpm: cfg.rpm,
        window: cfg.window,
        clock: reviewlane_testkit::simgateway::clock_starting_a_window_now(cfg.window),
        deployment: SimConfig { latency: cfg.latency, ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    stack.start_extractor_calling(Region::Us, gateway.base_url()).await;
    let started = Instant::now();
    let mut client = stack.client().await;
    let mut ids = Vec::new();
    for i in 0..cfg.reviews {
        ids.push(submit(&mut client, US_KEY, &format!("gateway-{i}"), &sample_diff(&format!("gw {i}"))).await.job_id);
    }
    let (mut published, mut congestion_retries) = (0, 0);
    for id in &ids {
        let r = wait_final_within(&mut client, US_KEY, id, cfg.window * 4).await;
        published += usize::from(r.state == JobState::Published as i32);
        congestion_retries += r.attempts.unwrap_or_default().congestion;
    }
    let took = started.elapsed();
    let stats = gateway.stats();
    stack.shutdown().await;
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    Ok(GatewayReport {
        reviews: cfg.reviews,
        published,
        calls: stats.total_calls,
        calls_429: stats.calls_429,
        share_429: round(stats.calls_429 as f64 / stats.total_calls.max(1) as f64),
        congestion_retries,
        last_result_s: round(took.as_secs_f64()),
        floor_s: round(cfg.floor().as_secs_f64()),
        ratio_to_floor: round(took.as_secs_f64() / cfg.floor().as_secs_f64()),
    })
}

pub fn print(r: &GatewayReport) {
    println!(
        "gateway: {} reviews, {} published; {} calls, {} answered 429 ({:.1}%), {} congestion retries",
        r.reviews,
        r.published,
        r.calls,
        r.calls_429,
        r.share_429 * 100.0,
        r.congestion_retries
    );
    println!(
        "  last result {:.2} s against the floor (one window and a call) {:.2} s: {:.3}x",
        r.last_result_s, r.floor_s, r.ratio_to_floor
    );
}
