//! The `sweep` run: a sweep of many items through the OpenAI Batch API of the simulated
//! provider, end to end through the real processes, while two other tenants send
//! interactive reviews at a steady rate; then the same items through the lanes, for the
//! cost. Reported: the time from the seal to every item reconciled (published or failed
//! with a reason), paid lines against the items (lines sent again counted apart), lost
//! items, the interactive reviews' submit-to-published p50/p99 beside the sweep against
//! the same reviews with no sweep running, and the sweep's cost through the batch API
//! beside its cost through the lanes.

use std::time::{Duration, Instant};

use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_api::proto::{
    self, AddSweepItemsRequest, CreateSweepRequest, GetSweepRequest, SealSweepRequest, SweepItem, SweepItemState,
    SweepMode, WatchSweepRequest,
};
use serde::Serialize;
use tonic::transport::Channel;

use crate::large::{Interactive, OTHER_TENANTS};
use crate::procs::ProcStack;
use crate::simprovider::SimConfig;
use crate::stack::{StackOptions, US_KEY, US_SECRET, authed};

#[derive(Debug, Clone)]
pub struct SweepConfig {
    pub items: usize,
    /// Items per `AddSweepItems` page.
    pub page: usize,
    /// The simulated provider's time per synchronous call (the lanes').
    pub provider_latency: Duration,
    pub key_limit: u32,
    /// Each other tenant submits one small review this often.
    pub interactive_every: Duration,
    /// How long the other tenants send reviews with no sweep running: long enough that
    /// the p99 alone, the divisor of `p99_ratio`, is a quantile of a few hundred reviews
    /// (about 480), not the second slowest of 120.
    pub alone_for: Duration,
    /// The extractors' `REVIEWLANE_PROVIDER_BATCH`.
    pub provider_batch: String,
}

impl SweepConfig {
    /// 5,000 items in pages of 500; calls of 50 ms; a key limit of 8; each other tenant
    /// one review every 250 ms, for 60 s alone; batches polled from 500 ms, doubling to 2 s.
    pub fn full() -> Self {
        SweepConfig {
            items: 5_000,
            page: 500,
            provider_latency: Duration::from_millis(50),
            key_limit: 8,
            interactive_every: Duration::from_millis(250),
            alone_for: Duration::from_secs(60),
            provider_batch: "poll=500ms..2s".into(),
        }
    }

    pub fn options(&self) -> StackOptions {
        let extra_tenants = OTHER_TENANTS
            .iter()
            .map(|(id, key)| {
                format!(
                    "[[tenants]]\nid = \"{id}\"\nregion = \"us\"\napi_key_sha256 = [\"{}\"]\nsink = {{ kind = \"webhook\", url = \"{{webhook_url}}\", secret = \"{US_SECRET}\" }}\nallow_private_webhook = true\n",
                    reviewlane_core::tenants::hash_api_key(key)
                )
            })
            .collect::<Vec<_>>()
            .join("\n");
        let prices = [("sim".to_string(), crate::stack::Price { input_per_mtok: 1.0, output_per_mtok: 2.0 })];
        StackOptions {
            us_provider: SimConfig { latency: self.provider_latency, ..Default::default() },
            key_limit: self.key_limit,
            extractor_concurrency: self.key_limit as usize,
            extra_tenants,
            model_prices: prices.into(),
            provider_batch: self.provider_batch.clone(),
            ..Default::default()
        }
    }
}

/// One sweep, from its seal to every item reconciled.
#[derive(Debug, Clone, Serialize)]
pub struct SweepRun {
    pub mode: &'static str,
    pub items: u64,
    pub published: u64,
    pub failed: u64,
    /// Items neither published nor failed when the run ended.
    pub lost: u64,
    /// Manifest upload (every page) and seal.
    pub upload_secs: f64,
    /// From the seal to every item final.
    pub reconcile_secs: f64,
    /// One `GetSweep` of the finished sweep (it reads every item's job record).
    pub get_sweep_secs: f64,
    /// Lines (or calls) paid for, and lines sent again.
    pub paid: u64,
    pub resubmitted: u64,
    pub provider_batches: u64,
    pub cost_usd: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SweepReport {
    pub batch: SweepRun,
    pub lanes: SweepRun,
    pub alone: Interactive,
    pub beside_sweep: Interactive,
    /// `beside_sweep.p50_secs` over `alone.p50_secs`, and the same of p99.
    pub p50_ratio: f64,
    pub p99_ratio: f64,
    /// The batch sweep's cost over the lanes'.
    pub cost_ratio: f64,
}

impl SweepReport {
    /// Every item published, each paid once, nothing lost, every interactive review
    /// published.
    pub fn ok(&self) -> bool {
        [&self.batch, &self.lanes].iter().all(|r| r.published == r.items && r.lost == 0 && r.paid == r.items)
            && self.alone.published == self.alone.reviews
            && self.beside_sweep.published == self.beside_sweep.reviews
    }
}

pub(crate) fn item(round: &str, i: usize) -> SweepItem {
    let path = format!("src/{round}/file_{i:05}.rs");
    SweepItem {
        item_key: path.clone(),
        diff: format!(
            "diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,3 @@\n+fn item_{i}() -> u32 {{\n+    compute({i}).unwrap_or_default()\n+}}\n"
        ),
        ..Default::default()
    }
}

fn count(sweep: &proto::Sweep, state: SweepItemState) -> u64 {
    sweep.items.iter().find(|c| c.state == state as i32).map_or(0, |c| c.count)
}

/// The sweep's view once every item is final, followed as a caller follows it
/// (`WatchSweep`, as `reviewctl sweep watch` does): one read of every item, then only
/// what changed. Polling `GetSweep` instead reads every item's job each time, which is
/// load of its own beside the interactive reviews. At the deadline, the last view.
async fn until_done(
    client: &mut ReviewServiceClient<Channel>,
    id: &str,
    deadline: tokio::time::Instant,
) -> anyhow::Result<proto::Sweep> {
    let mut last = None;
    while tokio::time::Instant::now() < deadline {
        let req = WatchSweepRequest { sweep_id: id.to_string() };
        let mut stream = client.watch_sweep(authed(US_KEY, req)).await?.into_inner();
        // Until the stream ends (the sweep done, or the server going): then open again.
        while let Ok(Ok(Some(m))) = tokio::time::timeout_at(deadline, stream.message()).await {
            let sweep = m.sweep.expect("a sweep");
            let done = sweep.percent_done == 100.0;
            last = Some(sweep);
            if done {
                return Ok(last.expect("just set"));
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    last.ok_or_else(|| anyhow::anyhow!("no view of sweep {id} before the deadline"))
}

async fn one_sweep(
    stack: &ProcStack,
    channel: &Channel,
    cfg: &SweepConfig,
    mode: SweepMode,
) -> anyhow::Result<SweepRun> {
    let mut client = ReviewServiceClient::new(channel.clone());
    let round = if mode == SweepMode::ProviderBatch { "batch" } else { "lanes" };
    // Read before the first item exists: through the lanes, items run from the seal on.
    let before = stack.us.provider.batch_stats();
    let calls_before = stack.us.provider.stats().paid_calls.len() as u64;
    let started = Instant::now();
    let create =
        CreateSweepRequest { idempotency_key: format!("load-{round}"), mode: mode as i32, ..Default::default() };
    let sweep = client.create_sweep(authed(US_KEY, create)).await?.into_inner().sweep.expect("a sweep");
    let id = sweep.sweep_id.clone();
    for start in (0..cfg.items).step_by(cfg.page) {
        let items = (start..(start + cfg.page).min(cfg.items)).map(|i| item(round, i)).collect();
        client.add_sweep_items(authed(US_KEY, AddSweepItemsRequest { sweep_id: id.clone(), items })).await?;
    }
    client.seal_sweep(authed(US_KEY, SealSweepRequest { sweep_id: id.clone() })).await?;
    let upload = started.elapsed();
    let sealed = Instant::now();
    let done = until_done(&mut client, &id, tokio::time::Instant::now() + Duration::from_secs(1800)).await?;
    let reconcile = sealed.elapsed();
    // One read of the whole sweep, as `GetSweep` makes it: every item's job.
    let read = Instant::now();
    client.get_sweep(authed(US_KEY, GetSweepRequest { sweep_id: id.clone() })).await?;
    let get_sweep_secs = read.elapsed().as_secs_f64();
    let after = stack.us.provider.batch_stats();
    let (published, failed) = (count(&done, SweepItemState::Published), count(&done, SweepItemState::Failed));
    let paid = match mode {
        SweepMode::ProviderBatch => after.paid_lines.values().sum::<u64>() - before.paid_lines.values().sum::<u64>(),
        _ => stack.us.provider.stats().paid_calls.len() as u64 - calls_before,
    };
    Ok(SweepRun {
        mode: round,
        items: done.items_total,
        published,
        failed,
        lost: done.items_total - published - failed,
        upload_secs: upload.as_secs_f64(),
        reconcile_secs: reconcile.as_secs_f64(),
        get_sweep_secs,
        paid,
        resubmitted: (after.lines_received - before.lines_received).saturating_sub(match mode {
            SweepMode::ProviderBatch => done.items_total,
            _ => 0,
        }),
        provider_batches: after.batches_created - before.batches_created,
        cost_usd: done.estimated_cost_usd,
    })
}

pub async fn run(stack: &ProcStack, cfg: &SweepConfig) -> anyhow::Result<SweepReport> {
    let channel = crate::load::connect(stack.ingress).await?;
    let every = cfg.interactive_every;
    let alone = crate::large::interactive_reviews(&channel, every, "alone", tokio::time::sleep(cfg.alone_for)).await;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let beside = crate::large::interactive_reviews(&channel, every, "beside", async {
        let _ = done_rx.await;
    });
    let swept = async {
        tokio::time::sleep(every * 2).await;
        let r = one_sweep(stack, &channel, cfg, SweepMode::ProviderBatch).await;
        let _ = done_tx.send(());
        r
    };
    let (beside_sweep, batch) = tokio::join!(beside, swept);
    let batch = batch?;
    let lanes = one_sweep(stack, &channel, cfg, SweepMode::Lanes).await?;
    let ratio = |a: f64, b: f64| a / b.max(f64::EPSILON);
    Ok(SweepReport {
        p50_ratio: ratio(beside_sweep.p50_secs, alone.p50_secs),
        p99_ratio: ratio(beside_sweep.p99_secs, alone.p99_secs),
        cost_ratio: ratio(batch.cost_usd, lanes.cost_usd),
        batch,
        lanes,
        alone,
        beside_sweep,
    })
}

pub fn print(r: &SweepReport) {
    for run in [&r.batch, &r.lanes] {
        println!(
            "sweep via {:<6} {} items: published {} failed {} lost {}; upload {:.2} s, seal -> reconciled {:.2} s (one GetSweep {:.3} s); paid {} (resubmitted {}), provider batches {}, cost {:.4} USD",
            run.mode,
            run.items,
            run.published,
            run.failed,
            run.lost,
            run.upload_secs,
            run.reconcile_secs,
            run.get_sweep_secs,
            run.paid,
            run.resubmitted,
            run.provider_batches,
            run.cost_usd
        );
    }
    for (name, i) in [("alone", &r.alone), ("beside", &r.beside_sweep)] {
        let s = &i.stages_p99_secs;
        println!(
            "  interactive reviews {name:<7} {} ({} published)  p50 {:.3} s  p99 {:.3} s  (stages' p99: submit {:.3}, waiting {:.3}, call {:.3}, delivery {:.3})",
            i.reviews, i.published, i.p50_secs, i.p99_secs, s.submit, s.waiting, s.call, s.delivery
        );
    }
    println!(
        "  beside the sweep / alone: p50 {:.3}, p99 {:.3}; cost batch / lanes {:.3}",
        r.p50_ratio, r.p99_ratio, r.cost_ratio
    );
}
