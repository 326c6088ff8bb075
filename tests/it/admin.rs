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
