use reviewlane_api::proto::JobState;
use tonic::Code;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_three_times_is_one_job_and_one_provider_call() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let diff = sample_diff("idem");
    let mut ids = Vec::new();
    for _ in 0..3 {
        let r = submit(&mut client, US_KEY, "idem-key", &diff).await;
        ids.push(r.job_id);
    }
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
    let last = wait_final(&mut client, US_KEY, &ids[0]).await;
    assert_eq!(last.state, JobState::Published as i32);

    // A fourth submit after completion returns the finished job, findings and all.
    let again = submit(&mut client, US_KEY, "idem-key", &diff).await;
    assert_eq!(again.job_id, ids[0]);
    assert_eq!(again.state, JobState::Published as i32);
    assert!(!last.findings.is_empty());
    assert_eq!(again.findings, last.findings, "the repeat's answer is the job as it is");

    let stats = stack.us.provider.stats();
    assert_eq!(stats.calls_by_job.get(&ids[0]), Some(&1), "{stats:?}");
    assert_eq!(stats.total_calls, 1);
    assert_eq!(stack.webhook.for_job(&ids[0]).len(), 1);

    // Same key, different diff: refused, and nothing changes.
    let err = client.submit_review(submit_req(US_KEY, "idem-key", &sample_diff("other"))).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    // The same key from another tenant is another job.
    let other = submit(&mut client, US2_KEY, "idem-key", &diff).await;
    assert_ne!(other.job_id, ids[0]);
    stack.shutdown().await;
}
