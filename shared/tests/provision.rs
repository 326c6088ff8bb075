//! `reviewlane-admin provision` against a real nats-server: it creates the layout with
//! the configured retention, corrects a stream or bucket whose limits drifted, and
//! reports (exit 65) what NATS cannot change in place.

use std::process::{Command, Output};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use reviewlane_shared::Region;
use reviewlane_shared::layout::{self, LayoutConfig};
use reviewlane_shared::testing::NatsServer;

fn provision(url: &str, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_reviewlane-admin"));
    cmd.args(["provision", "--region", "us", "--nats-url", url]);
    // Only the variables the test sets.
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("REVIEWLANE_")) {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("reviewlane-admin runs")
}

async fn config_of(js: &jetstream::Context, name: &str) -> stream::Config {
    js.get_stream(name).await.unwrap().info().await.unwrap().config.clone()
}

#[tokio::test]
async fn provision_creates_the_configured_layout_and_reconciles_drift() {
    let nats = NatsServer::start();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());

    // First run: everything created with the configured retention.
    let out =
        provision(nats.url(), &[("REVIEWLANE_JOBS_MAX_AGE_SECS", "864000"), ("REVIEWLANE_LANE_MAX_BYTES", "1048576")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("created REVIEWS_US_INTERACTIVE") && stdout.contains("created KV_JOBS_US"), "{stdout}");
    assert_eq!(config_of(&js, "KV_JOBS_US").await.max_age, Duration::from_secs(864_000));
    let lane = config_of(&js, "REVIEWS_US_INTERACTIVE").await;
    assert_eq!((lane.max_bytes, lane.max_age), (1_048_576, LayoutConfig::default().lane_max_age));
    assert_eq!(
        config_of(&js, "DEADLETTER_CONTENT_US").await.max_age,
        LayoutConfig::default().deadletter_content_max_age
    );

    // Someone changed limits by hand, and the config changed too: a second run puts
    // every stream back in line with the config and says what it changed.
    let mut findings = config_of(&js, "FINDINGS_US").await;
    findings.max_age = Duration::from_secs(3600);
    js.update_stream(&findings).await.unwrap();
    let out =
        provision(nats.url(), &[("REVIEWLANE_JOBS_MAX_AGE_SECS", "1728000"), ("REVIEWLANE_LANE_MAX_BYTES", "1048576")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("updated FINDINGS_US max_age"), "{stdout}");
    assert!(stdout.contains("updated KV_JOBS_US max_age"), "{stdout}");
    assert_eq!(config_of(&js, "FINDINGS_US").await.max_age, LayoutConfig::default().findings_max_age);
    assert_eq!(config_of(&js, "KV_JOBS_US").await.max_age, Duration::from_secs(1_728_000));

    // In line now: a third run changes nothing.
    let out =
        provision(nats.url(), &[("REVIEWLANE_JOBS_MAX_AGE_SECS", "1728000"), ("REVIEWLANE_LANE_MAX_BYTES", "1048576")]);
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("updated"));

    // A bad config never reaches the server.
    let out = provision(nats.url(), &[("REVIEWLANE_DEADLETTER_CONTENT_MAX_AGE_SECS", "99999999")]);
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test]
async fn provision_reports_drift_nats_cannot_change_and_exits_65() {
    let nats = NatsServer::start();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    // A dead-letter stream made by hand in memory: its storage cannot change in place.
    js.create_stream(stream::Config {
        name: layout::deadletter_stream(Region::Us),
        subjects: vec!["deadletter.us.>".into()],
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    let out = provision(nats.url(), &[]);
    assert_eq!(out.status.code(), Some(65), "{}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("drift DEADLETTER_US storage: is Memory, config wants File"), "{stderr}");
    // What it could change, it did (the retention age), and everything else exists.
    assert_eq!(config_of(&js, "DEADLETTER_US").await.max_age, LayoutConfig::default().deadletter_max_age);
    assert!(layout::stream_exists(&js, "KV_JOBS_US").await.unwrap());
}
