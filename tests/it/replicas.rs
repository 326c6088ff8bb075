//! A fleet of extractor processes sharing one provider key: within the key's limit
//! whatever the number of replicas, a dead replica's share taken over, both tenants
//! served. The figures: `cargo run --release -p loadtest -- replicas`.

use loadtest::replicas::{self, ReplicasConfig};
use reviewlane_testkit::procs::{ProcStack, ensure_built, ensure_nats_server};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_and_two_tenants_stay_within_one_key_through_a_kill_and_a_start() {
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    let cfg = ReplicasConfig::small();
    let mut stack = ProcStack::start(cfg.options()).await.expect("stack starts");
    let report = replicas::run(&mut stack, &cfg).await.expect("scenario runs");
    let _ = stack.shutdown();
    replicas::print(&report);
    assert_eq!((report.lost, report.published), (0, report.jobs), "{report:#?}");
    assert_eq!(report.paid_twice, 0, "{report:#?}");
    // The fleet stays within the key's limit: under 5% of calls answered 429 (the
    // target), on a machine whose scheduling delays heartbeats now and then.
    assert!(report.calls_429 * 20 < report.provider_calls, "{report:#?}");
    assert_eq!(report.published_by_tenant.values().copied().collect::<Vec<_>>(), [cfg.jobs / 2; 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_extractor_processes_on_one_key_draw_from_one_token_bucket() {
    use reviewlane_api::proto::JobState;
    use reviewlane_api::proto::review_service_client::ReviewServiceClient;
    use reviewlane_core::meter::Dimension;
    use reviewlane_testkit::simmeter::SimLimits;
    use reviewlane_testkit::simprovider::SimConfig;
    use reviewlane_testkit::stack::{StackOptions, US_KEY, sample_diff, submit, wait_final_within};
    use std::time::Duration;
    // The account allows 24,000 tokens a minute and each call is charged about 4,800
    // (its prompt and the 4,096-token output limit, at start): five calls at once, then
    // one every 12 s. Both processes are told the same budget; drawing from one bucket
    // in QUOTA_US, the pair never sends what the account would refuse. With a bucket
    // each, they would send ten at once and be answered 429.
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    let sim = SimConfig {
        latency: Duration::from_millis(200),
        limits: Some(SimLimits::openai(None, Some(24_000))),
        ..Default::default()
    };
    let stack = ProcStack::start(StackOptions {
        extractors: 2,
        us_provider: sim,
        key_budgets: vec![(Dimension::Tokens, 24_000)],
        heartbeat: Duration::from_millis(500),
        ..Default::default()
    })
    .await
    .expect("stack starts");
    let mut client = ReviewServiceClient::connect(format!("http://{}", stack.ingress)).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..7 {
        ids.push(
            submit(&mut client, US_KEY, &format!("bucket-{i}"), &sample_diff(&format!("bucket {i}"))).await.job_id,
        );
    }
    for id in &ids {
        let done = wait_final_within(&mut client, US_KEY, id, Duration::from_secs(90)).await;
        assert_eq!(done.state, JobState::Published as i32, "{id}: {done:?}");
    }
    let stats = stack.us.provider.stats();
    let _ = stack.shutdown();
    assert_eq!(stats.calls_429, 0, "{} calls, {} answered 429", stats.total_calls, stats.calls_429);
    assert_eq!(stats.paid_calls.len(), 7);
    // Both processes called.
    let keys: std::collections::BTreeSet<_> = stats.paid_calls.iter().map(|c| c.key.clone()).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
}
