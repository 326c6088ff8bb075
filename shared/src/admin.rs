//! The admin HTTP port every service serves: `/metrics` (Prometheus text), `/healthz`
//! (the process is alive). Metric labels are bounded sets (regions, lanes, tenants from
//! config, outcome classes); never content.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

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

    pub async fn run(self, registry: Arc<Registry>, stop: CancellationToken) {
        loop {
            let (stream, _) = tokio::select! {
                a = self.listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                _ = stop.cancelled() => return,
            };
            let registry = registry.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| handle(registry.clone(), req));
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    }
}

async fn handle(
    registry: Arc<Registry>,
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
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    };
    Ok(Response::builder()
        .status(status)
        .header("content-type", ctype)
        .body(Full::new(Bytes::from(body)))
        .expect("response builds"))
}
