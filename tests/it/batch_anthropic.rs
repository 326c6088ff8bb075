//! The Anthropic Message Batches client against the simulated provider's API over
//! loopback HTTP: requests built from the synchronous parameters, created inline,
//! polled to `ended`, its results streamed from `results_url` whatever their order and
//! each reconciled to its item's fate (only `succeeded` lines are billed); a cancelled
//! batch keeps what ran; a batch found again among the newest; 429s with their hint.

use std::time::Duration;

use reviewlane_core::batch::{self, BatchStatus, BatchStep, ItemFate, LineResult, Retryable};
use reviewlane_core::job::{ReviewDepth, TerminalReason};
use reviewlane_core::region::Region;
use reviewlane_extractor::batch::anthropic::{AnthropicBatches, MessageBatch};
use reviewlane_extractor::batch::openai::BatchApiError;
use reviewlane_extractor::provider::ProviderRequest;
use reviewlane_extractor::provider::anthropic::{AnthropicEndpoint, AnthropicProvider};
use reviewlane_testkit::simbatch::{BatchScript, LineFault};
use reviewlane_testkit::simprovider::{SimConfig, SimProvider};

use crate::harness::sample_diff;

/// Items `0..n`: their custom ids and their batch requests.
fn requests(sim: &SimProvider, n: usize) -> (Vec<String>, Vec<serde_json::Value>) {
    let provider = adapter(sim);
    let (mut ids, mut out) = (Vec::new(), Vec::new());
    for i in 0..n {
        let id = format!("eu_{i:032x}");
        let text = sample_diff(&format!("item {i}"));
        let diff = reviewlane_core::diff::parse(&text).unwrap();
        let req = ProviderRequest {
            job_id: &id,
            region: Region::Eu,
            schema_version: reviewlane_core::findings::LATEST_SCHEMA,
            diff_text: &text,
            diff: &diff,
            review_depth: ReviewDepth::Full,
            part: None,
        };
        out.push(provider.batch_request(batch::custom_id(&id).unwrap(), &req));
        ids.push(id);
    }
    (ids, out)
}

fn adapter(sim: &SimProvider) -> AnthropicProvider {
    let base = format!("http://{}", sim.addr());
    let endpoint =
        AnthropicEndpoint { base_url: base, model: "sim".into(), api_key: None, region: Region::Eu, max_tokens: 2048 };
    AnthropicProvider::new(endpoint, Duration::from_secs(5), Duration::from_secs(60), 1 << 20)
}

fn client(sim: &SimProvider) -> AnthropicBatches {
    let base = format!("http://{}", sim.addr());
    let limits = (Duration::from_secs(5), Duration::from_secs(60));
    AnthropicBatches::new(&base, None, Region::Eu, limits, std::sync::Arc::new(adapter(sim)))
}

/// Polls until the batch's step is not `Poll` (bounded: each read moves it one step).
async fn until_ended(client: &AnthropicBatches, id: &str) -> MessageBatch {
    for _ in 0..50 {
        let b = client.retrieve(id).await.unwrap();
        if batch::step(&b.status) != BatchStep::Poll {
            return b;
        }
    }
    panic!("the batch did not end in 50 polls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_batch_ends_and_each_result_comes_to_its_items_fate() {
    let sim = SimProvider::start(SimConfig::default()).await;
    let (ids, reqs) = requests(&sim, 6);
    sim.script_batches(BatchScript {
        progress_polls: 3,
        lines: [
            (ids[1].clone(), LineFault::Status(400)),
            (ids[2].clone(), LineFault::Status(500)),
            (ids[3].clone(), LineFault::Expired),
            (ids[4].clone(), LineFault::Malformed),
        ]
        .into(),
        ..Default::default()
    });
    let client = client(&sim);
    let created = client.create(&reqs).await.unwrap();
    assert_eq!(
        (created.status.clone(), created.processing, created.results_url.clone()),
        (BatchStatus::InProgress, 6, None)
    );
    // Nothing to read before the end (Anthropic reports nothing per line until then).
    assert!(client.lines(&created).await.unwrap().is_empty());
    // Found among the newest, as a coordinator that crashed would look for it.
    let (newest, _) = client.list(None, 20).await.unwrap();
    assert_eq!(newest.first().map(|b| b.id.as_str()), Some(created.id.as_str()));

    let ended = until_ended(&client, &created.id).await;
    assert_eq!((ended.status.clone(), ended.succeeded, ended.errored, ended.expired), (BatchStatus::Ended, 2, 2, 1));
    let lines = client.lines(&ended).await.unwrap();
    assert_eq!(lines.len(), 5, "the line cut off names no item");
    assert_ne!(lines.first().map(|(id, _)| id.as_str()), Some(ids[0].as_str()), "order is not the requests'");
    let matched = batch::reconcile(&ids, lines);
    let fates: Vec<ItemFate> = matched.items.into_iter().map(|(_, l)| batch::fate(l, 0, 2, false)).collect();
    match &fates[0] {
        ItemFate::Validate { output, usage } => {
            let diff = reviewlane_core::diff::parse(&sample_diff("item 0")).unwrap();
            let valid = reviewlane_core::findings::validate(reviewlane_core::findings::LATEST_SCHEMA, output, &diff)
                .expect("the batch answer validates");
            assert_eq!(valid.findings.len(), 1);
            assert_eq!(usage.map(|u| (u.input, u.output)), Some((100, 50)));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fates[1], ItemFate::Ended(TerminalReason::UpstreamRejected));
    assert!(
        fates[2..5].iter().all(|f| *f == ItemFate::Resubmit { resubmissions: 1 }),
        "api_error, expired, missing: {fates:?}"
    );
    assert!(matches!(fates[5], ItemFate::Validate { .. }));
    // Only the succeeded lines were billed.
    assert_eq!(sim.batch_stats().paid_lines.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_message_batch_keeps_what_ran_and_429s_carry_their_hint() {
    let sim = SimProvider::start(SimConfig::default()).await;
    sim.script_batches(BatchScript { progress_polls: 4, ..Default::default() });
    let (ids, reqs) = requests(&sim, 4);
    let client = client(&sim);
    let created = client.create(&reqs).await.unwrap();
    let canceling = client.cancel_batch(&created.id).await.unwrap();
    assert_eq!(canceling.status, BatchStatus::Cancelling);
    assert_eq!(batch::step(&canceling.status), BatchStep::Poll);
    let ended = until_ended(&client, &created.id).await;
    assert_eq!((ended.succeeded, ended.canceled), (2, 2));
    let lines = client.lines(&ended).await.unwrap();
    let canceled = lines.iter().filter(|(_, l)| *l == LineResult::Retryable(Retryable::Cancelled)).count();
    assert_eq!(canceled, 2);
    // Of a cancelled sweep, what did not run ends cancelled; what ran is still delivered.
    let fates: Vec<ItemFate> =
        batch::reconcile(&ids, lines).items.into_iter().map(|(_, l)| batch::fate(l, 0, 2, true)).collect();
    assert_eq!(fates.iter().filter(|f| matches!(f, ItemFate::Validate { .. })).count(), 2);
    assert_eq!(fates.iter().filter(|f| **f == ItemFate::Ended(TerminalReason::Cancelled)).count(), 2);

    sim.script_batches(BatchScript { throttle_requests: 1, ..Default::default() });
    assert_eq!(
        client.retrieve(&created.id).await.unwrap_err(),
        BatchApiError::RateLimited { retry_after: Some(Duration::from_secs(1)) }
    );
    assert!(client.retrieve(&created.id).await.is_ok());
}
