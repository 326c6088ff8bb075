//! A real HTTP webhook receiver that records every delivery (headers and body), for
//! tests and load scenarios. Answers 200 unless told to answer something else first.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

use crate::http::HttpResponse;

#[derive(Debug, Clone)]
pub struct Received {
    /// When the delivery arrived.
    pub at: std::time::Instant,
    pub idempotency_key: Option<String>,
    pub signature: Option<String>,
    pub body: Bytes,
}

#[derive(Default)]
struct State {
    received: Mutex<Vec<Received>>,
    statuses: Mutex<VecDeque<u16>>,
}

pub struct WebhookReceiver {
    addr: SocketAddr,
    state: Arc<State>,
    _server: crate::http::Server,
}

impl WebhookReceiver {
    pub async fn start() -> WebhookReceiver {
        let state = Arc::new(State::default());
        let st = state.clone();
        let server = crate::http::serve(move |req| handle(st.clone(), req)).await;
        WebhookReceiver { addr: server.addr, state, _server: server }
    }

    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().expect("lock").clone()
    }

    /// Deliveries recorded for one job id (by `Idempotency-Key`).
    pub fn for_job(&self, job_id: &str) -> Vec<Received> {
        self.received().into_iter().filter(|r| r.idempotency_key.as_deref() == Some(job_id)).collect()
    }

    /// The next requests are answered with these statuses (then 200 again).
    pub fn answer_with(&self, statuses: impl IntoIterator<Item = u16>) {
        self.state.statuses.lock().expect("lock").extend(statuses);
    }
}

async fn handle(st: Arc<State>, req: Request<Incoming>) -> Result<HttpResponse, Infallible> {
    let header = |n: &str| req.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
    let idempotency_key = header("idempotency-key");
    let signature = header("x-reviewlane-signature");
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let status = st.statuses.lock().expect("lock").pop_front().unwrap_or(200);
    if status == 200 {
        let at = std::time::Instant::now();
        st.received.lock().expect("lock").push(Received { at, idempotency_key, signature, body });
    }
    Ok(Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::OK))
        .body(Full::new(Bytes::new()))
        .expect("response builds"))
}
