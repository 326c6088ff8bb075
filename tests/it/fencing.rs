//! Leases that fence, with real processes: an extractor frozen (SIGSTOP) in the middle
//! of a provider call past its lease loses the job to another replica; thawed, its late
//! answer is neither recorded nor published, and it is counted.

use std::time::Duration;

use reviewlane_api::proto::JobState;
use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_core::job::JobRecord;
use reviewlane_core::region::Region;
use reviewlane_shared::layout;
use reviewlane_testkit::procs::{ProcStack, ensure_built, ensure_nats_server};
use reviewlane_testkit::simprovider::SimConfig;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_lease_cannot_record_or_publish_its_late_answer() {
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    let stack = ProcStack::start(StackOptions {
        extractors: 2,
        lease: Duration::from_secs(1),
        us_provider: SimConfig { latency: Duration::from_millis(2500), ..Default::default() },
        ..Default::default()
    })
    .await
    .expect("stack starts");
    let mut client = ReviewServiceClient::connect(format!("http://{}", stack.ingress)).await.unwrap();
    let job = submit(&mut client, US_KEY, "frozen", &sample_diff("frozen")).await;

    // Freeze whichever replica took the job, while its call runs.
    assert!(
        eventually(Duration::from_secs(10), || stack.us.provider.stats().calls_by_job.contains_key(&job.job_id)).await
    );
    let first_key = stack.us.provider.stats().call_times_by_key.keys().next().cloned().expect("a caller");
    let (frozen, other) = match first_key.as_str() {
        "sk-load-0" => ("extractor-us", "extractor-us-1"),
        "sk-load-1" => ("extractor-us-1", "extractor-us"),
        k => panic!("unexpected caller {k}"),
    };
    stack.service(frozen).unwrap().signal("STOP").unwrap();

    // The other replica takes the job over once the lease ran out, and publishes it.
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32);
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&job.job_id).len() == 1).await);

    // Thawed, the first holder finds its lease taken: its answer is discarded, counted.
    stack.service(frozen).unwrap().signal("CONT").unwrap();
    let admin = stack.admin_of(frozen).unwrap();
    let stale = poll_until(Duration::from_secs(15), || async {
        (metric_sum(&http_get(admin, "/metrics").await, "reviewlane_stale_results_total") >= 1.0).then_some(())
    });
    assert!(stale.await.is_some(), "late answer not counted as stale");
    let other_page = http_get(stack.admin_of(other).unwrap(), "/metrics").await;
    assert_eq!(metric_sum(&other_page, "reviewlane_stale_results_total"), 0.0);

    // One publication; the record names the second holder's lease as its only owner.
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1, "the late answer was delivered");
    assert_eq!(get(&mut client, US_KEY, &job.job_id).await.unwrap().state, JobState::Published as i32);
    let js = async_nats::jetstream::new(async_nats::connect(stack.us.nats.url()).await.unwrap());
    let jobs = js.get_key_value(layout::jobs_bucket(Region::Us)).await.unwrap();
    let rec: JobRecord = serde_json::from_slice(&jobs.get(&job.job_id).await.unwrap().unwrap()).unwrap();
    assert_eq!(rec.generation(), 2, "{rec:?}");
    assert!(rec.owner.is_some());
    // Both calls were made (the first could not be known to come back), one was used.
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&job.job_id), Some(&2));
    let codes = stack.shutdown();
    assert!(codes.values().all(|c| *c == Some(0)), "{codes:?}");
}
