//! A small HTTP/1.1 server on 127.0.0.1 (port 0) for the simulated provider and the
//! webhook receiver; it stops when its handle drops.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub type HttpResponse = Response<Full<Bytes>>;

pub struct Server {
    pub addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

pub async fn serve<F, Fut>(handler: F) -> Server
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<HttpResponse, Infallible>> + Send + 'static,
{
    serve_on("127.0.0.1:0".parse().expect("addr"), handler).await.expect("bind 127.0.0.1:0")
}

/// The same server on `addr` (the `reviewlane-sim` binary binds where it is told).
pub async fn serve_on<F, Fut>(addr: SocketAddr, handler: F) -> std::io::Result<Server>
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<HttpResponse, Infallible>> + Send + 'static,
{
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr().expect("bound address");
    let (stop, mut stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = &mut stopped => return,
            };
            let Ok((stream, _)) = accepted else { continue };
            // As servers in front of real providers and receivers do: an answer written in
            // two parts must not wait for the client's delayed ACK.
            let _ = stream.set_nodelay(true);
            let handler = handler.clone();
            tokio::spawn(async move {
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service_fn(handler)).await;
            });
        }
    });
    Ok(Server { addr, _stop: stop })
}
