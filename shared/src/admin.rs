//! The admin HTTP port every service serves: `/metrics` (Prometheus text), `/healthz`
//! (the process is alive), `/readyz` (it can do its work: NATS connected, its streams
//! and buckets present — answered by the service's own check). Metric labels are bounded sets (regions, lanes, tenants from
//! config, outcome classes); never content.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use futures::future::BoxFuture;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The service's readiness check.
pub type Ready = Arc<dyn Fn() -> BoxFuture<'static, bool> + Send + Sync>;

/// Ready when `client` is connected and every stream named is present.
pub fn nats_ready(client: async_nats::Client, streams: Vec<String>) -> Ready {
    Arc::new(move || {
        let client = client.clone();
        let streams = streams.clone();
        Box::pin(async move {
            if client.connection_state() != async_nats::connection::State::Connected {
                return false;
            }
            let js = async_nats::jetstream::new(client);
            for s in &streams {
                if !matches!(crate::layout::stream_exists(&js, s).await, Ok(true)) {
                    return false;
                }
            }
            true
        })
    })
}

/// A bound admin listener; `run` serves it until `stop`.
pub struct Admin {
    listener: TcpListener,
}

impl Admin {
    pub async fn bind(addr: SocketAddr) -> std::io::Result<Admin> {
        Ok(Admin { listener: TcpListener::bind(addr).await? })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    pub async fn run(self, registry: Arc<Registry>, ready: Ready, stop: CancellationToken) {
        loop {
            let (stream, _) = tokio::select! {
                a = self.listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                _ = stop.cancelled() => return,
            };
            let registry = registry.clone();
            let ready = ready.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| handle(registry.clone(), ready.clone(), req));
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    }
}

async fn handle(
    registry: Arc<Registry>,
    ready: Ready,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, ctype, body) = match req.uri().path() {
        "/metrics" => {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, &registry) {
                Ok(()) => (StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", text),
                Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "encoding failed\n".into()),
            }
        }
        "/healthz" => (StatusCode::OK, "text/plain", "ok\n".into()),
        "/readyz" => match tokio::time::timeout(std::time::Duration::from_secs(2), ready()).await {
            Ok(true) => (StatusCode::OK, "text/plain", "ready\n".into()),
            _ => (StatusCode::SERVICE_UNAVAILABLE, "text/plain", "not ready\n".into()),
        },
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    };
    Ok(Response::builder()
        .status(status)
        .header("content-type", ctype)
        .body(Full::new(Bytes::from(body)))
        .expect("response builds"))
}

/// `reviewlane_nats_connected{region}`: 1 while this service's connection to the
/// region's NATS is up, 0 while it is not; and `reviewlane_nats_messages_total{region,
/// direction}`: messages this service sent to and received from that NATS (every
/// JetStream request, publish, acknowledgement and pull is one sent; its answer one
/// received) — what the round trips per job are measured with. Read from the client at
/// each scrape.
#[derive(Debug)]
pub struct NatsConnected(pub Vec<(reviewlane_core::region::Region, async_nats::Client)>);

impl prometheus_client::collector::Collector for NatsConnected {
    fn encode(&self, mut encoder: prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        let mut family = encoder.encode_descriptor(
            "reviewlane_nats_connected",
            "1 while the connection to the region's NATS is up",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (region, client) in &self.0 {
            let up = client.connection_state() == async_nats::connection::State::Connected;
            let labels = [("region", region.as_str())];
            ConstGauge::new(i64::from(up)).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "reviewlane_nats_messages",
            "Messages sent to and received from the region's NATS",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (region, client) in &self.0 {
            let stats = client.statistics();
            let sent = stats.out_messages.load(std::sync::atomic::Ordering::Relaxed);
            let received = stats.in_messages.load(std::sync::atomic::Ordering::Relaxed);
            for (direction, n) in [("sent", sent), ("received", received)] {
                let labels = [("region", region.as_str()), ("direction", direction)];
                prometheus_client::metrics::counter::ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
