use std::time::Duration;

use hmac::{Hmac, Mac};
use reviewlane_api::proto::{JobState, ReviewDepth};
use reviewlane_core::messages::Delivery;
use reviewlane_core::region::Region;
use sha2::Sha256;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_delivers_findings_once_signed_and_get_shows_published() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;

    let submitted =
        client.submit_review(submit_req(US_KEY, "pipeline-1", &sample_diff("p1"))).await.unwrap().into_inner();
    let review = submitted.review.unwrap();
    assert!(review.job_id.starts_with("us_"), "{}", review.job_id);
    assert_eq!(review.region, "us");
    assert!(matches!(
        JobState::try_from(review.state).unwrap(),
        JobState::Waiting | JobState::Running | JobState::Accepted
    ));

    let last = wait_final(&mut client, US_KEY, &review.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "terminal reason: {}", last.terminal_reason);

    // Exactly one delivery, once the publisher has settled every message (no second
    // one can come after that).
    assert!(eventually(Duration::from_secs(5), || !stack.webhook.for_job(&review.job_id).is_empty()).await);
    publisher_settled(&stack, Region::Us).await;
    let got = stack.webhook.for_job(&review.job_id);
    assert_eq!(got.len(), 1, "delivered exactly once");

    // The signature verifies with the tenant's secret and fails with another.
    let d = &got[0];
    // Signed over a timestamp and the body: a receiver can reject late replays.
    let sig = d.signature.as_deref().expect("signature header");
    let (t, v1) = sig.split_once(',').unwrap();
    let t: u64 = t.strip_prefix("t=").unwrap().parse().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(now.abs_diff(t) < 60, "timestamp is the delivery time");
    let v1 = hex::decode(v1.strip_prefix("v1=").unwrap()).unwrap();
    let signed = [format!("{t}.").as_bytes(), &d.body[..]].concat();
    let mut mac = Hmac::<Sha256>::new_from_slice(US_SECRET.as_bytes()).unwrap();
    mac.update(&signed);
    mac.verify_slice(&v1).expect("signature verifies");
    let mut wrong = Hmac::<Sha256>::new_from_slice(EU_SECRET.as_bytes()).unwrap();
    wrong.update(&signed);
    assert!(wrong.verify_slice(&v1).is_err());

    let delivery: Delivery = serde_json::from_slice(&d.body).unwrap();
    assert_eq!(delivery.job_id, review.job_id);
    assert_eq!(delivery.tenant, "acme");
    assert!(!delivery.findings.is_empty());

    // GetReview shows the same findings.
    let got = get(&mut client, US_KEY, &review.job_id).await.unwrap();
    assert_eq!(got.state, JobState::Published as i32);
    assert_eq!(got.review_depth, ReviewDepth::Full as i32);
    assert_eq!(got.findings.len(), delivery.findings.len());
    assert_eq!(got.findings[0].path, delivery.findings[0].path);
    assert_eq!(got.findings[0].line, delivery.findings[0].line);
    assert_eq!(got.findings[0].evidence, delivery.findings[0].evidence);
    assert_eq!(got.attempts.unwrap().congestion, 0);

    // One paid provider call for the job.
    assert_eq!(stack.us.provider.stats().paid_by_job.get(&review.job_id), Some(&1));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_state_changes_until_final() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let review = submit(&mut client, EU_KEY, "watch-1", &sample_diff("w1")).await;
    let mut stream = client
        .watch_review(authed(EU_KEY, reviewlane_api::proto::WatchReviewRequest { job_id: review.job_id.clone() }))
        .await
        .unwrap()
        .into_inner();
    let mut states = Vec::new();
    let collect = async {
        while let Some(m) = stream.message().await.unwrap() {
            states.push(m.review.unwrap().state);
        }
    };
    tokio::time::timeout(Duration::from_secs(30), collect).await.expect("watch ends after the final state");
    assert_eq!(*states.last().unwrap(), JobState::Published as i32, "{states:?}");
    // States only move forward.
    let mut sorted = states.clone();
    sorted.sort();
    assert_eq!(states, sorted);
    stack.shutdown().await;
}

/// An idle lane's long-poll must not hold the capacity another lane needs: with one
/// call slot, interactive work is served at once, not after the batch lane's 5 s poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_lane_does_not_park_the_only_slot() {
    let stack = Stack::start_with(StackOptions { extractor_concurrency: 1, ..Default::default() }).await;
    let mut client = stack.client().await;
    // Both lanes' pull loops in their long-poll.
    lanes_polling(&stack, Region::Us, "acme").await;
    for i in 0..3 {
        let started = std::time::Instant::now();
        let job = submit(&mut client, US_KEY, &format!("slot-{i}"), &sample_diff(&format!("s{i}"))).await;
        assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
        // The pull long-poll is 5 s; a parked slot shows up as a wait of about that long.
        assert!(started.elapsed() < Duration::from_secs(3), "job {i} took {:?}", started.elapsed());
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn findings_on_a_git_quoted_non_ascii_path_are_delivered_under_the_real_path() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    // What `git diff` writes for `src/über.rs` with `core.quotePath` on.
    let diff = "diff --git \"a/src/\\303\\274ber.rs\" \"b/src/\\303\\274ber.rs\"\nindex 1111111..2222222 100644\n--- \"a/src/\\303\\274ber.rs\"\n+++ \"b/src/\\303\\274ber.rs\"\n@@ -1,2 +1,3 @@\n fn main() {\n+    let v = load().unwrap();\n }\n";
    let job = submit(&mut client, US_KEY, "quoted-path", diff).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32);
    let paths: Vec<&str> = last.findings.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["src/über.rs"], "{last:?}");
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    let d: Delivery = serde_json::from_slice(&stack.webhook.for_job(&job.job_id)[0].body).unwrap();
    assert_eq!(d.findings[0].path, "src/über.rs");
    stack.shutdown().await;
}
