//! The OpenAI batch client against the simulated provider's Batch API over loopback
//! HTTP: request lines built from the synchronous body, uploaded, created with
//! metadata, polled through every status, read back from the output and error files
//! whatever their order, and each line reconciled to its item's fate. Also: a batch
//! found again by its metadata, a line cut off, a cancelled and an expired batch with
//! their partial results applied, a whole batch refused for its enqueued tokens, and
//! 429s on the batch endpoints.

use std::collections::BTreeMap;
use std::time::Duration;

use reviewlane_core::batch::{self, BatchStep, ItemFate, LineResult, Retryable};
use reviewlane_core::job::{ReviewDepth, TerminalReason};
use reviewlane_core::region::Region;
use reviewlane_extractor::batch::openai::{BatchApiError, BatchInfo, OpenAiBatches};
use reviewlane_extractor::provider::ProviderRequest;
use reviewlane_extractor::provider::openai::OpenAiProvider;
use reviewlane_testkit::simbatch::{BatchScript, LineFault};
use reviewlane_testkit::simprovider::{SimConfig, SimProvider};

use crate::harness::sample_diff;

/// Items `0..n`: their custom ids (job-id shaped) and the batch input file.
fn input(sim: &SimProvider, n: usize) -> (Vec<String>, Vec<u8>) {
    let provider = adapter(sim);
    let mut ids = Vec::new();
    let mut jsonl = Vec::new();
    for i in 0..n {
        let id = format!("us_{i:032x}");
        let text = sample_diff(&format!("item {i}"));
        let diff = reviewlane_core::diff::parse(&text).unwrap();
        let req = ProviderRequest {
            job_id: &id,
            region: Region::Us,
            schema_version: reviewlane_core::findings::LATEST_SCHEMA,
            diff_text: &text,
            diff: &diff,
            review_depth: ReviewDepth::Full,
            part: None,
        };
        let custom = batch::custom_id(&id).expect("a job id is a custom id").to_string();
        jsonl.extend(provider.batch_line(&custom, &req).to_string().into_bytes());
        jsonl.push(b'\n');
        ids.push(custom);
    }
    (ids, jsonl)
}

/// Polls until the batch's step is not `Poll` (each read moves the simulated batch one
/// step: bounded).
async fn until_done(client: &OpenAiBatches, id: &str) -> (BatchInfo, Vec<String>) {
    let mut seen = Vec::new();
    for _ in 0..50 {
        let info = client.retrieve(id).await.unwrap();
        seen.push(format!("{:?}", info.status));
        if batch::step(&info.status) != BatchStep::Poll {
            return (info, seen);
        }
    }
    panic!("the batch did not end in 50 polls: {seen:?}");
}

fn client(sim: &SimProvider) -> OpenAiBatches {
    let limits = (Duration::from_secs(5), Duration::from_secs(60));
    OpenAiBatches::new(&sim.base_url(), None, Region::Us, limits, std::sync::Arc::new(adapter(sim)))
}

fn adapter(sim: &SimProvider) -> OpenAiProvider {
    OpenAiProvider::new(
        &sim.base_url(),
        "sim".into(),
        None,
        Region::Us,
        Duration::from_secs(5),
        Duration::from_secs(60),
        1 << 20,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_through_every_status_and_each_line_comes_to_its_items_fate() {
    let sim = SimProvider::start(SimConfig::default()).await;
    let (ids, jsonl) = input(&sim, 6);
    sim.script_batches(BatchScript {
        validate_polls: 2,
        progress_polls: 3,
        finalize_polls: 2,
        lines: [
            (ids[1].clone(), LineFault::Status(400)),
            (ids[2].clone(), LineFault::Status(500)),
            (ids[3].clone(), LineFault::Malformed),
        ]
        .into(),
        ..Default::default()
    });
    let client = client(&sim);
    let file = client.upload("reviewlane-sweep-s1-chunk-0.jsonl", jsonl).await.unwrap();
    let metadata: BTreeMap<String, String> = [("reviewlane_chunk".to_string(), "s1-0".to_string())].into();
    let created = client.create(&file, &metadata).await.unwrap();
    assert_eq!(created.status, batch::BatchStatus::Validating);
    // Found again by its metadata, as a coordinator that crashed before recording the id
    // would look for it.
    let found = client.find_by_metadata("reviewlane_chunk", "s1-0", 3).await.unwrap().expect("found by metadata");
    assert_eq!(found.id, created.id);
    assert!(client.find_by_metadata("reviewlane_chunk", "other", 3).await.unwrap().is_none());

    let (done, seen) = until_done(&client, &created.id).await;
    for status in ["Validating", "InProgress", "Finalizing", "Ended"] {
        assert!(seen.iter().any(|s| s == status), "{status} not seen: {seen:?}");
    }
    assert_eq!((done.total, done.completed, done.failed), (6, 4, 2));
    assert!(done.output_file_id.is_some() && done.error_file_id.is_some());

    // The lines come in another order than the input's; each item gets its own.
    let lines = client.lines(&done).await.unwrap();
    let order: Vec<&str> = lines.iter().map(|(id, _)| id.as_str()).collect();
    assert_ne!(order, ids.iter().map(String::as_str).collect::<Vec<_>>(), "order is not the input's");
    let matched = batch::reconcile(&ids, lines);
    assert_eq!((matched.unknown, matched.repeated), (0, 0));
    for (i, (id, line)) in matched.items.into_iter().enumerate() {
        assert_eq!(id, ids[i]);
        match (i, batch::fate(line, 0, 2, false)) {
            (1, fate) => assert_eq!(fate, ItemFate::Ended(TerminalReason::UpstreamRejected)),
            (2, fate) => assert_eq!(fate, ItemFate::Resubmit { resubmissions: 1 }),
            // A line cut off names no item: its item is missing, and goes again.
            (3, fate) => assert_eq!(fate, ItemFate::Resubmit { resubmissions: 1 }),
            (_, ItemFate::Validate { output, usage }) => {
                // The same schema and diff validation as a lane answer.
                let diff = reviewlane_core::diff::parse(&sample_diff(&format!("item {i}"))).unwrap();
                let valid =
                    reviewlane_core::findings::validate(reviewlane_core::findings::LATEST_SCHEMA, &output, &diff)
                        .expect("the batch answer validates");
                assert_eq!(valid.findings.len(), 1);
                assert_eq!(usage.map(|u| (u.input, u.output)), Some((100, 50)));
            }
            (_, other) => panic!("item {i}: {other:?}"),
        }
    }
    let stats = sim.batch_stats();
    assert_eq!((stats.files_uploaded, stats.batches_created, stats.paid_lines.len()), (1, 1, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_expired_and_refused_batches_keep_what_ran_and_resubmit_the_rest() {
    let sim = SimProvider::start(SimConfig::default()).await;
    let client = client(&sim);
    let none = BTreeMap::new();

    // Cancelled in progress: half ran (paid, applied), the rest are resubmitted.
    sim.script_batches(BatchScript { progress_polls: 4, ..Default::default() });
    let (ids, jsonl) = input(&sim, 4);
    let created = client.create(&client.upload("c.jsonl", jsonl).await.unwrap(), &none).await.unwrap();
    client.retrieve(&created.id).await.unwrap();
    let cancelled = client.cancel_batch(&created.id).await.unwrap();
    assert_eq!(cancelled.status, batch::BatchStatus::Cancelled);
    assert_eq!(batch::step(&cancelled.status), BatchStep::Collect);
    let matched = batch::reconcile(&ids, client.lines(&cancelled).await.unwrap());
    let fates: Vec<ItemFate> = matched.items.into_iter().map(|(_, l)| batch::fate(l, 0, 2, false)).collect();
    assert_eq!(fates.iter().filter(|f| matches!(f, ItemFate::Validate { .. })).count(), 2, "{fates:?}");
    assert_eq!(fates.iter().filter(|f| matches!(f, ItemFate::Resubmit { .. })).count(), 2, "{fates:?}");

    // Expired: what ran is applied; the rest were never run.
    sim.script_batches(BatchScript { progress_polls: 2, expire: true, ..Default::default() });
    let (ids, jsonl) = input(&sim, 4);
    let created = client.create(&client.upload("e.jsonl", jsonl).await.unwrap(), &none).await.unwrap();
    let (expired, _) = until_done(&client, &created.id).await;
    assert_eq!(expired.status, batch::BatchStatus::Expired);
    let lines = client.lines(&expired).await.unwrap();
    let expired_lines = lines.iter().filter(|(_, l)| *l == LineResult::Retryable(Retryable::Expired)).count();
    assert_eq!((lines.len(), expired_lines), (4, 2));
    assert_eq!(batch::reconcile(&ids, lines).items.len(), 4);

    // Every line failed: no output file (null), only the error file.
    let (ids, jsonl) = input(&sim, 2);
    let all_refused = ids.iter().map(|id| (id.clone(), LineFault::Status(400))).collect();
    sim.script_batches(BatchScript { lines: all_refused, ..Default::default() });
    let created = client.create(&client.upload("r.jsonl", jsonl).await.unwrap(), &none).await.unwrap();
    let (refused, _) = until_done(&client, &created.id).await;
    assert_eq!((refused.output_file_id.as_deref(), refused.error_file_id.is_some()), (None, true));

    // A batch over the enqueued-token limit fails whole: resubmitted later and smaller.
    sim.script_batches(BatchScript { fail_with: Some("token_limit_exceeded".into()), ..Default::default() });
    let (_, jsonl) = input(&sim, 2);
    let created = client.create(&client.upload("t.jsonl", jsonl).await.unwrap(), &none).await.unwrap();
    let (failed, _) = until_done(&client, &created.id).await;
    assert_eq!(batch::step(&failed.status), BatchStep::TokenLimit);
    assert!(client.lines(&failed).await.unwrap().is_empty());

    // A 429 on the batch endpoints comes with its hint.
    sim.script_batches(BatchScript { throttle_requests: 1, ..Default::default() });
    assert_eq!(
        client.retrieve(&created.id).await.unwrap_err(),
        BatchApiError::RateLimited { retry_after: Some(Duration::from_secs(1)) }
    );
    assert!(client.retrieve(&created.id).await.is_ok());
}
