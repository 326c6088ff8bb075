//! The wiring check through the real binary: an extractor configured for one region and
//! pointed at another region's NATS refuses to start, naming both, with a non-zero exit.

use std::process::Command;
use std::time::Duration;

use reviewlane_shared::Region;
use reviewlane_shared::testing::NatsServer;

fn run_extractor(region: &str, url: &str) -> std::process::Output {
    let tenants = std::env::temp_dir().join(format!("reviewlane-wiring-{}.toml", std::process::id()));
    std::fs::write(&tenants, "[[tenants]]\nid = \"t\"\nregion = \"us\"\n").expect("write tenants");
    let mut child = Command::new(env!("CARGO_BIN_EXE_reviewlane-extractor"))
        .env_clear()
        .env("REVIEWLANE_REGION", region)
        .env("REVIEWLANE_NATS_URL", url)
        .env("REVIEWLANE_TENANTS_FILE", &tenants)
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start extractor");
    // It must exit by itself; a process still running after 20 s is a failure.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("extractor did not exit");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

#[tokio::test]
async fn extractor_for_us_pointed_at_the_eu_server_refuses_to_start() {
    let eu = NatsServer::start_provisioned(Region::Eu).await;
    let out = run_extractor("us", eu.url());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "stderr: {stderr}");
    assert!(stderr.contains("`us`") && stderr.contains("`eu`"), "names both regions: {stderr}");

    // It created nothing on the EU server.
    let js = async_nats::jetstream::new(async_nats::connect(eu.url()).await.unwrap());
    assert!(js.get_stream("REVIEWS_US_INTERACTIVE").await.is_err());
    assert!(js.get_stream("KV_REGION_US").await.is_err());
}

#[tokio::test]
async fn an_unprovisioned_server_is_refused_and_a_bad_config_exits_64() {
    let blank = NatsServer::start();
    let out = run_extractor("eu", blank.url());
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no region identity"));

    let out = run_extractor("apac", blank.url());
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("REVIEWLANE_REGION"));
}

#[tokio::test]
async fn a_server_with_the_identity_but_not_the_layout_is_refused_and_nothing_is_created() {
    // Provisioning owns the streams and buckets: one stopped after the identity leaves
    // a server the services must not lay out themselves, with their own idea of limits.
    let half = NatsServer::start_with_identity(Region::Us).await;
    let out = run_extractor("us", half.url());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "stderr: {stderr}");
    assert!(
        stderr.contains("REVIEWS_US_INTERACTIVE") && stderr.contains("KV_JOBS_US"),
        "names what is missing: {stderr}"
    );
    assert!(stderr.contains("reviewlane-admin provision --region us"), "says how to fix it: {stderr}");
    let js = async_nats::jetstream::new(async_nats::connect(half.url()).await.unwrap());
    for name in reviewlane_shared::layout::stream_names(Region::Us) {
        assert!(js.get_stream(&name).await.is_err(), "{name} was created");
    }

    // Once provisioned, the same server is accepted: the check is on what exists.
    reviewlane_shared::testing::provision(half.url(), Region::Us, &Default::default()).await;
    let js = async_nats::jetstream::new(async_nats::connect(half.url()).await.unwrap());
    let opened = reviewlane_shared::layout::open(&js, Region::Us, half.url()).await;
    assert!(opened.is_ok(), "a provisioned server opens: {:?}", opened.err());
}
