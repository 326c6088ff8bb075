//! The degraded-then-deeper pass: for a tenant with `deeper_pass`, a review admitted at
//! depth `changed_hunks` is followed by a full-depth review of the same diff through the
//! sweep path — the provider's batch API where the region has one, else the batch lane
//! — delivered once as its own review, its depth labelled and linked to the first.

use std::time::Duration;

use reviewlane_api::proto::{self, JobState, ReviewDepth};
use reviewlane_core::messages::Delivery;

use crate::harness::*;

const DELTA_KEY: &str = "rl-test-delta-deeper";

/// A tenant of the US region with the option, delivering to the test webhook.
fn delta() -> String {
    format!(
        "[[tenants]]\nid = \"delta\"\nregion = \"us\"\napi_key_sha256 = [\"{}\"]\nallow_private_webhook = true\ndeeper_pass = true\nsink = {{ kind = \"webhook\", url = \"{{webhook_url}}\", secret = \"{US_SECRET}\" }}\n",
        reviewlane_core::tenants::hash_api_key(DELTA_KEY),
    )
}

/// The slow interactive lane of the scheduling tests (one call at a time of 400 ms, a
/// 1 s window): a steady stream of submits is degraded within a few seconds.
async fn slow_lane(provider_batch: &str) -> Stack {
    Stack::start_with(StackOptions {
        extra_tenants: delta(),
        provider_batch: provider_batch.into(),
        ..crate::scheduling::slow_lane_options()
    })
    .await
}

async fn review(client: &mut Client, key: &str, id: &str) -> proto::Review {
    let req = authed(key, proto::GetReviewRequest { job_id: id.into() });
    client.get_review(req).await.unwrap().into_inner().review.unwrap()
}

type Client = reviewlane_api::proto::review_service_client::ReviewServiceClient<tonic::transport::Channel>;

fn delivery(stack: &Stack, job: &str) -> Delivery {
    let got = stack.webhook.for_job(job);
    assert_eq!(got.len(), 1, "delivered once");
    serde_json::from_slice(&got[0].body).expect("a delivery")
}

/// Submits reviews of `delta` and `acme` at a steady pace until each has one admitted
/// at `changed_hunks`: (delta's, its submit's idempotency key and diff; acme's).
async fn degraded_reviews(client: &mut Client) -> ((proto::Review, String, String), proto::Review) {
    let (mut delta, mut acme) = (None, None);
    for i in 0..80 {
        for (key, slot) in [(DELTA_KEY, 0), (US_KEY, 1)] {
            if (slot == 0 && delta.is_some()) || (slot == 1 && acme.is_some()) {
                continue;
            }
            let (idem, diff) = (format!("deep-{slot}-{i}"), sample_diff(&format!("deep{slot}x{i}")));
            let Ok(r) = client.submit_review(submit_req(key, &idem, &diff)).await else { continue };
            let r = r.into_inner().review.unwrap();
            if r.review_depth == ReviewDepth::ChangedHunks as i32 {
                if slot == 0 {
                    // A review that ends at admission (due before the predicted wait
                    // ends) names no deeper pass.
                    let mut due = submit_req(DELTA_KEY, &format!("due-{i}"), &sample_diff(&format!("due{i}")));
                    due.get_mut().timeout = Some(prost_types::Duration { seconds: 0, nanos: 200_000_000 });
                    let late = client.submit_review(due).await.unwrap().into_inner().review.unwrap();
                    assert_eq!(late.terminal_reason, "deadline_exceeded", "{late:?}");
                    assert!(late.deeper_review_id.is_empty(), "{late:?}");
                    delta = Some((r, idem, diff));
                } else {
                    acme = Some(r);
                }
            }
        }
        if let (Some(d), Some(a)) = (&delta, &acme) {
            return (d.clone(), a.clone());
        }
        // The pace of arrivals, not a wait for a condition.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    panic!("no degraded review of each tenant: delta {}, acme {}", delta.is_some(), acme.is_some());
}

/// Runs the pass with the extractors' `REVIEWLANE_PROVIDER_BATCH` = `provider_batch`;
/// `through_batches`: whether the deeper review is expected in a provider batch.
async fn a_degraded_review_is_followed_by_a_full_one(provider_batch: &str, through_batches: bool) {
    let stack = slow_lane(provider_batch).await;
    let mut client = stack.client().await;
    let ((first, idem, diff), other) = degraded_reviews(&mut client).await;

    // Named in the first answer, before the deeper review has run.
    let deeper_id = first.deeper_review_id.clone();
    assert!(!deeper_id.is_empty(), "the degraded review names its deeper pass: {first:?}");
    assert_ne!(deeper_id, first.job_id);
    // A same-key retry names the same one and queues nothing more.
    let again = client.submit_review(submit_req(DELTA_KEY, &idem, &diff)).await.unwrap().into_inner().review.unwrap();
    assert_eq!((again.job_id.as_str(), again.deeper_review_id.as_str()), (first.job_id.as_str(), deeper_id.as_str()));

    // Through provider batches its job exists once the coordinator takes it into a batch.
    let found = poll_until(Duration::from_secs(30), || {
        let (mut client, id) = (client.clone(), deeper_id.clone());
        async move { client.get_review(authed(DELTA_KEY, proto::GetReviewRequest { job_id: id })).await.ok() }
    })
    .await;
    assert!(found.is_some(), "the deeper review exists");
    let deeper = wait_final_within(&mut client, DELTA_KEY, &deeper_id, Duration::from_secs(90)).await;
    assert_eq!(deeper.state, JobState::Published as i32, "{deeper:?}");
    assert_eq!(deeper.review_depth, ReviewDepth::Full as i32, "the deeper pass is at full depth");
    assert_eq!(deeper.deeper_of, first.job_id, "linked to the first");
    assert_eq!(deeper.lane, proto::Lane::Batch as i32);
    assert!(!deeper.sweep_id.is_empty(), "run through the sweep path");
    let sweep = client
        .get_sweep(authed(DELTA_KEY, proto::GetSweepRequest { sweep_id: deeper.sweep_id.clone() }))
        .await
        .unwrap()
        .into_inner()
        .sweep
        .unwrap();
    let total: u64 = sweep.items.iter().map(|c| c.count).sum();
    assert_eq!(total, 1, "one item, the retry added none: {sweep:?}");
    let runs_on = if through_batches { proto::SweepMode::ProviderBatch } else { proto::SweepMode::Lanes };
    assert_eq!(sweep.runs_on, runs_on as i32);

    let first_done = wait_final_within(&mut client, DELTA_KEY, &first.job_id, Duration::from_secs(60)).await;
    assert_eq!(first_done.state, JobState::Published as i32);
    assert_eq!(first_done.review_depth, ReviewDepth::ChangedHunks as i32);
    assert_eq!(first_done.deeper_review_id, deeper_id);

    // Each delivered once as its own review, its depth labelled and the link carried.
    for job in [&deeper_id, &first.job_id] {
        assert!(stack.webhook.wait_for(job, Duration::from_secs(20)).await.is_some(), "delivered");
    }
    // Until deliveries stop for a while: a second copy of either would be in by then.
    stack.webhook.wait_count(usize::MAX, Duration::from_millis(700), Duration::from_secs(20)).await;
    let full = delivery(&stack, &deeper_id);
    assert_eq!(full.review_depth, reviewlane_core::job::ReviewDepth::Full);
    assert_eq!(full.deeper_of.as_deref(), Some(first.job_id.as_str()));
    assert_eq!(full.deeper_review, None);
    let degraded = delivery(&stack, &first.job_id);
    assert_eq!(degraded.review_depth, reviewlane_core::job::ReviewDepth::ChangedHunks);
    assert_eq!(degraded.deeper_review.as_deref(), Some(deeper_id.as_str()));
    assert_eq!(degraded.deeper_of, None);

    // Paid once, where it ran.
    let (lines, calls) = (stack.us.provider.batch_stats().paid_lines, stack.us.provider.stats().paid_by_job);
    let (in_batches, on_lanes) = (lines.get(&deeper_id).copied(), calls.get(&deeper_id).copied());
    if through_batches {
        assert_eq!((in_batches, on_lanes), (Some(1), None), "one batch line, no lane call");
    } else {
        assert_eq!((in_batches, on_lanes), (None, Some(1)), "one lane call");
    }

    // A tenant without the option gets no deeper pass.
    let other = review(&mut client, US_KEY, &other.job_id).await;
    assert_eq!(other.review_depth, ReviewDepth::ChangedHunks as i32);
    assert!(other.deeper_review_id.is_empty(), "{other:?}");
    let acme = client.list_sweeps(authed(US_KEY, proto::ListSweepsRequest::default())).await.unwrap().into_inner();
    assert!(acme.sweeps.is_empty(), "acme has no sweep: {acme:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degraded_review_is_followed_by_a_full_one_through_the_providers_batch_api() {
    a_degraded_review_is_followed_by_a_full_one("poll=50ms..200ms", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degraded_review_is_followed_by_a_full_one_through_the_batch_lane() {
    a_degraded_review_is_followed_by_a_full_one("off", false).await;
}
