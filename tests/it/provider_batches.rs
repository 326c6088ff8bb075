//! Sweeps through the providers' own batch APIs, end to end: the region's coordinator
//! cuts the manifest into provider batches, sends each once, polls it, applies each
//! result line to its item once (validated against the item's diff, as a lane answer
//! is), sends again what did not run, and ends what was refused; the publisher delivers
//! each validated item once. Against the simulated provider's OpenAI Batch API and
//! Anthropic Message Batches API over loopback; real nats-server.

use std::collections::BTreeMap;
use std::time::Duration;

use reviewlane_api::proto::{
    self, AddSweepItemsRequest, CancelSweepRequest, CreateSweepRequest, GetSweepRequest, SealSweepRequest, SweepItem,
    SweepItemState, SweepMode, SweepState,
};
use reviewlane_testkit::simbatch::{BatchScript, LineFault};
use tonic::Code;

use crate::harness::*;

type Client = reviewlane_api::proto::review_service_client::ReviewServiceClient<tonic::transport::Channel>;

fn item(i: usize) -> SweepItem {
    SweepItem {
        item_key: format!("src/batch_{i}.rs"),
        diff: format!(
            "diff --git a/src/batch_{i}.rs b/src/batch_{i}.rs\nnew file mode 100644\n--- /dev/null\n+++ b/src/batch_{i}.rs\n@@ -0,0 +1,2 @@\n+fn g_{i}() {{}}\n+// TODO: finish {i}\n"
        ),
        ..Default::default()
    }
}

fn count(sweep: &proto::Sweep, state: SweepItemState) -> u64 {
    sweep.items.iter().find(|c| c.state == state as i32).map_or(0, |c| c.count)
}

fn failed(sweep: &proto::Sweep) -> BTreeMap<i32, u64> {
    sweep.failed.iter().map(|r| (r.reason, r.count)).collect()
}

async fn review_of(client: &mut Client, key: &str, job_id: String) -> proto::Review {
    let req = authed(key, proto::GetReviewRequest { job_id });
    client.get_review(req).await.unwrap().into_inner().review.unwrap()
}

async fn sweep_of(client: &mut Client, key: &str, id: &str) -> proto::Sweep {
    client.get_sweep(authed(key, GetSweepRequest { sweep_id: id.into() })).await.unwrap().into_inner().sweep.unwrap()
}

/// Creates a sweep of `n` items under `key` in `mode`, and seals it; its id.
async fn sealed_sweep(client: &mut Client, key: &str, name: &str, mode: SweepMode, n: usize) -> proto::Sweep {
    let create = CreateSweepRequest { idempotency_key: name.into(), mode: mode as i32, ..Default::default() };
    let sweep = client.create_sweep(authed(key, create)).await.unwrap().into_inner().sweep.unwrap();
    let page = AddSweepItemsRequest { sweep_id: sweep.sweep_id.clone(), items: (0..n).map(item).collect() };
    client.add_sweep_items(authed(key, page)).await.unwrap();
    let seal = SealSweepRequest { sweep_id: sweep.sweep_id.clone() };
    client.seal_sweep(authed(key, seal)).await.unwrap().into_inner().sweep.unwrap()
}

/// Waits until every item of the sweep is final and the publisher is done.
async fn finished(client: &Client, key: &str, id: &str, within: Duration) -> proto::Sweep {
    poll_until(within, || {
        let mut client = client.clone();
        let (key, id) = (key.to_string(), id.to_string());
        async move {
            let s = sweep_of(&mut client, &key, &id).await;
            (s.percent_done == 100.0).then_some(s)
        }
    })
    .await
    .expect("every item final in time")
}

/// The job ids of the sweep's items, by item key.
async fn item_jobs(client: &mut Client, key: &str, id: &str) -> BTreeMap<String, (String, i32, i32)> {
    let req = proto::ListSweepItemsRequest { sweep_id: id.into(), page_size: 1000, ..Default::default() };
    let items = client.list_sweep_items(authed(key, req)).await.unwrap().into_inner().items;
    items.into_iter().map(|i| (i.item_key, (i.job_id, i.state, i.terminal_reason))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_through_openais_batch_api_is_paid_once_per_item_at_the_batch_price_and_reconciled() {
    let prices =
        [("sim".to_string(), reviewlane_extractor::config::Price { input_per_mtok: 1.0, output_per_mtok: 2.0 })].into();
    let stack = Stack::start_with(StackOptions { model_prices: prices, ..Default::default() }).await;
    let mut client = stack.client().await;
    // Every item is sent once; item 4's line is refused; item 5's never runs (expired)
    // and is sent again within its budget (2), then ends with its own reason.
    let sweep = sealed_sweep(&mut client, US_KEY, "openai-batch", SweepMode::Auto, 6).await;
    assert_eq!(sweep.runs_on, SweepMode::ProviderBatch as i32, "auto runs on the provider's batch API here");
    let id = sweep.sweep_id.clone();
    let jobs = item_jobs(&mut client, US_KEY, &id).await;
    let job = |i: usize| jobs[&format!("src/batch_{i}.rs")].0.clone();
    stack.us.provider.script_batches(BatchScript {
        lines: [(job(4), LineFault::Status(400)), (job(5), LineFault::Expired)].into(),
        ..Default::default()
    });
    let done = finished(&client, US_KEY, &id, Duration::from_secs(60)).await;
    assert_eq!((count(&done, SweepItemState::Published), count(&done, SweepItemState::Failed)), (4, 2));
    let reasons = failed(&done);
    assert_eq!(reasons.get(&(proto::TerminalReason::UpstreamRejected as i32)), Some(&1), "{reasons:?}");
    assert_eq!(reasons.get(&(proto::TerminalReason::DeadlineExceeded as i32)), Some(&1), "{reasons:?}");

    let stats = stack.us.provider.batch_stats();
    // The first batch, then item 5 alone twice more.
    assert_eq!((stats.files_uploaded, stats.batches_created), (3, 3), "{stats:?}");
    let paid: Vec<u64> = (0..4).map(|i| stats.paid_lines.get(&job(i)).copied().unwrap_or(0)).collect();
    assert_eq!(paid, [1, 1, 1, 1], "each published item paid once: {stats:?}");
    assert_eq!(stats.paid_lines.len(), 4, "nothing else paid");
    assert_eq!(stack.us.provider.stats().total_calls, 0, "no lane call");
    // Tokens of the paid lines; cost at half the synchronous price (100 in, 50 out each:
    // 0.0002 USD a call).
    let t = done.tokens.unwrap();
    assert_eq!((t.input, t.output), (400, 200));
    assert!((done.estimated_cost_usd - 4.0 * 0.0001).abs() < 1e-9, "{}", done.estimated_cost_usd);

    // Each published item delivered once, as an ordinary review linked to its sweep.
    for i in 0..4 {
        assert!(stack.webhook.wait_for(&job(i), Duration::from_secs(20)).await.is_some(), "item {i} delivered");
    }
    let settled = stack.webhook.wait_count(4, Duration::from_millis(500), Duration::from_secs(10)).await;
    assert_eq!(settled, 4);
    for i in 0..4 {
        assert_eq!(stack.webhook.for_job(&job(i)).len(), 1, "item {i} delivered once");
    }
    let review = review_of(&mut client, US_KEY, job(0)).await;
    assert_eq!(review.state, proto::JobState::Published as i32);
    assert_eq!(review.sweep_id, id);
    assert!(!review.findings.is_empty(), "the batch line's findings, validated against the item's diff");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_through_anthropics_message_batches_resubmits_what_failed_and_ends_it_in_budget() {
    let stack = Stack::start_with(StackOptions { anthropic: true, ..Default::default() }).await;
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "anthropic-batch", SweepMode::ProviderBatch, 4).await;
    assert_eq!(sweep.runs_on, SweepMode::ProviderBatch as i32);
    let id = sweep.sweep_id.clone();
    let jobs = item_jobs(&mut client, US_KEY, &id).await;
    let job = |i: usize| jobs[&format!("src/batch_{i}.rs")].0.clone();
    // Item 3 errors (`api_error`) in every batch: sent again twice, then it ends.
    stack
        .us
        .provider
        .script_batches(BatchScript { lines: [(job(3), LineFault::Status(500))].into(), ..Default::default() });
    let done = finished(&client, US_KEY, &id, Duration::from_secs(60)).await;
    assert_eq!((count(&done, SweepItemState::Published), count(&done, SweepItemState::Failed)), (3, 1));
    assert_eq!(failed(&done).get(&(proto::TerminalReason::TransientBudgetExhausted as i32)), Some(&1));
    let stats = stack.us.provider.batch_stats();
    assert_eq!(stats.batches_created, 3, "{stats:?}");
    assert_eq!(stats.paid_lines.values().copied().collect::<Vec<_>>(), [1, 1, 1], "only succeeded lines are billed");
    assert_eq!(stack.us.provider.stats().total_calls, 0);
    for i in 0..3 {
        assert!(stack.webhook.wait_for(&job(i), Duration::from_secs(20)).await.is_some(), "item {i} delivered");
    }
    assert!(stack.webhook.for_job(&job(3)).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eu_region_on_anthropic_refuses_provider_batches_saying_why_and_runs_auto_on_the_lanes() {
    let stack = Stack::start_with(StackOptions { anthropic: true, ..Default::default() }).await;
    let mut client = stack.client().await;
    let create = |mode: SweepMode| CreateSweepRequest {
        idempotency_key: format!("eu-{}", mode as i32),
        mode: mode as i32,
        ..Default::default()
    };
    let refused = client.create_sweep(authed(EU_KEY, create(SweepMode::ProviderBatch))).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains("no EU processing location"), "{}", refused.message());
    let auto = client.create_sweep(authed(EU_KEY, create(SweepMode::Auto))).await.unwrap().into_inner().sweep.unwrap();
    assert_eq!(auto.runs_on, SweepMode::Lanes as i32);
    // The US region on the same provider runs them.
    let us = client.create_sweep(authed(US_KEY, create(SweepMode::ProviderBatch))).await.unwrap().into_inner();
    assert_eq!(us.sweep.unwrap().runs_on, SweepMode::ProviderBatch as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_sweep_cancels_its_provider_batch_and_delivers_only_what_ran() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    // A batch that runs long: cancelled while in progress, half its lines have run.
    stack.us.provider.script_batches(BatchScript { progress_polls: 400, ..Default::default() });
    let sweep = sealed_sweep(&mut client, US_KEY, "cancelled-batch", SweepMode::ProviderBatch, 6).await;
    let id = sweep.sweep_id.clone();
    poll_until(Duration::from_secs(20), || {
        let mut client = client.clone();
        let id = id.clone();
        async move { (count(&sweep_of(&mut client, US_KEY, &id).await, SweepItemState::Submitted) == 6).then_some(()) }
    })
    .await
    .expect("every item submitted to the provider");
    let provider = &stack.us.provider;
    let created =
        poll_until(Duration::from_secs(20), || async { (provider.batch_stats().batches_created == 1).then_some(()) });
    assert!(created.await.is_some(), "the batch is created");
    let cancelled = client.cancel_sweep(authed(US_KEY, CancelSweepRequest { sweep_id: id.clone() })).await.unwrap();
    assert_eq!(cancelled.into_inner().sweep.unwrap().state, SweepState::Cancelled as i32);
    let done = finished(&client, US_KEY, &id, Duration::from_secs(60)).await;
    let stats = stack.us.provider.batch_stats();
    let (published, cancelled) = (count(&done, SweepItemState::Published), count(&done, SweepItemState::Cancelled));
    assert_eq!(published + cancelled, 6, "{done:?}");
    assert_eq!(published, stats.paid_lines.len() as u64, "what ran (and was paid) is delivered, nothing else");
    assert!(cancelled > 0, "what had not run ends cancelled");
    assert_eq!(stats.batches_created, 1, "nothing is sent again");
}

/// Where the coordinator is killed (kill -9) in a provider batch's life.
#[derive(Clone, Copy, Debug)]
enum KillAt {
    /// Its input file uploaded, the create sent but not yet made.
    BeforeCreate,
    /// The batch made, its id not yet recorded.
    AfterCreate,
    /// Some of its result lines applied, not all.
    Applying,
}

/// A sweep of `n` items through the OpenAI batch path with the extractor killed at
/// `at`, then restarted: no second provider batch for the chunk, no item paid twice,
/// every item published and delivered once, the counts exact.
async fn killed_coordinator_resumes(at: KillAt, n: usize) {
    use reviewlane_testkit::procs::{ProcStack, ensure_built, ensure_nats_server};
    use reviewlane_testkit::simbatch::HoldCreate;
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    let mut stack = ProcStack::start(StackOptions { extractors: 1, ..Default::default() }).await.expect("stack starts");
    let hold = match at {
        KillAt::BeforeCreate => Some(HoldCreate::Before),
        KillAt::AfterCreate => Some(HoldCreate::After),
        KillAt::Applying => None,
    };
    stack.us.provider.script_batches(BatchScript { hold_create: hold, ..Default::default() });
    // Every change of a job record, as it happens (core NATS on the bucket's subjects).
    let nats = async_nats::connect(stack.us.nats.url()).await.unwrap();
    let bucket = reviewlane_shared::layout::jobs_bucket(reviewlane_core::region::Region::Us);
    let mut changes = nats.subscribe(format!("$KV.{bucket}.>")).await.unwrap();
    let mut client = Client::connect(format!("http://{}", stack.ingress)).await.unwrap();
    let sweep = sealed_sweep(&mut client, US_KEY, "killed", SweepMode::ProviderBatch, n).await;
    let id = sweep.sweep_id.clone();

    let provider = &stack.us.provider;
    match at {
        KillAt::BeforeCreate | KillAt::AfterCreate => {
            let held = poll_until(Duration::from_secs(30), || async {
                (provider.batch_stats().creates_held == 1).then_some(())
            });
            assert!(held.await.is_some(), "the create reached the provider");
            stack.service_mut("extractor-us").unwrap().kill_and_restart().unwrap();
            stack.us.provider.release_batches();
            let made = if matches!(at, KillAt::BeforeCreate) { 0 } else { 1 };
            assert_eq!(stack.us.provider.batch_stats().batches_created, made);
        }
        KillAt::Applying => {
            let validated = tokio::time::timeout(Duration::from_secs(60), async {
                let mut validated = std::collections::HashSet::new();
                while let Some(m) = futures::StreamExt::next(&mut changes).await {
                    let rec: Option<reviewlane_core::job::JobRecord> = serde_json::from_slice(&m.payload).ok();
                    if let Some(r) = rec.filter(|r| r.state == reviewlane_core::job::JobState::Validated) {
                        validated.insert(r.job_id);
                        if validated.len() == 10 {
                            break;
                        }
                    }
                }
                validated.len() as u64
            })
            .await
            .expect("results being applied within 60 s");
            stack.service_mut("extractor-us").unwrap().kill_and_restart().unwrap();
            let sweep = sweep_of(&mut client, US_KEY, &id).await;
            let applied = count(&sweep, SweepItemState::Validated) + count(&sweep, SweepItemState::Published);
            assert!(applied >= validated && applied < n as u64, "killed while applying: {applied} of {n} applied");
        }
    }

    let done = finished(&client, US_KEY, &id, Duration::from_secs(90)).await;
    let provider = &stack.us.provider;
    assert_eq!(count(&done, SweepItemState::Published), n as u64, "{at:?}: {done:?}");
    assert_eq!(done.items_total, n as u64);
    let stats = provider.batch_stats();
    assert_eq!(stats.batches_created, 1, "{at:?}: one provider batch for the chunk: {stats:?}");
    assert_eq!(stats.paid_lines.len(), n, "{at:?}");
    assert!(stats.paid_lines.values().all(|p| *p == 1), "{at:?}: an item paid twice: {stats:?}");
    let t = done.tokens.unwrap();
    assert_eq!((t.input, t.output), (100 * n as u64, 50 * n as u64), "{at:?}: tokens charged once per item");
    let jobs = item_jobs(&mut client, US_KEY, &id).await;
    let delivered = stack.webhook.wait_count(n, Duration::from_millis(500), Duration::from_secs(30)).await;
    assert_eq!(delivered, n, "{at:?}");
    for (job, ..) in jobs.values() {
        assert_eq!(stack.webhook.for_job(job).len(), 1, "{at:?}: delivered once");
    }
    let codes = stack.shutdown();
    assert!(codes.values().all(|c| *c == Some(0)), "{codes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_between_upload_and_create_creates_the_batch_once_after_restart() {
    killed_coordinator_resumes(KillAt::BeforeCreate, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_between_create_and_recording_the_id_finds_its_batch_and_creates_none() {
    killed_coordinator_resumes(KillAt::AfterCreate, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_while_applying_results_applies_each_line_once_after_restart() {
    killed_coordinator_resumes(KillAt::Applying, 300).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_hold_no_more_enqueued_tokens_than_the_models_budget() {
    // A budget smaller than one item: each batch holds one item, and the next is made
    // only once the one before has ended and given its tokens back.
    let stack = Stack::start_with(StackOptions {
        provider_batch: "poll=50ms..200ms,enqueued_tokens=1".into(),
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "budgeted", SweepMode::ProviderBatch, 3).await;
    let done = finished(&client, US_KEY, &sweep.sweep_id, Duration::from_secs(60)).await;
    assert_eq!(count(&done, SweepItemState::Published), 3);
    let stats = stack.us.provider.batch_stats();
    assert_eq!((stats.batches_created, stats.max_running), (3, 1), "{stats:?}");
    assert_eq!(stats.paid_lines.len(), 3);
}

/// Whether the region's coordinator marks the sweep settled (every item final, no
/// batch left) within 20 s.
async fn settled(stack: &Stack, id: &str) -> bool {
    use reviewlane_shared::Region;
    let js = async_nats::jetstream::new(async_nats::connect(stack.us.nats.url()).await.unwrap());
    let layout = reviewlane_shared::layout::ensure(&js, Region::Us, &Default::default()).await.unwrap();
    let sweeps = reviewlane_shared::sweeps::Sweeps::new(js, layout.sweeps);
    let sweeps = &sweeps;
    poll_until(Duration::from_secs(20), || async move {
        sweeps.get("acme", id).await.unwrap().filter(|(r, _)| r.finished).map(|_| ())
    })
    .await
    .is_some()
}

/// Waits until no delivery arrives for a while, then checks each of `jobs` was
/// delivered exactly once.
async fn delivered_once(stack: &Stack, jobs: &[String]) {
    for job in jobs {
        assert!(stack.webhook.wait_for(job, Duration::from_secs(20)).await.is_some(), "{job} delivered");
    }
    stack.webhook.wait_count(usize::MAX, Duration::from_millis(700), Duration::from_secs(15)).await;
    for job in jobs {
        assert_eq!(stack.webhook.for_job(job).len(), 1, "{job} delivered once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_resubmit_via_lanes_an_item_whose_line_did_not_run_is_called_once_on_the_batch_lane() {
    let batches = "poll=50ms..200ms,resubmit_via=lanes".into();
    let stack = Stack::start_with(StackOptions { provider_batch: batches, ..Default::default() }).await;
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "again-on-lanes", SweepMode::ProviderBatch, 4).await;
    let id = sweep.sweep_id.clone();
    let jobs = item_jobs(&mut client, US_KEY, &id).await;
    let job = |i: usize| jobs[&format!("src/batch_{i}.rs")].0.clone();
    // Item 1's line fails with a 5xx, item 2's never runs (expired). The first put on
    // the lane fails after its item was handed over: the next cut puts it there.
    stack.us.provider.script_batches(BatchScript {
        lines: [(job(1), LineFault::Status(500)), (job(2), LineFault::Expired)].into(),
        ..Default::default()
    });
    let lane = reviewlane_shared::faults::point::COORDINATOR_LANE;
    stack.faults().fail(lane, 1);
    let done = finished(&client, US_KEY, &id, Duration::from_secs(60)).await;
    assert_eq!(count(&done, SweepItemState::Published), 4, "{done:?}");
    assert_eq!(stack.faults().pending(lane), 0, "the failed put was met");

    let (lines, calls) = (stack.us.provider.batch_stats(), stack.us.provider.stats());
    assert_eq!(lines.batches_created, 1, "no second provider batch: {lines:?}");
    for i in [0, 3] {
        assert_eq!(lines.paid_lines.get(&job(i)), Some(&1), "item {i}: one batch line");
        assert_eq!(calls.calls_by_job.get(&job(i)), None, "item {i}: no lane call");
    }
    for i in [1, 2] {
        assert_eq!(lines.paid_lines.get(&job(i)), None, "item {i}: its line was not paid");
        assert_eq!(calls.paid_by_job.get(&job(i)), Some(&1), "item {i}: one lane call");
    }
    let again = review_of(&mut client, US_KEY, job(1)).await;
    assert_eq!((again.state, again.sweep_id.as_str()), (proto::JobState::Published as i32, id.as_str()));
    assert_eq!(again.attempts.unwrap().transient, 1, "the line that did not run counted once");
    delivered_once(&stack, &(0..4).map(job).collect::<Vec<_>>()).await;
    assert!(settled(&stack, &id).await, "settled once the items on the lanes are final");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_over_one_calls_budget_runs_on_the_batch_lane_in_parts_and_the_rest_in_a_provider_batch() {
    // Parts of 8,000 tokens: the large item (about 34 KB) is split, the small ones fit.
    let opts = StackOptions { context_tokens: Some(8_000), ..Default::default() };
    let stack = Stack::start_with(opts).await;
    let mut client = stack.client().await;
    let create = CreateSweepRequest {
        idempotency_key: "one-large".into(),
        mode: SweepMode::ProviderBatch as i32,
        ..Default::default()
    };
    let id = client.create_sweep(authed(US_KEY, create)).await.unwrap().into_inner().sweep.unwrap().sweep_id;
    let large =
        SweepItem { item_key: "large".into(), diff: reviewlane_testkit::diffs::large(2, 300), ..Default::default() };
    let page = AddSweepItemsRequest { sweep_id: id.clone(), items: vec![item(0), item(1), large] };
    client.add_sweep_items(authed(US_KEY, page)).await.unwrap();
    client.seal_sweep(authed(US_KEY, SealSweepRequest { sweep_id: id.clone() })).await.unwrap();
    let done = finished(&client, US_KEY, &id, Duration::from_secs(60)).await;
    assert_eq!(count(&done, SweepItemState::Published), 3, "{done:?}");

    let jobs = item_jobs(&mut client, US_KEY, &id).await;
    let (lines, calls) = (stack.us.provider.batch_stats(), stack.us.provider.stats());
    assert_eq!((lines.batches_created, lines.lines_received), (1, 2), "the small items in one batch: {lines:?}");
    let large = &jobs["large"].0;
    assert_eq!(lines.paid_lines.get(large), None, "the large item is in no batch");
    let parts: Vec<(&String, &u64)> =
        calls.paid_by_part.iter().filter(|(k, _)| k.starts_with(&format!("{large}/"))).collect();
    assert!(parts.len() >= 2 && parts.iter().all(|(_, n)| **n == 1), "each part paid once: {parts:?}");
    let review = review_of(&mut client, US_KEY, large.clone()).await;
    assert_eq!((review.parts_total as usize, review.sweep_id.as_str()), (parts.len(), id.as_str()));
    delivered_once(&stack, &jobs.values().map(|(j, ..)| j.clone()).collect::<Vec<_>>()).await;
    assert!(settled(&stack, &id).await, "settled once the item on the lane is final");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_refused_for_enqueued_tokens_are_cut_from_their_own_size_and_end_saying_so() {
    // The account refuses every batch for its enqueued tokens (`token_limit_exceeded`,
    // after a 200 to the create). Each refused batch is followed by one half its size,
    // down to one item; no refusal spends an item's resubmissions; a batch of one refused
    // again and again waits longer each time and its item ends `batch_token_limit`.
    let stack = Stack::start().await;
    stack
        .us
        .provider
        .script_batches(BatchScript { fail_with: Some("token_limit_exceeded".into()), ..Default::default() });
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "token-limit", SweepMode::ProviderBatch, 4).await;
    let done = finished(&client, US_KEY, &sweep.sweep_id, Duration::from_secs(90)).await;
    assert_eq!(count(&done, SweepItemState::Failed), 4, "{done:?}");
    assert_eq!(failed(&done).get(&(proto::TerminalReason::BatchTokenLimit as i32)), Some(&4), "{:?}", failed(&done));
    let stats = stack.us.provider.batch_stats();
    // 4, then 2 + 2, then each alone until it ends: 1 + 2 + 4 × (ALONE_REFUSALS_MAX
    // + 1) batches at most, fewer when alone refusals of the sweep run together.
    assert!(stats.batches_created >= 3 + 7, "{stats:?}");
    assert!(stats.paid_lines.is_empty(), "nothing ran");
    let mut items = Vec::new();
    let jobs = item_jobs(&mut client, US_KEY, &sweep.sweep_id).await;
    for (job, _, _) in jobs.values() {
        items.push(review_of(&mut client, US_KEY, job.clone()).await);
    }
    for r in &items {
        assert_eq!(r.terminal_reason, "batch_token_limit", "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_on_a_batch_endpoint_pauses_the_keys_batch_calls_for_its_hint() {
    // The upload is answered 429 with `retry-after: 1`: the next batch request waits the
    // hint out (the key's pause, shared by the fleet), not the next coordinator round.
    let stack = Stack::start().await;
    stack.us.provider.script_batches(BatchScript { throttle_requests: 1, ..Default::default() });
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "throttled-upload", SweepMode::ProviderBatch, 2).await;
    let throttled = poll_until(Duration::from_secs(20), || async {
        (stack.us.provider.batch_stats().throttled == 1).then(std::time::Instant::now)
    })
    .await
    .expect("the upload was answered 429");
    let uploaded = poll_until(Duration::from_secs(20), || async {
        (stack.us.provider.batch_stats().files_uploaded == 1).then(std::time::Instant::now)
    })
    .await
    .expect("uploaded after the pause");
    let waited = uploaded - throttled;
    assert!(waited >= Duration::from_millis(900), "uploaded again {waited:?} after a 429 saying 1 s");
    let done = finished(&client, US_KEY, &sweep.sweep_id, Duration::from_secs(60)).await;
    assert_eq!(count(&done, SweepItemState::Published), 2, "{done:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_that_did_not_run_is_sent_again_and_a_refused_one_ends_by_its_error_kind() {
    // OpenAI's error file: item 0's line timed out (`request_timeout`, no HTTP answer)
    // in the first batch only; item 1's was refused (`invalid_request_error`); item 2's
    // carries a code not known here, taken as not run (and counted), every time.
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "line-errors", SweepMode::ProviderBatch, 4).await;
    let jobs = item_jobs(&mut client, US_KEY, &sweep.sweep_id).await;
    let job = |i: usize| jobs[&format!("src/batch_{i}.rs")].0.clone();
    let script = |first: bool| {
        let mut lines = std::collections::HashMap::new();
        if first {
            lines.insert(job(0), LineFault::Error { code: "request_timeout" });
        }
        lines.insert(job(1), LineFault::Error { code: "invalid_request_error" });
        lines.insert(job(2), LineFault::Error { code: "quantum_flux" });
        BatchScript { lines, ..Default::default() }
    };
    stack.us.provider.script_batches(script(true));
    let first = poll_until(Duration::from_secs(30), || async {
        (stack.us.provider.batch_stats().batches_created >= 1).then_some(())
    })
    .await;
    assert!(first.is_some(), "a first batch");
    // From the second batch on, item 0's line runs.
    poll_until(Duration::from_secs(30), || async {
        let s = stack.us.provider.batch_stats();
        (!s.paid_lines.is_empty()).then_some(())
    })
    .await
    .expect("the first batch ended");
    stack.us.provider.script_batches(script(false));
    let done = finished(&client, US_KEY, &sweep.sweep_id, Duration::from_secs(60)).await;
    assert_eq!(count(&done, SweepItemState::Published), 2, "items 0 and 3: {done:?}");
    let reasons = failed(&done);
    assert_eq!(reasons.get(&(proto::TerminalReason::UpstreamRejected as i32)), Some(&1), "{reasons:?}");
    assert_eq!(reasons.get(&(proto::TerminalReason::TransientBudgetExhausted as i32)), Some(&1), "{reasons:?}");
    let stats = stack.us.provider.batch_stats();
    assert_eq!(stats.paid_lines.get(&job(0)), Some(&1), "the timed-out line ran when sent again: {stats:?}");
    let us = stack.extractor_admin.iter().find(|(r, _)| *r == reviewlane_core::region::Region::Us).unwrap().1;
    let metrics = http_get(us, "/metrics").await;
    assert!(metric_sum(&metrics, "reviewlane_batch_lines_unrecognised_total") >= 1.0, "the unknown code is counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_the_accounts_enqueued_tokens_is_cut_in_halves_until_one_fits_and_every_item_runs_once() {
    // The account admits about 3.5 items' worth of enqueued tokens, which nobody told
    // reviewlane: 8 items are refused (`token_limit_exceeded`), then 4, then batches of
    // 2 run. No refusal spends an item's resubmissions: all 8 run, each paid once.
    use reviewlane_testkit::simbatch::HoldCreate;
    let stack = Stack::start().await;
    let provider = &stack.us.provider;
    // The first create is held after its batch is made, to read its tokens before it is
    // validated, and set the limit from them.
    provider.script_batches(BatchScript { hold_create: Some(HoldCreate::After), ..Default::default() });
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "enqueued-limit", SweepMode::ProviderBatch, 8).await;
    let first = poll_until(Duration::from_secs(30), || async {
        let s = provider.batch_stats();
        (s.creates_held == 1 && s.batches_created == 1).then(|| s.enqueued_tokens.values().copied().sum::<u64>())
    })
    .await
    .expect("the first batch is made");
    let limit = first * 7 / 16;
    provider.script_batches(BatchScript { enqueued_token_limit: Some(limit), ..Default::default() });
    provider.release_batches();
    let done = finished(&client, US_KEY, &sweep.sweep_id, Duration::from_secs(90)).await;
    assert_eq!(count(&done, SweepItemState::Published), 8, "{done:?}");
    let stats = provider.batch_stats();
    assert_eq!(stats.batch_sizes[..3], [8, 4, 2], "cut from the refused batch's own size: {stats:?}");
    assert!(stats.batch_sizes[3..].iter().all(|n| *n <= 2), "the believed budget holds 2: {stats:?}");
    assert_eq!(stats.paid_lines.len(), 8, "{stats:?}");
    assert!(stats.paid_lines.values().all(|p| *p == 1), "each item paid once: {stats:?}");
    let t = done.tokens.unwrap();
    assert_eq!((t.input, t.output), (100 * 8, 50 * 8), "tokens charged once per item");
    stack.shutdown().await;
}

/// The sweep's provider batches as their records stand.
async fn chunk_records(stack: &Stack, sweep_id: &str) -> Vec<reviewlane_core::batch::ChunkRecord> {
    use reviewlane_shared::Region;
    let js = async_nats::jetstream::new(async_nats::connect(stack.us.nats.url()).await.unwrap());
    let layout = reviewlane_shared::layout::ensure(&js, Region::Us, &Default::default()).await.unwrap();
    let sweeps = reviewlane_shared::sweeps::Sweeps::new(js, layout.sweeps);
    sweeps.chunks(sweep_id).await.unwrap().into_iter().map(|(c, _)| c).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_enqueued_token_budget_is_never_exceeded_by_the_batches_running_at_once() {
    // One item's enqueued tokens, as the coordinator counts them, from a batch of one.
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let one = sealed_sweep(&mut client, US_KEY, "one", SweepMode::ProviderBatch, 1).await;
    finished(&client, US_KEY, &one.sweep_id, Duration::from_secs(60)).await;
    let item_tokens = chunk_records(&stack, &one.sweep_id).await[0].tokens;
    assert!(item_tokens > 0);
    stack.shutdown().await;

    // A budget of two and a half items: two at a time, never a third over the ceiling.
    let budget = item_tokens * 5 / 2;
    let stack = Stack::start_with(StackOptions {
        provider_batch: format!("poll=50ms..200ms,enqueued_tokens={budget}"),
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "budget", SweepMode::ProviderBatch, 5).await;
    let done = finished(&client, US_KEY, &sweep.sweep_id, Duration::from_secs(60)).await;
    assert_eq!(count(&done, SweepItemState::Published), 5, "{done:?}");
    let stats = stack.us.provider.batch_stats();
    assert_eq!(stats.batch_sizes, [2, 2, 1], "{stats:?}");
    assert_eq!(stats.max_running, 1, "the next batch waits for the one before to end: {stats:?}");
    let chunks = chunk_records(&stack, &sweep.sweep_id).await;
    for c in &chunks {
        assert!(c.tokens <= budget, "a batch of {} tokens under a budget of {budget}", c.tokens);
    }
    stack.shutdown().await;
}

/// A sweep through `anthropic` or OpenAI whose batch endpoints each answer their first
/// request 429 with a hint (`retry-after` in seconds, or the SDKs' `retry-after-ms`):
/// no batch request follows a 429 before its hint has passed, and the sweep ends.
async fn every_batch_endpoint_waits_out_its_429_hint(anthropic: bool) {
    use reviewlane_testkit::simbatch::{Endpoint, Throttle};
    let endpoints: &[(Endpoint, Option<u64>, Option<u64>)] = if anthropic {
        &[
            (Endpoint::List, Some(2), None),
            (Endpoint::Create, None, Some(1500)),
            (Endpoint::Get, Some(2), None),
            (Endpoint::Results, Some(2), Some(1200)),
        ]
    } else {
        &[
            (Endpoint::Upload, Some(2), None),
            (Endpoint::Create, None, Some(1500)),
            (Endpoint::Get, Some(2), None),
            (Endpoint::FileContent, Some(2), Some(1200)),
        ]
    };
    let throttles = endpoints
        .iter()
        .map(|&(endpoint, retry_after_secs, retry_after_ms)| Throttle {
            endpoint,
            times: 1,
            retry_after_secs,
            retry_after_ms,
        })
        .collect();
    let stack = Stack::start_with(StackOptions { anthropic, ..Default::default() }).await;
    stack.us.provider.script_batches(BatchScript { throttles, ..Default::default() });
    let mut client = stack.client().await;
    let sweep = sealed_sweep(&mut client, US_KEY, "throttled", SweepMode::ProviderBatch, 2).await;
    let done = finished(&client, US_KEY, &sweep.sweep_id, Duration::from_secs(90)).await;
    assert_eq!(count(&done, SweepItemState::Published), 2, "{done:?}");
    let stats = stack.us.provider.batch_stats();
    let log = &stats.throttle_log;
    assert_eq!(log.len(), endpoints.len(), "each endpoint answered 429 once: {log:?}");
    for t in log {
        let (hint, waited) = (t.hint_ms().unwrap(), t.waited_ms().expect("asked again"));
        assert!(waited >= hint, "{:?} asked again {waited} ms after a 429 saying {hint} ms", t.endpoint);
    }
    assert_eq!(stats.batches_created, 1, "a 429 on the create made no second batch: {stats:?}");
    assert!(stats.paid_lines.values().all(|p| *p == 1), "{stats:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_openai_batch_endpoint_waits_out_a_429s_hint() {
    every_batch_endpoint_waits_out_its_429_hint(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_anthropic_batch_endpoint_waits_out_a_429s_hint() {
    every_batch_endpoint_waits_out_its_429_hint(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_crash_in_the_create_window_anthropic_recovery_adopts_its_own_batch_never_another_applications() {
    // kill -9 between Anthropic's create and recording the batch id; meanwhile another
    // application on the same workspace creates a batch of the same size. The restarted
    // coordinator waits (no second create) until the candidates end, proves its own by
    // its results' custom ids, and never polls, applies or cancels the other one.
    use reviewlane_testkit::procs::{ProcStack, ensure_built, ensure_nats_server};
    use reviewlane_testkit::simbatch::HoldCreate;
    let n = 4;
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    let opts = StackOptions { extractors: 1, anthropic: true, ..Default::default() };
    let mut stack = ProcStack::start(opts).await.expect("stack starts");
    let script = BatchScript { hold_create: Some(HoldCreate::After), foreign_batches: 1, ..Default::default() };
    stack.us.provider.script_batches(script);
    let mut client = Client::connect(format!("http://{}", stack.ingress)).await.unwrap();
    let sweep = sealed_sweep(&mut client, US_KEY, "foreign", SweepMode::ProviderBatch, n).await;
    let provider = &stack.us.provider;
    let held =
        poll_until(Duration::from_secs(30), || async { (provider.batch_stats().creates_held == 1).then_some(()) });
    assert!(held.await.is_some(), "the create reached the provider");
    stack.service_mut("extractor-us").unwrap().kill_and_restart().unwrap();
    stack.us.provider.release_batches();

    let done = finished(&client, US_KEY, &sweep.sweep_id, Duration::from_secs(90)).await;
    assert_eq!(count(&done, SweepItemState::Published), n as u64, "{done:?}");
    let stats = stack.us.provider.batch_stats();
    let theirs = stats.foreign_batches.first().cloned().expect("another application's batch");
    assert_eq!(stats.batches_created, 1, "no second create: {stats:?}");
    assert_eq!(stats.paid_lines.len(), n, "{stats:?}");
    assert!(stats.paid_lines.values().all(|p| *p == 1), "each item paid once: {stats:?}");
    assert_eq!(stats.reads_by_batch.get(&theirs), None, "theirs never polled: {stats:?}");
    assert_eq!(stats.cancels_by_batch.get(&theirs), None, "theirs never cancelled: {stats:?}");
    assert!(stats.results_by_batch.get(&theirs).is_none_or(|r| *r <= 1), "their results read once, for proof");
    let t = done.tokens.unwrap();
    assert_eq!((t.input, t.output), (100 * n as u64, 50 * n as u64), "the cost is what was billed");
    let codes = stack.shutdown();
    assert!(codes.values().all(|c| *c == Some(0)), "{codes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_an_openai_batch_runs_get_list_and_watch_show_its_live_lines_and_an_estimate() {
    // OpenAI reports `request_counts` as lines finish: every read of the sweep shows them
    // (its items still `submitted`) and estimates from them.
    let stack = Stack::start().await;
    stack.us.provider.script_batches(BatchScript { progress_polls: 20, ..Default::default() });
    let mut client = stack.client().await;
    let n = 10;
    let sweep = sealed_sweep(&mut client, US_KEY, "live", SweepMode::ProviderBatch, n).await;
    let id = sweep.sweep_id.clone();
    let watch = proto::WatchSweepRequest { sweep_id: id.clone() };
    let mut stream = client.watch_sweep(authed(US_KEY, watch)).await.unwrap().into_inner();
    let running = |s: &proto::Sweep| {
        let b = s.provider_batches.unwrap_or_default();
        let done = b.lines_succeeded + b.lines_failed;
        (b.batches_running == 1 && b.lines == n as u64 && done > 0 && done < b.lines).then_some(b)
    };
    let got = poll_until(Duration::from_secs(30), || {
        let mut client = client.clone();
        let id = id.clone();
        async move {
            let s = sweep_of(&mut client, US_KEY, &id).await;
            running(&s).map(|_| s)
        }
    })
    .await
    .expect("GetSweep shows the batch's lines as they finish");
    assert_eq!(count(&got, SweepItemState::Submitted), n as u64, "lines done are not yet results: {got:?}");
    assert!(got.estimated_completion.is_some(), "GetSweep estimates from the live lines: {got:?}");
    let listed =
        client.list_sweeps(authed(US_KEY, proto::ListSweepsRequest::default())).await.unwrap().into_inner().sweeps;
    let listed = listed.iter().find(|s| s.sweep_id == id).expect("listed");
    assert_eq!(listed.provider_batches.map(|b| b.lines), Some(n as u64));
    let watched = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(event) = stream.message().await.unwrap() {
            let s = event.sweep.unwrap();
            if running(&s).is_some() {
                return Some(s);
            }
        }
        None
    })
    .await
    .expect("a watched view while the batch runs")
    .expect("the watch shows the live lines");
    assert!(watched.estimated_completion.is_some(), "WatchSweep estimates as GetSweep does: {watched:?}");
    let done = finished(&client, US_KEY, &id, Duration::from_secs(60)).await;
    assert_eq!(count(&done, SweepItemState::Published), n as u64);
    assert_eq!(done.provider_batches.map(|b| b.batches_running), Some(0), "{done:?}");
    stack.shutdown().await;
}
