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
    assert_eq!(report.published_by_tenant.values().copied().collect::<Vec<_>>(), [cfg.jobs_per_tenant; 2]);
}
