//! Publish once, for real: delivery claims (on the job record) that expire, the delivery
//! budget counted in
//! deliveries, redirects not followed, private targets refused, and both orders of a
//! cancel racing a delivery.

use std::time::{Duration, Instant};

use reviewlane_api::proto::JobState;
use reviewlane_core::clock;
use reviewlane_core::job::{Event, JobState as State};
use reviewlane_core::region::Region;
use reviewlane_shared::telemetry::now_ms;

use crate::harness::*;
use crate::manual;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_a_failed_delivery_and_is_never_followed() {
    let stack = Stack::start().await;
    stack.webhook.answer_with([302]);
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "redirected", &sample_diff("redirect")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "delivery_rejected"));
    let attempts = stack.webhook.attempts_for(&job.job_id);
    assert_eq!(attempts.len(), 1, "no request followed the redirect: {attempts:?}");
    assert_eq!((attempts[0].method.as_str(), attempts[0].status), ("POST", 302));
    assert!(stack.webhook.for_job(&job.job_id).is_empty());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loopback_webhook_is_refused_for_a_tenant_not_allowed_to_use_it() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let job = submit(&mut client, STRICT_KEY, "strict", &sample_diff("strict")).await;
    let last = wait_final(&mut client, STRICT_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "delivery_rejected"));
    assert!(stack.webhook.attempts_for(&job.job_id).is_empty(), "nothing was sent");
    // The same receiver takes deliveries of a tenant that allows private targets.
    let allowed = submit(&mut client, US_KEY, "allowed", &sample_diff("allowed")).await;
    assert_eq!(wait_final(&mut client, US_KEY, &allowed.job_id).await.state, JobState::Published as i32);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delivery_budget_counts_deliveries_tried() {
    let stack = Stack::start().await;
    stack.webhook.answer_with([503; 20]);
    let mut client = stack.client().await;
    let job = submit(&mut client, EU_KEY, "budget", &sample_diff("budget")).await;
    let last = wait_final(&mut client, EU_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "delivery_budget_exhausted"));
    // The publisher's default budget: 8 deliveries, each one a request.
    assert_eq!(stack.webhook.attempts_for(&job.job_id).len(), 8);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_that_died_after_claiming_is_taken_over_once_its_claim_expires() {
    // No extractor: the job is made validated by hand, its claim held by a dead publisher.
    let stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    let s = manual::stores(stack.us.nats.url(), Region::Us, clock::system()).await;
    let now = now_ms();
    let (rec, g) = manual::validated(&s, "claimed", now).await;
    let dead = Event::Delivering { owner: "dead".into(), expires_at_ms: now + 2_000 };
    s.jobs.apply(&rec.job_id, &dead).await.unwrap();
    let claimed_at = Instant::now();
    s.results.keep(&manual::result(&rec, g), &async_nats::HeaderMap::new()).await.unwrap();

    assert!(
        eventually(Duration::from_secs(15), || stack.webhook.for_job(&rec.job_id).len() == 1).await,
        "never taken over"
    );
    let delivered_at = stack.webhook.for_job(&rec.job_id)[0].at;
    assert!(delivered_at >= claimed_at + Duration::from_millis(1_900), "taken over before the claim expired");
    // The job is recorded published just after the receiver's 2xx: wait for it.
    let published = poll_until(Duration::from_secs(5), || async {
        let (found, _) = s.jobs.get(&rec.job_id).await.ok()??;
        (found.state == State::Published).then_some(found)
    });
    let claim = published.await.expect("the job is recorded published").delivery.expect("claimed on the record");
    assert_eq!(claim.attempts, 2, "the dead publisher's attempt is counted");
    assert_ne!(claim.owner, "dead");
    let mut client = stack.client().await;
    assert_eq!(wait_final(&mut client, US_KEY, &rec.job_id).await.state, JobState::Published as i32);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_before_the_delivery_is_claimed_wins() {
    let stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    let s = manual::stores(stack.us.nats.url(), Region::Us, clock::system()).await;
    let now = now_ms();
    let (rec, g) = manual::validated(&s, "cancel-first", now).await;

    let mut client = stack.client().await;
    let cancelled = cancel(&mut client, US_KEY, &rec.job_id).await;
    assert_eq!((cancelled.state, cancelled.terminal_reason.as_str()), (JobState::Terminal as i32, "cancelled"));
    // The result reaches the publisher only now: it delivers nothing.
    s.results.keep(&manual::result(&rec, g), &async_nats::HeaderMap::new()).await.unwrap();
    // The publisher claims nothing for a cancelled job: wait until its consumer settled it.
    publisher_settled(&stack, Region::Us).await;
    assert!(stack.webhook.attempts_for(&rec.job_id).is_empty(), "a cancelled job was delivered");
    let (found, _) = s.jobs.get(&rec.job_id).await.unwrap().unwrap();
    assert_eq!((found.delivery, found.delivery_started_at_ms), (None, None), "no claim for a cancelled job");
    assert_eq!(get(&mut client, US_KEY, &rec.job_id).await.unwrap().terminal_reason, "cancelled");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_the_delivery_is_claimed_is_too_late_and_the_job_is_published() {
    let stack = Stack::start().await;
    let arrived = stack.webhook.hold_next(Duration::from_millis(1_500));
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "cancel-late", &sample_diff("late")).await;
    tokio::time::timeout(Duration::from_secs(15), arrived.notified()).await.expect("delivery in flight");
    let answer = cancel(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(answer.state, JobState::Validated as i32, "the cancel answers the state as it stands");
    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1);
    stack.shutdown().await;
}
