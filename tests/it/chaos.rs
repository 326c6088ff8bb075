//! The chaos scenario, small: service processes killed (-9) and restarted at random, an
//! extractor frozen past its lease, a nats-server killed and restarted — under load.
//! Faults cost time, never jobs. The full run: `cargo run --release -p loadtest -- chaos`.

use loadtest::chaos::{self, ChaosConfig};
use reviewlane_testkit::procs::{ProcStack, ensure_built, ensure_nats_server};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_cost_time_never_jobs() {
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    let cfg = ChaosConfig::small();
    let mut stack = ProcStack::start(cfg.options()).await.expect("stack starts");
    let report = chaos::run(&mut stack, &cfg).await.expect("chaos runs");
    if !report.correct() {
        stack.keep_logs();
    }
    let logs = stack.log_dir().display().to_string();
    let _ = stack.shutdown();
    chaos::print(&report);
    let kinds: std::collections::BTreeSet<&str> = report.faults.iter().map(|f| f.kind).collect();
    assert_eq!(kinds, ["kill9", "nats_restart", "sigstop"].into(), "{report:#?}");
    assert_eq!(report.accepted, cfg.jobs, "{report:#?}");
    assert_eq!((report.lost, report.stranded), (0, 0), "{report:#?}\nlogs: {logs}");
    assert_eq!(report.published, cfg.jobs, "{report:#?}");
    assert_eq!(report.paid_twice, 0, "{report:#?}");
}
