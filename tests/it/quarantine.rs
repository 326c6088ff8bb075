use std::time::Duration;

use reviewlane_api::proto::JobState;
use reviewlane_core::messages::Delivery;
use reviewlane_testkit::simprovider::SimConfig;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn findings_outside_the_diff_are_quarantined_and_the_rest_delivered() {
    let stack = Stack::start_with(StackOptions {
        us_provider: SimConfig { outside_diff: true, ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "q-1", &sample_diff("q")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{}", last.terminal_reason);
    // The simulated provider answered one valid finding plus one on a path outside the
    // diff and one on a line outside every hunk.
    assert_eq!(last.quarantined_count, 2);
    assert_eq!(last.findings.len(), 1);
    assert_eq!(last.findings[0].path, "src/handler.rs");

    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    let d: Delivery = serde_json::from_slice(&stack.webhook.for_job(&job.job_id)[0].body).unwrap();
    assert_eq!(d.quarantined_count, 2);
    assert_eq!(d.findings.len(), 1);
    let body = String::from_utf8(stack.webhook.for_job(&job.job_id)[0].body.to_vec()).unwrap();
    assert!(!body.contains("not/in/the/diff.rs"), "a quarantined finding was delivered");
    assert!(!body.contains("999999"), "a quarantined finding was delivered");
    stack.shutdown().await;
}
