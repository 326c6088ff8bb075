//! A real HTTP webhook receiver that records every delivery (headers and body), for
//! tests and load scenarios. Answers 200 unless told to answer something else first (a
//! 3xx comes with `Location: /hook`, to show that redirects are not followed), and can
//! hold its next answer (to race a cancel against a delivery in flight).

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

/// Any request that reached the receiver, whatever it was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub method: String,
    pub idempotency_key: Option<String>,
    pub status: u16,
}

#[derive(Default)]
struct State {
    received: Mutex<Vec<Received>>,
    attempts: Mutex<Vec<Attempt>>,
    statuses: Mutex<VecDeque<u16>>,
    hold: Mutex<Option<(std::time::Duration, Arc<tokio::sync::Notify>)>>,
    /// Bumped on every delivery recorded, for waiters.
    delivered: tokio::sync::watch::Sender<usize>,
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

    /// The first delivery for `job_id`, waiting for it up to `within`.
    pub async fn wait_for(&self, job_id: &str, within: std::time::Duration) -> Option<Received> {
        let mut changes = self.state.delivered.subscribe();
        let wait = async {
            loop {
                if let Some(r) = self.for_job(job_id).into_iter().next() {
                    return r;
                }
                if changes.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(within, wait).await.ok()
    }

    /// Waits until `n` deliveries (repeats included) have arrived, or none has for
    /// `stall`, or `within` has passed; the count then.
    pub async fn wait_count(&self, n: usize, stall: std::time::Duration, within: std::time::Duration) -> usize {
        let mut changes = self.state.delivered.subscribe();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let count = *changes.borrow_and_update();
            if count >= n || tokio::time::Instant::now() >= deadline {
                return count;
            }
            match tokio::time::timeout(stall, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => return *changes.borrow(),
            }
        }
    }

    /// The next requests are answered with these statuses (then 200 again).
    pub fn answer_with(&self, statuses: impl IntoIterator<Item = u16>) {
        self.state.statuses.lock().expect("lock").extend(statuses);
    }

    /// Every request for one job id, delivered or not, in order.
    pub fn attempts_for(&self, job_id: &str) -> Vec<Attempt> {
        let all = self.state.attempts.lock().expect("lock").clone();
        all.into_iter().filter(|a| a.idempotency_key.as_deref() == Some(job_id)).collect()
    }

    /// The next request waits `for_` before it is answered; the returned handle is
    /// notified when that request has arrived.
    pub fn hold_next(&self, for_: std::time::Duration) -> Arc<tokio::sync::Notify> {
        let arrived = Arc::new(tokio::sync::Notify::new());
        *self.state.hold.lock().expect("lock") = Some((for_, arrived.clone()));
        arrived
    }
}

async fn handle(st: Arc<State>, req: Request<Incoming>) -> Result<HttpResponse, Infallible> {
    let header = |n: &str| req.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
    let idempotency_key = header("idempotency-key");
    let signature = header("x-reviewlane-signature");
    let method = req.method().to_string();
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let hold = st.hold.lock().expect("lock").take();
    if let Some((for_, arrived)) = hold {
        arrived.notify_one();
        tokio::time::sleep(for_).await;
    }
    let status = st.statuses.lock().expect("lock").pop_front().unwrap_or(200);
    st.attempts.lock().expect("lock").push(Attempt { method, idempotency_key: idempotency_key.clone(), status });
    if status == 200 {
        let at = std::time::Instant::now();
        st.received.lock().expect("lock").push(Received { at, idempotency_key, signature, body });
        st.delivered.send_modify(|n| *n += 1);
    }
    let mut resp = Response::builder().status(StatusCode::from_u16(status).unwrap_or(StatusCode::OK));
    if (300..400).contains(&status) {
        resp = resp.header("location", "/hook");
    }
    Ok(resp.body(Full::new(Bytes::new())).expect("response builds"))
}
