//! Deadlines: a review not published by its caller's deadline ends `deadline_exceeded`
//! — at admission, while queued, between retries (never paying for a call that cannot
//! finish in time), or by abandoning a call in flight.

use std::time::{Duration, SystemTime};

use reviewlane_api::proto::{JobState, SubmitReviewRequest};
use reviewlane_core::region::{Lane, Region};
use reviewlane_shared::layout;
use reviewlane_testkit::simprovider::SimConfig;
use tonic::Code;

use crate::harness::*;

fn with_timeout(idem: &str, timeout: Duration) -> tonic::Request<SubmitReviewRequest> {
    let mut req = submit_req(US_KEY, idem, &sample_diff(idem));
    req.get_mut().timeout = Some(prost_types_duration(timeout));
    req
}

fn prost_types_duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(d).unwrap()
}

fn assert_ended_late(r: &reviewlane_api::proto::Review) {
    assert_eq!((r.state, r.terminal_reason.as_str()), (JobState::Terminal as i32, "deadline_exceeded"), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_already_past_ends_the_job_at_admission_and_keeps_nothing() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let mut req = submit_req(US_KEY, "past", &sample_diff("past"));
    req.get_mut().deadline = Some(prost_types::Timestamp::from(SystemTime::now() - Duration::from_secs(1)));
    let r = client.submit_review(req).await.unwrap().into_inner().review.unwrap();
    assert_ended_late(&r);
    assert!(r.deadline.is_some());
    let url = stack.us.nats.url().to_string();
    assert!(stream_messages(&url, &layout::lane_stream(Region::Us, Lane::Interactive)).await.is_empty());
    assert_eq!(stack.us.provider.stats().total_calls, 0);

    // Both forms, or a negative timeout: the caller's error.
    let mut both = submit_req(US_KEY, "both", &sample_diff("both"));
    both.get_mut().deadline = Some(prost_types::Timestamp::from(SystemTime::now() + Duration::from_secs(60)));
    both.get_mut().timeout = Some(prost_types_duration(Duration::from_secs(60)));
    assert_eq!(client.submit_review(both).await.unwrap_err().code(), Code::InvalidArgument);
    let mut negative = submit_req(US_KEY, "negative", &sample_diff("negative"));
    negative.get_mut().timeout = Some(prost_types::Duration { seconds: -5, nanos: 0 });
    assert_eq!(client.submit_review(negative).await.unwrap_err().code(), Code::InvalidArgument);

    // Without either, the lane's default applies and is shown.
    let r = submit(&mut client, US_KEY, "default", &sample_diff("default")).await;
    let deadline = r.deadline.expect("the lane's default deadline");
    let ahead = deadline.seconds - r.created_at.unwrap().seconds;
    assert!((899..=901).contains(&ahead), "interactive default is 15 min, got {ahead} s");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_that_passes_while_queued_ends_the_job_without_a_call() {
    // The ingress's clock is a minute behind: a review given 300 ms is admitted by its
    // time and already late by the extractor's, as if it had waited on the lane past
    // its deadline while no extractor ran.
    let behind = reviewlane_core::clock::ManualClock::at(reviewlane_core::clock::now_ms() - 60_000);
    let mut stack =
        Stack::start_with(StackOptions { extractors: 0, ingress_clock: Some(behind), ..Default::default() }).await;
    let mut client = stack.client().await;
    let job = client.submit_review(with_timeout("queued", Duration::from_millis(300))).await.unwrap().into_inner();
    let job = job.review.unwrap();
    let deadline = job.deadline.unwrap();
    let until = SystemTime::UNIX_EPOCH + Duration::new(deadline.seconds as u64, deadline.nanos as u32);
    assert!(until < SystemTime::now(), "the deadline was set by the ingress's clock");
    stack.start_extractor(Region::Us).await;
    assert_ended_late(&wait_final(&mut client, US_KEY, &job.job_id).await);
    assert_eq!(stack.us.provider.stats().total_calls, 0, "no call for a job already late");
    assert!(stack.webhook.for_job(&job.job_id).is_empty());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_flight_at_the_deadline_is_abandoned() {
    let stack = Stack::start_with(StackOptions {
        us_provider: SimConfig { latency: Duration::from_secs(4), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let started = std::time::Instant::now();
    let job = client.submit_review(with_timeout("in-flight", Duration::from_secs(1))).await.unwrap().into_inner();
    let id = job.review.unwrap().job_id;
    assert_ended_late(&wait_final(&mut client, US_KEY, &id).await);
    assert!(started.elapsed() < Duration::from_secs(3), "ended at the deadline, not when the 4 s answer came");
    assert!(eventually(Duration::from_secs(2), || stack.us.provider.in_flight() == 0).await, "call not abandoned");
    assert!(!stack.us.provider.stats().paid_by_job.contains_key(&id), "nothing paid");
    assert!(stack.webhook.for_job(&id).is_empty());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_could_only_start_after_the_deadline_is_not_scheduled() {
    let stack = Stack::start().await;
    // Every call answered 429 with `retry-after: 30`, past a 2 s deadline.
    stack.us.provider.set_throttled(Some(30));
    let mut client = stack.client().await;
    let started = std::time::Instant::now();
    let job = client.submit_review(with_timeout("retry-late", Duration::from_secs(2))).await.unwrap().into_inner();
    let id = job.review.unwrap().job_id;
    let last = wait_final(&mut client, US_KEY, &id).await;
    assert_ended_late(&last);
    assert!(started.elapsed() < Duration::from_secs(2), "ended at the 429, not at the deadline");
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&id), Some(&1), "one call, no retry");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn findings_that_reach_the_deadline_undelivered_are_not_delivered_late() {
    let stack = Stack::start().await;
    // The sink fails every delivery for a while; the publisher retries (100 ms doubling).
    stack.webhook.answer_with([500; 30]);
    let mut client = stack.client().await;
    let job = client.submit_review(with_timeout("late-delivery", Duration::from_secs(1))).await.unwrap().into_inner();
    let id = job.review.unwrap().job_id;
    let last = wait_final(&mut client, US_KEY, &id).await;
    assert_ended_late(&last);
    assert_eq!(stack.us.provider.stats().paid_by_job.get(&id), Some(&1), "the answer was paid and kept");
    assert!(stack.webhook.for_job(&id).is_empty(), "nothing delivered after the deadline");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_that_passes_while_the_key_is_paused_ends_the_job_at_the_deadline() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    // A 429 with `retry-after: 30` pauses the key for 30 s.
    stack.us.provider.set_throttled(Some(30));
    let first = submit(&mut client, US_KEY, "pauses", &sample_diff("pauses")).await;
    let paused = poll_until(Duration::from_secs(10), || async {
        let r = get(&mut stack.client().await, US_KEY, &first.job_id).await.ok()?;
        (r.state == JobState::RetryScheduled as i32).then_some(r)
    })
    .await;
    assert!(paused.is_some(), "the first review met the 429");
    stack.us.provider.set_throttled(None);

    // A review with a 2 s deadline, submitted while the key is paused, ends at its
    // deadline — not when the pause ends — and without a call.
    let started = std::time::Instant::now();
    let job = client.submit_review(with_timeout("late-while-paused", Duration::from_secs(2))).await.unwrap();
    let id = job.into_inner().review.unwrap().job_id;
    let last = wait_final_within(&mut client, US_KEY, &id, Duration::from_secs(20)).await;
    assert_ended_late(&last);
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(6), "ended after {took:?}");
    assert!(!stack.us.provider.stats().calls_by_job.contains_key(&id), "no call for it");
    // Its review is a dead letter like any other late job.
    let dead = poll_until(Duration::from_secs(10), || async {
        let url = stack.us.nats.url().to_string();
        let refs = stream_messages(&url, &layout::deadletter_stream(Region::Us)).await;
        refs.iter().any(|(_, _, m)| String::from_utf8_lossy(m).contains(&id)).then_some(())
    })
    .await;
    assert!(dead.is_some(), "dead-lettered");
    // The paused review is still waiting out its retry.
    assert_eq!(get(&mut client, US_KEY, &first.job_id).await.unwrap().state, JobState::RetryScheduled as i32);
    stack.shutdown().await;
}
