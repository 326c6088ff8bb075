//! The load scenarios `lab`, `storm` and `dup`, small and correctness-only: every job
//! reaches a final state, none is lost, no paid call and no delivery happens twice.
//! Speed is measured by `cargo run --release -p loadtest -- <scenario>`, not here.

use loadtest::scenarios::{self, Overrides, Report, Scale, Scenario};

use crate::harness::*;

async fn run(s: Scenario) -> Report {
    let stack = Stack::start_with(scenarios::options(s, Scale::Ci)).await;
    let report = scenarios::run(s, Scale::Ci, Overrides::default(), &stack).await.expect("scenario runs");
    stack.shutdown().await;
    assert_eq!((report.lost, report.completed), (0, report.jobs), "{report:#?}");
    assert_eq!((report.duplicate_paid_calls, report.duplicate_deliveries), (0, 0), "{report:#?}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lab_answers_every_submit_and_pays_each_job_once() {
    let r = run(Scenario::Lab).await;
    assert_eq!(r.jobs, 10);
    assert_eq!(r.extra["answered"], 10);
    assert_eq!(r.extra["client_timeouts"], 0);
    assert_eq!(r.paid_calls, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_finishes_every_job_through_429s_with_one_paid_call_each() {
    let r = run(Scenario::Storm).await;
    assert_eq!(r.jobs, 10);
    assert_eq!(r.paid_calls, 10);
    assert_eq!(r.extra["terminal"], serde_json::json!({}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dup_creates_one_job_per_key_and_pays_once_per_job() {
    let r = run(Scenario::Dup).await;
    assert_eq!(r.extra["submits"], 40);
    assert_eq!(r.extra["jobs_created"], 11);
    assert_eq!((r.jobs, r.paid_calls), (11, 11));
}
