//! Large reviews: a diff larger than the model's context is one job of many parts,
//! called concurrently as far as admission allows. Each part is one call, checkpointed
//! in the job record once its answer is kept; a 429 on a part redoes that part only, an
//! extractor killed with several parts in flight leaves the parts it recorded paid
//! once; the parts' findings are merged and published once.

use std::collections::BTreeSet;
use std::time::Duration;

use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_api::proto::{JobState, WatchReviewRequest};
use reviewlane_core::job::JobRecord;
use reviewlane_core::parts::{self, PartLimits, Tokenizer};
use reviewlane_core::region::Region;
use reviewlane_shared::layout;
use reviewlane_testkit::diffs;
use reviewlane_testkit::procs::{ProcStack, ensure_built, ensure_nats_server};
use reviewlane_testkit::simprovider::{Scripted, SimConfig};

use crate::harness::*;

/// The parts the extractors (model `sim`: the 3-bytes-per-token estimate) cut `diff` into.
fn expected_parts(diff: &str, context_tokens: usize) -> usize {
    let limits = PartLimits { max_tokens: context_tokens, ..Default::default() };
    let count = reviewlane_extractor::tokenizer::counter(Tokenizer::default());
    parts::split(&reviewlane_core::diff::parse(diff).unwrap(), &limits, count.as_ref()).len()
}

async fn record(nats_url: &str, job_id: &str) -> JobRecord {
    let js = async_nats::jetstream::new(async_nats::connect(nats_url).await.unwrap());
    let jobs = js.get_key_value(layout::jobs_bucket(Region::Us)).await.unwrap();
    serde_json::from_slice(&jobs.get(job_id).await.unwrap().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_review_calls_its_parts_concurrently_and_is_published_once_and_a_429_redoes_only_its_part() {
    let stack = Stack::start_with(StackOptions {
        max_diff_bytes: 4 * 1024 * 1024,
        // Calls long enough to overlap.
        us_provider: SimConfig { latency: Duration::from_millis(200), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    // 40 files, about 2.2 MB: far over one call's 100,000-token context.
    let diff = diffs::large(40, 1000);
    assert!(diff.len() > 2_000_000, "{}", diff.len());
    let n = expected_parts(&diff, 100_000);
    assert!(n >= 8, "{n} parts");
    // The first two calls find nothing; the third is answered 429 once.
    let retry_after = vec![("retry-after".to_string(), "1".to_string())];
    stack.us.provider.script([
        Scripted::Output(r#"{"findings":[]}"#.into()),
        Scripted::Output(r#"{"findings":[]}"#.into()),
        Scripted::Status { status: 429, headers: retry_after, body: "{}".into() },
    ]);

    let job = submit(&mut client, US_KEY, "large", &diff).await;
    // WatchReview shows the parts as they are done.
    let request = authed(US_KEY, WatchReviewRequest { job_id: job.job_id.clone() });
    let mut stream = client.watch_review(request).await.unwrap().into_inner();
    let mut progress = Vec::new();
    let watched = tokio::time::timeout(Duration::from_secs(90), async {
        let mut last = None;
        while let Some(m) = stream.message().await.unwrap() {
            let review = m.review.unwrap();
            progress.push((review.parts_done, review.parts_total));
            last = Some(review);
        }
        last.unwrap()
    })
    .await
    .expect("the review finishes within 90 s");
    let done = get(&mut client, US_KEY, &job.job_id).await.unwrap();
    assert_eq!(watched.state, JobState::Published as i32, "{watched:?}");
    assert_eq!(done.state, JobState::Published as i32, "{done:?}");
    assert_eq!((done.parts_total, done.parts_done), (n as u32, n as u32));
    assert!(progress.windows(2).all(|w| w[0].0 <= w[1].0), "{progress:?}");
    assert!(progress.iter().any(|(d, t)| *d > 0 && *d < n as u32 && *t == n as u32), "{progress:?}");

    // Every part paid once; the part answered 429 called twice, no other part again.
    let stats = stack.us.provider.stats();
    let paid: Vec<(String, u64)> =
        stats.paid_by_part.iter().filter(|(k, _)| k.starts_with(&job.job_id)).map(|(k, v)| (k.clone(), *v)).collect();
    assert_eq!(paid.len(), n, "{paid:?}");
    assert!(paid.iter().all(|(_, v)| *v == 1), "{paid:?}");
    assert_eq!(stats.paid_by_job.get(&job.job_id), Some(&(n as u64)));
    let calls: Vec<u64> =
        (0..n).map(|p| stats.calls_by_part.get(&format!("{}/{p}", job.job_id)).copied().unwrap_or(0)).collect();
    assert_eq!(calls.iter().filter(|c| **c == 2).count(), 1, "{calls:?}");
    assert!(calls.iter().all(|c| *c == 1 || *c == 2), "{calls:?}");
    assert_eq!(done.attempts.unwrap().congestion, 1);
    // The parts ran concurrently, within the key's limit (8).
    assert!(stats.max_concurrent > 2 && stats.max_concurrent <= 8, "{} concurrent calls", stats.max_concurrent);
    // Tokens of every paid call (100 in, 50 out each in the simulation).
    let t = done.tokens.unwrap();
    assert_eq!((t.input, t.output), (100 * n as u64, 50 * n as u64));

    // One delivery: the parts' findings merged (one per file outside the first two
    // parts), sorted by path, none dropped.
    assert!(eventually(Duration::from_secs(10), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    let delivered: serde_json::Value = serde_json::from_slice(&stack.webhook.for_job(&job.job_id)[0].body).unwrap();
    let paths: Vec<&str> =
        delivered["findings"].as_array().unwrap().iter().map(|f| f["path"].as_str().unwrap()).collect();
    let unique: BTreeSet<&str> = paths.iter().copied().collect();
    assert_eq!(paths.len(), unique.len(), "duplicates delivered");
    assert!(paths.windows(2).all(|w| w[0] < w[1]), "not sorted: {paths:?}");
    assert!(paths.len() > 20 && paths.len() < 40, "{}", paths.len());
    assert_eq!(done.findings.len(), paths.len());
    assert!(done.findings.iter().all(|f| f.fingerprint.len() == 32));
    assert_eq!(done.findings_dropped, 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extractor_killed_with_parts_in_flight_re_pays_at_most_those_parts() {
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    let mut stack = ProcStack::start(StackOptions {
        max_diff_bytes: 4 * 1024 * 1024,
        // Small parts (8,000 tokens: about 19 KB), so the review has many.
        context_tokens: Some(8_000),
        lease: Duration::from_secs(2),
        us_provider: SimConfig { latency: Duration::from_millis(600), ..Default::default() },
        ..Default::default()
    })
    .await
    .expect("stack starts");
    let mut client = ReviewServiceClient::connect(format!("http://{}", stack.ingress)).await.unwrap();
    let diff = diffs::large(12, 300);
    let n = expected_parts(&diff, 8_000);
    assert!(n >= 8, "{n} parts");
    let job = submit(&mut client, US_KEY, "killed", &diff).await;

    // Kill -9 the extractor once a few parts are recorded and several are in flight.
    let url = stack.us.nats.url();
    let provider = &stack.us.provider;
    let (recorded, in_flight) = poll_until(Duration::from_secs(60), || async {
        let rec = record(url, &job.job_id).await;
        let done: BTreeSet<u32> = rec.parts.iter().flat_map(|p| p.done.iter().map(|d| d.index)).collect();
        let in_flight = provider.in_flight();
        (done.len() >= 3 && in_flight >= 2).then_some((done, in_flight))
    })
    .await
    .expect("three parts recorded and two in flight within 60 s");
    stack.service_mut("extractor-us").unwrap().kill_and_restart().unwrap();

    let done = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(90)).await;
    assert_eq!(done.state, JobState::Published as i32, "{done:?}");
    assert_eq!((done.parts_total, done.parts_done), (n as u32, n as u32));
    let stats = stack.us.provider.stats();
    let paid = |p: u32| stats.paid_by_part.get(&format!("{}/{p}", job.job_id)).copied().unwrap_or(0);
    // Parts recorded before the kill were not paid again; every part was paid; at most
    // the calls in flight at the kill were paid twice (their caller died with them).
    for p in &recorded {
        assert_eq!(paid(*p), 1, "part {p} recorded before the kill was paid again");
    }
    assert!((0..n as u32).all(|p| paid(p) >= 1));
    let total: u64 = (0..n as u32).map(paid).sum();
    assert!(total <= (n + in_flight) as u64, "{total} paid calls for {n} parts, {in_flight} in flight at the kill");
    assert!(eventually(Duration::from_secs(10), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    let delivered: serde_json::Value = serde_json::from_slice(&stack.webhook.for_job(&job.job_id)[0].body).unwrap();
    assert_eq!(delivered["findings"].as_array().unwrap().len(), 12);
    let codes = stack.shutdown();
    assert!(codes.values().all(|c| *c == Some(0)), "{codes:?}");
}
