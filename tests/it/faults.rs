//! Promises under store faults and crashes between two writes: a paid answer is kept
//! and never paid again, a result too large for one message is still delivered, a
//! crash between the ingress's two writes loses no job, and the reconciler re-drives or
//! ends what nothing drives any more.

use std::time::Duration;

use prometheus_client::registry::Registry;
use reviewlane_api::proto::JobState;
use reviewlane_core::clock::ManualClock;
use reviewlane_core::job::{Event, TerminalReason};
use reviewlane_core::job_id;
use reviewlane_core::messages::FindingsMessage;
use reviewlane_core::region::Region;
use reviewlane_extractor::metrics::Metrics;
use reviewlane_extractor::reconcile::{Pass, Reconciler};
use reviewlane_shared::faults::point;
use reviewlane_shared::job_store::JobStore;
use reviewlane_shared::layout;
use reviewlane_shared::telemetry;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paid_answer_survives_store_failures_without_a_second_call() {
    let stack = Stack::start().await;
    let faults = stack.faults();
    faults.fail(point::EXTRACTOR_KEEP, 2);
    faults.fail(point::EXTRACTOR_RECORD_VALIDATED, 2);
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "keep-1", &sample_diff("keep")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32);
    assert!(!last.findings.is_empty());
    // Both writes failed twice and were retried; the provider was paid once.
    assert_eq!((faults.pending(point::EXTRACTOR_KEEP), faults.pending(point::EXTRACTOR_RECORD_VALIDATED)), (0, 0));
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&job.job_id), Some(&1));
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    let page = http_get(stack.extractor_admin[0].1, "/metrics").await;
    assert_eq!(metric_sum(&page, "reviewlane_store_retries_total"), 4.0, "{page}");
    stack.shutdown().await;
}

/// Whether the service at `admin` says it is ready.
async fn ready(admin: std::net::SocketAddr) -> bool {
    http_get(admin, "/readyz").await == "ready\n"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paid_answer_outlasts_a_full_store_and_one_never_kept_ends_at_its_deadline() {
    let stack = Stack::start().await;
    let extractor = stack.extractor_admin[0].1;
    assert!(ready(extractor).await);
    // The store refuses the keep as full 25 times (about 4.5 s, twice the tries of the
    // store budget): the answer is held, its lease kept alive, until the store takes it.
    stack.faults().fail_full(point::EXTRACTOR_KEEP, 25);
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "keep-full", &sample_diff("full")).await;
    let unready = poll_until(Duration::from_secs(10), || async { (!ready(extractor).await).then_some(()) }).await;
    assert!(unready.is_some(), "readiness did not see the full store");
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    assert_eq!(stack.faults().pending(point::EXTRACTOR_KEEP), 0);
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&job.job_id), Some(&1), "paid once");
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    let page = http_get(extractor, "/metrics").await;
    let full = page
        .lines()
        .find(|l| l.starts_with("reviewlane_store_refusals_total{") && l.contains(r#"kind="full""#))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(full, Some(25.0), "{page}");
    // Ready again once the store has taken writes for a while.
    let back = poll_until(Duration::from_secs(30), || async { ready(extractor).await.then_some(()) }).await;
    assert!(back.is_some(), "still unready after the store came back");

    // Never taken: the answer is held until the job's deadline, then the job ends
    // `deadline_exceeded` — paid once, delivered never.
    stack.faults().fail_full(point::EXTRACTOR_KEEP, 1_000_000);
    let mut req = submit_req(US_KEY, "keep-never", &sample_diff("never"));
    req.get_mut().timeout = Some(prost_types::Duration { seconds: 3, nanos: 0 });
    let job = client.submit_review(req).await.unwrap().into_inner().review.unwrap();
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "deadline_exceeded"));
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&job.job_id), Some(&1), "never called again");
    assert!(stack.webhook.for_job(&job.job_id).is_empty());
    stack.faults().fail_full(point::EXTRACTOR_KEEP, 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_the_sink_took_is_not_made_again_while_the_store_is_full() {
    let stack = Stack::start().await;
    let publisher = stack.publisher_admin.iter().find(|(r, _)| *r == Region::Us).unwrap().1;
    // The webhook answers 2xx; recording that is refused as full 25 times.
    stack.faults().fail_full(point::PUBLISHER_RECORD_DELIVERED, 25);
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "deliver-full", &sample_diff("deliver")).await;
    let unready = poll_until(Duration::from_secs(10), || async { (!ready(publisher).await).then_some(()) }).await;
    assert!(unready.is_some(), "readiness did not see the full store");
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    assert_eq!(stack.faults().pending(point::PUBLISHER_RECORD_DELIVERED), 0);
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1, "delivered once");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_larger_than_one_message_goes_to_the_object_store_and_is_delivered() {
    let stack = Stack::start_with(StackOptions { result_inline_max: Some(64), ..Default::default() }).await;
    let mut client = stack.client().await;
    let job = submit(&mut client, EU_KEY, "big-1", &sample_diff("big")).await;
    let last = wait_final(&mut client, EU_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32);
    assert!(!last.findings.is_empty(), "GetReview reads the result from the object store");
    assert_eq!(stack.eu.provider.stats().calls_by_job.get(&job.job_id), Some(&1));
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    let delivered: serde_json::Value = serde_json::from_slice(&stack.webhook.for_job(&job.job_id)[0].body).unwrap();
    assert_eq!(delivered["findings"].as_array().map(|f| f.len()), Some(last.findings.len()));
    // The stream carries only a pointer to the object.
    let kept = stream_messages(stack.eu.nats.url(), &layout::findings_stream(Region::Eu)).await;
    let (_, _, payload) = kept.iter().find(|(s, _, _)| s.contains(&job.job_id)).expect("kept message");
    let pointer: FindingsMessage = serde_json::from_slice(payload).unwrap();
    assert!(pointer.stored_as.is_some() && pointer.findings.is_empty(), "{pointer:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_ingress_writes_loses_no_job_with_or_without_a_retry() {
    let stack = Stack::start().await;
    // The lane message is stored, the record beside it is not.
    stack.faults().fail(point::INGRESS_RECORD, 2);
    let mut client = stack.client().await;
    // Two diffs, so neither job can be answered from the other's cached result.
    for key in ["between-retried", "between-abandoned"] {
        let err = client.submit_review(submit_req(US_KEY, key, &sample_diff(key))).await.expect_err("write fails");
        assert_eq!(err.code(), tonic::Code::Unavailable);
    }
    // (a) The caller retries with the same key: the job goes on.
    let retried = submit(&mut client, US_KEY, "between-retried", &sample_diff("between-retried")).await;
    assert_eq!(wait_final(&mut client, US_KEY, &retried.job_id).await.state, JobState::Published as i32);
    // (b) Nobody retries: the message on the lane carries the job, the extractor
    // records it, and it is published all the same.
    let abandoned = job_id::derive(Region::Us, "acme", "between-abandoned");
    let published = poll_until(Duration::from_secs(30), || {
        let mut c = client.clone();
        let id = abandoned.clone();
        async move { get(&mut c, US_KEY, &id).await.ok().filter(|r| r.state == JobState::Published as i32) }
    });
    assert!(published.await.is_some(), "abandoned job not published in 30 s");
    let stats = stack.us.provider.stats();
    assert_eq!(stats.calls_by_job.get(&retried.job_id), Some(&1));
    assert_eq!(stats.calls_by_job.get(&abandoned), Some(&1));
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&abandoned).len() == 1).await);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_whose_lane_message_fails_leaves_no_record_unless_the_ingress_dies_first() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let diff = sample_diff("lane-fails");
    // The record is written beside the lane message, which fails: the refusal leaves
    // nothing behind, and a retry with the same key goes on as a fresh submit.
    stack.faults().fail(point::INGRESS_LANE, 2);
    for key in ["lane-retried", "lane-abandoned"] {
        let err = client.submit_review(submit_req(US_KEY, key, &diff)).await.expect_err("lane write fails");
        assert_eq!(err.code(), tonic::Code::Unavailable);
    }
    let abandoned = job_id::derive(Region::Us, "acme", "lane-abandoned");
    let err = get(&mut client, US_KEY, &abandoned).await.expect_err("no record is left");
    assert_eq!(err.code(), tonic::Code::NotFound);
    let retried = submit(&mut client, US_KEY, "lane-retried", &diff).await;
    assert_eq!(wait_final(&mut client, US_KEY, &retried.job_id).await.state, JobState::Published as i32);

    // The ingress dies between the failed lane write and removing the record: the
    // record is stranded (no message will ever drive it).
    stack.faults().fail(point::INGRESS_LANE, 2);
    stack.faults().fail(point::INGRESS_UNDO_RECORD, 2);
    // Another diff: not answered from the result cache.
    let diff = sample_diff("stranded");
    for key in ["stranded-retried", "stranded-abandoned"] {
        client.submit_review(submit_req(US_KEY, key, &diff)).await.expect_err("lane write fails");
    }
    let stranded = job_id::derive(Region::Us, "acme", "stranded-abandoned");
    assert_eq!(get(&mut client, US_KEY, &stranded).await.unwrap().state, JobState::Waiting as i32);
    // (a) The caller retries: the message is written and the same record carries on.
    let retried = submit(&mut client, US_KEY, "stranded-retried", &diff).await;
    assert_eq!(wait_final(&mut client, US_KEY, &retried.job_id).await.state, JobState::Published as i32);
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&retried.job_id), Some(&1));
    // (b) Nobody retries: past its grace the reconciler ends it `lost`.
    let clock = ManualClock::at(telemetry::now_ms());
    let (reconciler, jobs) = reconciler(&stack, clock.clone()).await;
    clock.advance(Duration::from_secs(120));
    let pass = reconciler.pass().await.unwrap();
    assert_eq!((pass.stranded, pass.ended), (1, 1), "{pass:?}");
    let (ended, _) = jobs.get(&stranded).await.unwrap().unwrap();
    assert_eq!(ended.reason, Some(TerminalReason::Lost));
    assert!(!stack.us.provider.stats().calls_by_job.contains_key(&stranded), "never called");
    stack.shutdown().await;
}

/// A reconciler on the US region's stores, driven by a test clock.
async fn reconciler(stack: &Stack, clock: std::sync::Arc<ManualClock>) -> (Reconciler, JobStore) {
    let s = crate::manual::stores(stack.us.nats.url(), Region::Us, clock.clone()).await;
    let metrics = Metrics::register(&mut Registry::default(), Region::Us);
    let jobs = s.jobs.clone();
    let r = Reconciler {
        layout: s.layout,
        jobs: s.jobs,
        results: s.results,
        clock,
        grace: Duration::from_secs(60),
        metrics,
    };
    (r, jobs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_ends_a_job_nothing_drives_and_resumes_one_whose_answer_was_kept() {
    // No extractor: nothing but the reconciler moves these records.
    let stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    let now = telemetry::now_ms();
    let clock = ManualClock::at(now);
    let (reconciler, jobs) = reconciler(&stack, clock.clone()).await;

    // A job whose lane message is gone: nothing can re-drive it.
    let lost = crate::manual::record("lost", now);
    jobs.create(&lost).await.unwrap();
    // A job whose holder kept its answer and died before recording it.
    let kept = crate::manual::record("kept", now);
    jobs.create(&kept).await.unwrap();
    let leased = jobs
        .apply(&kept.job_id, &Event::Leased { owner: "dead".into(), lease_expires_at_ms: now + 5_000 })
        .await
        .unwrap();
    let result = crate::manual::result(&kept, leased.generation());
    reconciler.results.keep(&result, &async_nats::HeaderMap::new()).await.unwrap();
    // A job still on its lane is left to the lane, however old.
    let mut client = stack.client().await;
    let queued = submit(&mut client, US_KEY, "queued", &sample_diff("queued")).await;

    assert_eq!(reconciler.pass().await.unwrap(), Pass::default(), "nothing is overdue yet");
    clock.advance(Duration::from_secs(120));
    assert_eq!(reconciler.pass().await.unwrap(), Pass { stranded: 2, resumed: 1, ended: 1 });

    let (lost_now, _) = jobs.get(&lost.job_id).await.unwrap().unwrap();
    assert_eq!(lost_now.reason, Some(TerminalReason::Lost));
    assert_eq!(wait_final(&mut client, US_KEY, &kept.job_id).await.state, JobState::Published as i32);
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&kept.job_id).len() == 1).await);
    assert_eq!(get(&mut client, US_KEY, &queued.job_id).await.unwrap().state, JobState::Waiting as i32);
    // A second pass finds nothing more to do.
    assert_eq!(reconciler.pass().await.unwrap(), Pass::default());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_meeting_a_full_store_is_unavailable_with_the_reason_and_counted() {
    use tonic_types::StatusExt;
    let stack = Stack::start().await;
    stack.faults().fail_full(point::INGRESS_RECORD, 1);
    let mut client = stack.client().await;
    let err = client.submit_review(submit_req(US_KEY, "full-submit", &sample_diff("full"))).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert_eq!(err.get_details_error_info().expect("ErrorInfo").reason, "REGION_STORE_FULL");
    assert!(err.get_details_retry_info().and_then(|r| r.retry_delay).is_some());
    let page = http_get(stack.ingress_admin, "/metrics").await;
    let full = |region: &str| {
        page.lines()
            .find(|l| {
                l.starts_with("reviewlane_store_refusals_total{")
                    && l.contains(&format!(r#"region="{region}""#))
                    && l.contains(r#"kind="full""#)
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    assert_eq!((full("us"), full("eu")), (Some(1.0), Some(0.0)), "{page}");
    // One region's full store leaves the ingress ready for the other's callers.
    assert_eq!(http_get(stack.ingress_admin, "/readyz").await, "ready\n");
    // The same request again once the store takes writes: accepted and reviewed.
    let job = submit(&mut client, US_KEY, "full-submit", &sample_diff("full")).await;
    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extractor_stopped_while_it_holds_an_unkept_answer_hands_the_job_to_another() {
    let mut stack =
        Stack::start_with(StackOptions { shutdown_grace: Duration::from_millis(500), ..Default::default() }).await;
    // The store refuses the keep as full for as long as the first replica lives.
    stack.faults().fail_full(point::EXTRACTOR_KEEP, 1_000_000);
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "keep-stopped", &sample_diff("stopped")).await;
    let paid = eventually(Duration::from_secs(10), || {
        stack.us.provider.stats().paid_by_job.contains_key(&job.job_id)
            && stack.faults().pending(point::EXTRACTOR_KEEP) < 1_000_000
    })
    .await;
    assert!(paid, "the answer was paid and its keep refused");
    // SIGTERM: past its grace the replica gives the job back instead of waiting on.
    let stopped = tokio::time::timeout(Duration::from_secs(10), stack.stop_extractors(Region::Us)).await;
    assert!(stopped.is_ok(), "the replica stopped within its grace");
    stack.faults().fail_full(point::EXTRACTOR_KEEP, 0);
    stack.start_extractor(Region::Us).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    // The price of the lost answer is at most a second paid call (none here when the
    // result cache, written beside the refused keep, took it), never a lost review.
    let paid = stack.us.provider.stats().paid_by_job.get(&job.job_id).copied();
    assert!(matches!(paid, Some(1 | 2)), "{paid:?}");
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    stack.shutdown().await;
}
