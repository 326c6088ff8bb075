//! A region on a three-node JetStream cluster with every stream and bucket at three
//! replicas: one node is killed (SIGKILL) in the middle of a run, and every job is still
//! published exactly once and paid once, the services reconnecting by themselves.

use std::time::Duration;

use async_nats::jetstream;
use reviewlane_api::proto::JobState;
use reviewlane_core::region::{Lane, Region};
use reviewlane_shared::layout;
use reviewlane_testkit::simprovider::SimConfig;
use tonic::Code;

use crate::harness::*;

const JOBS: usize = 240;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_node_of_a_three_node_cluster_loses_nothing_and_pays_nothing_twice() {
    let mut stack = Stack::start_with(StackOptions {
        us_cluster: true,
        // A failover (a few seconds) stays within a lease (production default 30 s), so
        // no holder loses its job while the store cannot record its extension. With a
        // lease shorter than the failover, a holder's job may be taken over and paid again.
        lease: Duration::from_secs(15),
        us_provider: SimConfig { latency: Duration::from_millis(50), ..Default::default() },
        ..Default::default()
    })
    .await;
    let addrs = reviewlane_shared::nats_client::server_addrs(&stack.us.url()).unwrap();
    let js = jetstream::new(async_nats::connect(addrs).await.unwrap());
    let r = Region::Us;
    for name in [
        layout::lane_stream(r, Lane::Interactive),
        layout::findings_stream(r),
        layout::deadletter_stream(r),
        format!("KV_{}", layout::jobs_bucket(r)),
        format!("KV_{}", layout::published_bucket(r)),
        format!("OBJ_{}", layout::findings_objects(r)),
    ] {
        let info = js.get_stream(&name).await.unwrap().info().await.unwrap().clone();
        assert_eq!(info.config.num_replicas, 3, "{name}");
    }

    let client = stack.client().await;
    let mut ids = Vec::new();
    for i in 0..JOBS {
        if i == JOBS / 3 {
            // SIGKILL of the node every client was given first.
            stack.us.nats.kill();
        }
        // A caller resends with the same key while the cluster fails over.
        let key = format!("cluster-{i}");
        let review = poll_until(Duration::from_secs(30), || {
            let mut client = client.clone();
            let key = key.clone();
            async move {
                match client.submit_review(submit_req(US_KEY, &key, &sample_diff(&key))).await {
                    Ok(r) => r.into_inner().review,
                    Err(e) if matches!(e.code(), Code::Unavailable | Code::ResourceExhausted) => None,
                    Err(e) => panic!("submit {key}: {e:?}"),
                }
            }
        })
        .await
        .unwrap_or_else(|| panic!("submit {i} not accepted in 30 s"));
        ids.push(review.job_id);
    }
    // Every job ends published (a caller retries a read the failover answers UNAVAILABLE).
    let unavailable = std::sync::atomic::AtomicU32::new(0);
    for id in &ids {
        let published = poll_until(Duration::from_secs(90), || {
            let mut client = client.clone();
            let unavailable = &unavailable;
            async move {
                match get(&mut client, US_KEY, id).await {
                    Ok(r) if r.state == JobState::Published as i32 => Some(()),
                    Ok(r) => {
                        assert!(r.state != JobState::Terminal as i32, "{id}: {r:?}");
                        None
                    }
                    Err(e) if e.code() == Code::Unavailable => {
                        unavailable.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        None
                    }
                    Err(e) => panic!("{id}: {e:?}"),
                }
            }
        })
        .await;
        assert!(published.is_some(), "{id} not published in 90 s ({} reads unavailable)", unavailable.into_inner());
    }
    let stats = stack.us.provider.stats();
    for id in &ids {
        assert_eq!(stack.webhook.for_job(id).len(), 1, "{id} delivered once");
        assert_eq!(stats.paid_by_job.get(id), Some(&1), "{id} paid once");
    }
    stack.shutdown().await;
}
