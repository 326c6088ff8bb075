use std::path::Path;
use std::time::Duration;

use async_nats::jetstream;
use futures::TryStreamExt;
use reviewlane_api::proto::JobState;

use crate::harness::*;

/// Every message of every stream (KV buckets included) on a server, as bytes.
async fn all_stream_bytes(url: &str) -> Vec<Vec<u8>> {
    let js = jetstream::new(async_nats::connect(url).await.unwrap());
    let names: Vec<String> = js.stream_names().try_collect().await.unwrap();
    assert!(names.len() >= 9, "expected the region's streams and buckets, got {names:?}");
    let mut out = Vec::new();
    for name in names {
        let mut stream = js.get_stream(&name).await.unwrap();
        let state = stream.info().await.unwrap().state.clone();
        for seq in state.first_sequence..=state.last_sequence {
            if let Ok(m) = stream.get_raw_message(seq).await {
                let mut bytes = m.subject.as_bytes().to_vec();
                bytes.extend_from_slice(&m.payload);
                for (k, vs) in m.headers.iter() {
                    bytes.extend_from_slice(k.as_ref());
                    for v in vs {
                        bytes.extend_from_slice(v.as_str().as_bytes());
                    }
                }
                out.push(bytes);
            }
        }
    }
    out
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn dir_contains(dir: &Path, needle: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else { return false };
    entries.flatten().any(|e| {
        let p = e.path();
        if p.is_dir() { dir_contains(&p, needle) } else { std::fs::read(&p).is_ok_and(|b| contains(&b, needle)) }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eu_content_never_reaches_the_us_server_or_provider() {
    let canary = format!("CANARY-EU-{}", std::process::id());
    let stack = Stack::start_with(StackOptions { canaries: vec![canary.clone()], ..Default::default() }).await;
    let mut client = stack.client().await;

    // Traffic in both regions, so the US side is busy but must stay clean.
    let us_job = submit(&mut client, US_KEY, "res-us", &sample_diff("us-side")).await;
    let eu_job = submit(&mut client, EU_KEY, "res-eu", &sample_diff(&canary)).await;
    assert!(eu_job.job_id.starts_with("eu_"));
    assert_eq!(wait_final(&mut client, EU_KEY, &eu_job.job_id).await.state, JobState::Published as i32);
    assert_eq!(wait_final(&mut client, US_KEY, &us_job.job_id).await.state, JobState::Published as i32);

    // The EU side did process it (positive control for the scans below).
    assert!(stack.eu.provider.stats().canaries_seen.contains(&canary));
    assert!(all_stream_bytes(stack.eu.nats.url()).await.iter().any(|m| contains(m, &canary)));
    assert!(eventually(Duration::from_secs(5), || dir_contains(stack.eu.nats.store_dir(), &canary)).await);

    // The US side never saw it: no stream message, no KV value, no byte on disk, no call.
    assert!(!all_stream_bytes(stack.us.nats.url()).await.iter().any(|m| contains(m, &canary)));
    assert!(!dir_contains(stack.us.nats.store_dir(), &canary));
    let us_stats = stack.us.provider.stats();
    assert!(us_stats.canaries_seen.is_empty());
    assert!(!us_stats.calls_by_job.contains_key(&eu_job.job_id));
    assert_eq!(us_stats.total_calls, 1, "only the US job");
    // Nor did the US tenant's job touch the EU side.
    assert!(!stack.eu.provider.stats().calls_by_job.contains_key(&us_job.job_id));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_and_ingress_refuse_a_miswired_region() {
    use reviewlane_core::region::Region;
    use reviewlane_core::tenants::Tenants;
    use reviewlane_shared::startup::StartError;
    use reviewlane_shared::testing::NatsServer;
    use std::sync::Arc;

    let eu = NatsServer::start_provisioned(Region::Eu).await;
    let tenants = Arc::new(Tenants::parse(&tenants_toml("http://127.0.0.1:9/hook")).unwrap());
    let cfg = reviewlane_publisher::PublisherConfig::new(Region::Us, eu.url(), tenants.clone());
    let err = reviewlane_publisher::build(cfg).await.err().expect("publisher refuses");
    assert!(matches!(err, StartError::Wiring(_)), "{err}");
    assert_eq!(err.exit_code(), 78);
    let msg = err.to_string();
    assert!(msg.contains("`us`") && msg.contains("`eu`"), "{msg}");

    // An ingress whose US URL points at the EU server.
    let cfg = reviewlane_ingress::IngressConfig {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        admin_addr: "127.0.0.1:0".parse().unwrap(),
        tenants,
        nats_urls: [(Region::Us, eu.url().to_string())].into(),
        max_diff_bytes: 1024,
        shutdown_grace: Duration::from_secs(1),
        telemetry: Default::default(),
        interactive: reviewlane_ingress::IngressConfig::default_policies().0,
        batch: reviewlane_ingress::IngressConfig::default_policies().1,
        admission_sample: Duration::from_secs(1),
        faults: Default::default(),
        limits: Default::default(),
        nats: Default::default(),
        grpc_tls: None,
        notices: Vec::new(),
    };
    let err = reviewlane_ingress::build(cfg).await.err().expect("ingress refuses");
    assert!(matches!(err, StartError::Wiring(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_starting_at_once_all_pass_the_wiring_check() {
    use reviewlane_core::region::Region;
    use reviewlane_shared::startup::connect_region;
    use reviewlane_shared::testing::NatsServer;

    // As after `reviewlane-admin provision`: the identity and the layout exist.
    let us = NatsServer::start_provisioned(Region::Us).await;
    let client = Default::default();
    let starts = (0..6).map(|_| connect_region(us.url(), Region::Us, "t", &client));
    for r in futures::future::join_all(starts).await {
        if let Err(e) = r {
            panic!("concurrent start failed: {e}");
        }
    }
}
