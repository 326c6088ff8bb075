//! Every service's admin port: `/healthz` (alive), `/readyz` (its NATS connected and its
//! streams present), `/metrics`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use reviewlane_shared::region::Region;

use crate::harness::*;

async fn ready(addr: SocketAddr) -> bool {
    http_get(addr, "/readyz").await == "ready\n"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_reports_health_and_readiness() {
    let mut stack = Stack::start().await;
    let mut all = vec![("ingress", Region::Us, stack.ingress_admin)];
    all.extend(stack.extractor_admin.iter().map(|(r, a)| ("extractor", *r, *a)));
    all.extend(stack.publisher_admin.iter().map(|(r, a)| ("publisher", *r, *a)));
    assert_eq!(all.len(), 5);
    for (name, region, addr) in &all {
        assert_eq!(http_get(*addr, "/healthz").await, "ok\n", "{name} {region}");
        assert!(ready(*addr).await, "{name} {region} ready");
        assert!(http_get(*addr, "/metrics").await.ends_with("# EOF\n"), "{name} {region} metrics");
    }

    // The US NATS goes away: the US services and the ingress (which serves both regions)
    // stop being ready; the EU services stay ready; everyone stays alive.
    stack.us.nats.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    for (name, region, addr) in &all {
        let should_be_ready = *name != "ingress" && *region == Region::Eu;
        loop {
            let r = ready(*addr).await;
            if r == should_be_ready {
                break;
            }
            assert!(Instant::now() < deadline, "{name} {region}: ready = {r}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(http_get(*addr, "/healthz").await, "ok\n", "{name} {region} alive");
    }
    // No orderly shutdown: the US services cannot drain a dead server; dropping the
    // stack stops them.
}

/// A gauge sample for the US interactive lane, from a Prometheus text page.
fn lane_sample(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find(|l| {
            l.starts_with(&format!("{name}{{")) && l.contains("lane=\"interactive\"") && l.contains("region=\"us\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_age_rises_while_a_paused_scope_holds_work_and_falls_after_it_drains() {
    use loadtest::simprovider::Scripted;
    use reviewlane_shared::proto::JobState;

    let stack = Stack::start().await;
    // The first call is refused with a 3 s pause: its review stays on the lane.
    stack.us.provider.script([Scripted::Status {
        status: 429,
        headers: vec![("retry-after".into(), "3".into())],
        body: r#"{"error":{"code":"rate_limit_exceeded"}}"#.into(),
    }]);
    let admin = stack.extractor_admin.iter().find(|(r, _)| *r == Region::Us).unwrap().1;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "aged", &sample_diff("aged")).await;

    let age_at_least = |min: f64| async move {
        let deadline = Instant::now() + Duration::from_secs(4);
        loop {
            let page = http_get(admin, "/metrics").await;
            if let Some(age) = lane_sample(&page, "reviewlane_queue_age_seconds")
                && age >= min
            {
                assert_eq!(lane_sample(&page, "reviewlane_queue_depth"), Some(1.0));
                return age;
            }
            assert!(Instant::now() < deadline, "queue age never reached {min} s:\n{page}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let first = age_at_least(0.5).await;
    let later = age_at_least(first + 1.0).await;
    assert!(later > first);

    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let page = http_get(admin, "/metrics").await;
        if lane_sample(&page, "reviewlane_queue_age_seconds") == Some(0.0)
            && lane_sample(&page, "reviewlane_queue_depth") == Some(0.0)
        {
            break;
        }
        assert!(Instant::now() < deadline, "queue age did not fall after the drain:\n{page}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stack.shutdown().await;
}
