//! A simulated LLM gateway in the shape of LiteLLM's proxy: one model deployment with
//! `rpm` (and optionally `tpm`) limits over fixed windows, in front of a simulated
//! provider (`simprovider`) that writes the answers. It owns the gateway's contract as
//! read from LiteLLM's documentation and code, independently of this project's client,
//! so a test can catch the client reading the gateway wrong.
//!
//! What it answers, and where each rule comes from:
//! - `POST /v1/chat/completions` and `POST /chat/completions`, OpenAI-compatible, with a
//!   bearer key ("CLI - Quick Start" and "Config.yaml", docs.litellm.ai/docs/proxy/configs:
//!   both paths, `Authorization: Bearer <key>`, a `master_key` to require one).
//! - A deployment's `rpm`/`tpm` in `model_list[].litellm_params` ("Config.yaml";
//!   "Multi-Instance TPM/RPM", docs.litellm.ai/docs/load_test_rpm, with
//!   `enable_pre_call_checks`; "Global rate limiting",
//!   aws-samples.github.io/bedrock-litellm/25-config/25-global-rate-limit: over the
//!   limit the calls fail, "the limit will reset after one minute").
//! - Fixed windows that start at the clock's minute: the router keeps its counters under
//!   keys ending in the UTC minute, `get_utc_datetime().strftime("%H-%M")`
//!   (BerriAI/litellm `litellm/types/router.py` `RouterCacheEnum`, and
//!   `router_utils/pre_call_checks/model_rate_limit_check.py`), so a count drops to zero
//!   at the minute boundary, not bit by bit. Here a window starts at every multiple of
//!   `window` since the Unix epoch by an injected clock (60 s: the UTC minute).
//! - A 200 carries `x-ratelimit-limit-requests` and `x-ratelimit-remaining-requests`, and
//!   the `-tokens` pair when `tpm` is set, and no reset header ("Response Headers",
//!   docs.litellm.ai/docs/proxy/response_headers, lists the reset headers as Optional;
//!   the router's `set_response_headers` / `get_remaining_model_group_usage` fill only
//!   limit and remaining). The remaining count includes this call: LiteLLM's router
//!   tests expect `x-ratelimit-remaining-requests: 99` on the first answer of an
//!   `rpm: 100` deployment (`test_set_response_headers_passes_through_post_increment_counters`
//!   and the wildcard-route header test). Tokens are the answers' `usage.total_tokens`.
//! - Over the limit: 429 with body `{"error": {"message": "No deployments available for
//!   selected model, Try again in 5 seconds. Passed model=<m>. pre-call-checks=True,
//!   cooldown_list=[]", "type": "None", "param": "None", "code": "429"}}` and neither
//!   `retry-after` nor any `x-ratelimit-*` header. The message is `RouterRateLimitError`'s
//!   (`litellm/types/router.py`); its N is the router's cooldown time
//!   (`CooldownCache.get_min_cooldown` falls back to the default, 5 s, when no deployment
//!   cools down), not the time left in the window. `ProxyException` maps "No deployments
//!   available" to code "429" (`litellm/proxy/_types.py`, issue BerriAI/litellm#2487);
//!   `_handle_llm_api_exception` (`litellm/proxy/common_request_processing.py`) fills
//!   `type` and `param` with the string "None" and takes headers only from the exception,
//!   which has none.
//!
//! Not confirmed, and chosen here:
//! - Which counter `enable_pre_call_checks` holds against `rpm` in every version (the
//!   stored `router.py` was an old one); the UTC-minute key is the current code's.
//! - When a call counts: the current router adds a success to the minute's usage when
//!   it is answered (`deployment_callback_on_success`), so calls in flight can start
//!   more than `rpm` in a window (`CountOn::Answer`); the default here counts at
//!   admission (`CountOn::Admission`), never more than `rpm`.
//! - The `tpm` rule: refused once the window's tokens reach `tpm`, as
//!   `enforce_model_rate_limits` does.
//! - The 401 body for a missing or wrong key.
//!
//! Not simulated: `optional_pre_call_checks: ["enforce_model_rate_limits"]`, whose 429 is
//! "Model rate limit exceeded" with `retry-after: 60` and counts refused calls too; key
//! limits (the parallel request limiter's headers); cooldowns after deployment failures;
//! several deployments per model; LiteLLM's `x-litellm-*` headers but the model group;
//! the provider's own rate-limit headers. A deployment error is passed through as is.
//!
//! Latency and a cap on calls in flight are the deployment's (`SimConfig::latency`,
//! `concurrency_cap`). `GET /stats` returns `GatewayStats`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use reviewlane_core::clock::{self, SharedClock};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::http::HttpResponse;
use crate::simprovider::{JOB_ID_HEADER, PART_HEADER, SimConfig, SimProvider};

/// When a call counts against its window's `rpm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CountOn {
    /// When it is let through: never more than `rpm` calls start in a window.
    #[default]
    Admission,
    /// When the deployment answers it 200, as LiteLLM's router counts a success: calls
    /// in flight are not counted yet, so a burst can start more than `rpm`.
    Answer,
}

#[derive(Clone)]
pub struct GatewayConfig {
    /// Requests a window lets through.
    pub rpm: u64,
    /// Tokens a window lets through (the answers' `usage.total_tokens`).
    pub tpm: Option<u64>,
    /// The fixed window; LiteLLM's is the minute.
    pub window: Duration,
    /// Windows start at multiples of `window` since the Unix epoch by this clock.
    pub clock: SharedClock,
    pub count_on: CountOn,
    /// The N of the 429's "Try again in N seconds" (LiteLLM's default cooldown time).
    pub cooldown_secs: u64,
    /// With a key, a call must bring `Authorization: Bearer <key>`.
    pub master_key: Option<String>,
    /// The deployment behind the gateway, which writes the answers.
    pub deployment: SimConfig,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            rpm: 60,
            tpm: None,
            window: Duration::from_secs(60),
            clock: clock::system(),
            count_on: CountOn::Admission,
            cooldown_secs: 5,
            master_key: None,
            deployment: SimConfig::default(),
        }
    }
}

/// A deployment's limits over fixed windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub rpm: u64,
    pub tpm: Option<u64>,
    pub window_ms: u64,
}

impl Limits {
    /// The start of the window `now_ms` falls in.
    pub fn window_start(&self, now_ms: u64) -> u64 {
        now_ms - now_ms % self.window_ms.max(1)
    }
}

/// What one window has used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub window_start_ms: u64,
    pub requests: u64,
    pub tokens: u64,
}

/// Which limit refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Requests,
    Tokens,
}

/// What a 200 reports, with the call counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Readings {
    pub requests_left: u64,
    pub tokens_left: Option<u64>,
}

impl Readings {
    /// The `x-ratelimit-*` headers of a 200: limit and remaining, never a reset.
    pub fn headers(&self, limits: &Limits) -> Vec<(&'static str, String)> {
        let mut h = vec![
            ("x-ratelimit-limit-requests", limits.rpm.to_string()),
            ("x-ratelimit-remaining-requests", self.requests_left.to_string()),
        ];
        if let (Some(tpm), Some(left)) = (limits.tpm, self.tokens_left) {
            h.push(("x-ratelimit-limit-tokens", tpm.to_string()));
            h.push(("x-ratelimit-remaining-tokens", left.to_string()));
        }
        h
    }
}

/// The deployment's counters: the current window only, dropped whole when the next
/// one starts.
#[derive(Debug, Clone)]
pub struct Meter {
    limits: Limits,
    count_on: CountOn,
    usage: Usage,
}

impl Meter {
    pub fn new(limits: Limits, count_on: CountOn) -> Meter {
        Meter { limits, count_on, usage: Usage::default() }
    }

    fn window(&mut self, now_ms: u64) -> &mut Usage {
        let start = self.limits.window_start(now_ms);
        if start != self.usage.window_start_ms {
            self.usage = Usage { window_start_ms: start, ..Usage::default() };
        }
        &mut self.usage
    }

    /// Lets a call starting at `now_ms` through, or says which limit is used up.
    pub fn admit(&mut self, now_ms: u64) -> Result<(), Refused> {
        let (limits, count_on) = (self.limits, self.count_on);
        let used = self.window(now_ms);
        if used.requests >= limits.rpm {
            return Err(Refused::Requests);
        }
        if limits.tpm.is_some_and(|tpm| used.tokens >= tpm) {
            return Err(Refused::Tokens);
        }
        if count_on == CountOn::Admission {
            used.requests += 1;
        }
        Ok(())
    }

    /// Counts a 200 answered at `now_ms` with `tokens` in its usage, in the window
    /// current then.
    pub fn answered(&mut self, now_ms: u64, tokens: u64) -> Readings {
        let (limits, count_on) = (self.limits, self.count_on);
        let used = self.window(now_ms);
        if count_on == CountOn::Answer {
            used.requests += 1;
        }
        used.tokens += tokens;
        Readings {
            requests_left: limits.rpm.saturating_sub(used.requests),
            tokens_left: limits.tpm.map(|tpm| tpm.saturating_sub(used.tokens)),
        }
    }

    pub fn usage(&self) -> Usage {
        self.usage
    }
}

/// The 429 body of LiteLLM's router when no deployment of the model may take a call.
pub fn no_deployments_body(model: &str, cooldown_secs: u64) -> String {
    json!({"error": {
        "message": format!(
            "No deployments available for selected model, Try again in {cooldown_secs} seconds. \
             Passed model={model}. pre-call-checks=True, cooldown_list=[]"
        ),
        "type": "None",
        "param": "None",
        "code": "429",
    }})
    .to_string()
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GatewayStats {
    pub total_calls: u64,
    pub calls_200: u64,
    pub calls_429: u64,
    /// Any other answer: a 401, or the deployment's own error passed through.
    pub calls_other: u64,
    /// Every finished call, in the order answered.
    pub calls: Vec<GatewayCall>,
    /// Calls by the start of the window they came in (ms since the Unix epoch by the
    /// gateway's clock).
    pub windows: BTreeMap<u64, WindowCount>,
    /// Call start times (ms, the gateway's clock) per job id (`x-reviewlane-job-id`).
    pub call_times_by_job: BTreeMap<String, Vec<u64>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct GatewayCall {
    /// When it came (ms since the Unix epoch by the gateway's clock).
    pub at_ms: u64,
    pub job: String,
    pub status: u16,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WindowCount {
    pub calls: u64,
    pub served: u64,
    pub refused: u64,
}

struct State {
    config: GatewayConfig,
    limits: Limits,
    meter: Mutex<Meter>,
    stats: Mutex<GatewayStats>,
    upstream: SimProvider,
    client: reqwest::Client,
}

impl State {
    fn started(&self, at_ms: u64, job: &str) {
        let mut s = self.stats.lock().expect("stats lock");
        s.total_calls += 1;
        s.windows.entry(self.limits.window_start(at_ms)).or_default().calls += 1;
        s.call_times_by_job.entry(job.to_string()).or_default().push(at_ms);
    }

    fn finished(&self, at_ms: u64, job: String, answer: HttpResponse) -> HttpResponse {
        let status = answer.status().as_u16();
        let mut s = self.stats.lock().expect("stats lock");
        let window = s.windows.entry(self.limits.window_start(at_ms)).or_default();
        match status {
            200 => window.served += 1,
            429 => window.refused += 1,
            _ => {}
        }
        match status {
            200 => s.calls_200 += 1,
            429 => s.calls_429 += 1,
            _ => s.calls_other += 1,
        }
        s.calls.push(GatewayCall { at_ms, job, status });
        answer
    }
}

/// The system's clock shifted back so that a fixed window of `window` starts now (the
/// gateway's windows start at multiples of it): one window and a call is then the floor.
pub fn clock_starting_a_window_now(window: Duration) -> SharedClock {
    struct Shifted(u64);
    impl clock::Clock for Shifted {
        fn now_ms(&self) -> u64 {
            clock::now_ms() - self.0
        }
    }
    Arc::new(Shifted(clock::now_ms() % window.as_millis().max(1) as u64))
}

/// A running simulated gateway and the deployment behind it; stops when dropped.
pub struct SimGateway {
    addr: SocketAddr,
    state: Arc<State>,
    _server: crate::http::Server,
}

impl SimGateway {
    pub async fn start(config: GatewayConfig) -> SimGateway {
        let limits = Limits { rpm: config.rpm, tpm: config.tpm, window_ms: config.window.as_millis().max(1) as u64 };
        let state = Arc::new(State {
            meter: Mutex::new(Meter::new(limits, config.count_on)),
            limits,
            stats: Mutex::new(GatewayStats::default()),
            upstream: SimProvider::start(config.deployment.clone()).await,
            client: reqwest::Client::new(),
            config,
        });
        let st = state.clone();
        let server = crate::http::serve(move |req| handle(st.clone(), req)).await;
        SimGateway { addr: server.addr, state, _server: server }
    }

    /// Base URL for an OpenAI-compatible client: `http://127.0.0.1:port/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> GatewayStats {
        self.state.stats.lock().expect("stats lock").clone()
    }

    /// The deployment behind the gateway (it sees only the calls let through).
    pub fn deployment(&self) -> &SimProvider {
        &self.state.upstream
    }

    pub fn limits(&self) -> Limits {
        self.state.limits
    }

    /// The start of the current window by the gateway's clock.
    pub fn window_start_ms(&self) -> u64 {
        self.state.limits.window_start(self.state.config.clock.now_ms())
    }

    /// What the current window has used, as of the last call.
    pub fn usage(&self) -> Usage {
        self.state.meter.lock().expect("meter lock").usage()
    }
}

fn respond(status: StatusCode, headers: &[(&str, String)], body: impl Into<Bytes>) -> HttpResponse {
    let mut b = Response::builder().status(status).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, v.as_str());
    }
    b.body(Full::new(body.into())).expect("response builds")
}

fn error(status: StatusCode, message: &str, kind: &str) -> HttpResponse {
    let code = status.as_u16().to_string();
    let body = json!({"error": {"message": message, "type": kind, "param": "None", "code": code}});
    respond(status, &[], body.to_string())
}

async fn handle(st: Arc<State>, req: Request<Incoming>) -> Result<HttpResponse, Infallible> {
    let path = req.uri().path();
    if req.method() == Method::GET && path == "/stats" {
        let body = serde_json::to_string(&*st.stats.lock().expect("stats lock")).expect("stats serialize");
        return Ok(respond(StatusCode::OK, &[], body));
    }
    if req.method() != Method::POST || !matches!(path, "/v1/chat/completions" | "/chat/completions") {
        return Ok(respond(StatusCode::NOT_FOUND, &[], "{}"));
    }
    Ok(chat(&st, req).await)
}

/// One chat completion: the key, the window, then the deployment.
async fn chat(st: &State, req: Request<Incoming>) -> HttpResponse {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let job = header(JOB_ID_HEADER).unwrap_or_default();
    let passed: Vec<(&str, String)> = [JOB_ID_HEADER, PART_HEADER, "authorization"]
        .into_iter()
        .filter_map(|name| header(name).map(|v| (name, v)))
        .collect();
    let at_ms = st.config.clock.now_ms();
    st.started(at_ms, &job);
    if let Some(key) = &st.config.master_key
        && header("authorization").as_deref().and_then(|a| a.strip_prefix("Bearer ")) != Some(key.as_str())
    {
        let answer = error(StatusCode::UNAUTHORIZED, "Authentication Error, invalid or missing api key.", "auth_error");
        return st.finished(at_ms, job, answer);
    }
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let model = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|r| r["model"].as_str().map(str::to_string))
        .unwrap_or_default();
    let admitted = st.meter.lock().expect("meter lock").admit(at_ms);
    let answer = match admitted {
        Err(_) => respond(StatusCode::TOO_MANY_REQUESTS, &[], no_deployments_body(&model, st.config.cooldown_secs)),
        Ok(()) => forward(st, body, &passed, &model).await,
    };
    st.finished(at_ms, job, answer)
}

/// Sends a call let through to the deployment; its 200 is counted and gets the
/// window's readings.
async fn forward(st: &State, body: Bytes, passed: &[(&str, String)], model: &str) -> HttpResponse {
    let mut request = st
        .client
        .post(format!("{}/chat/completions", st.upstream.base_url()))
        .header("content-type", "application/json")
        .body(body);
    for (name, value) in passed {
        request = request.header(*name, value.as_str());
    }
    let answered = match request.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            r.bytes().await.map(|b| (status, b))
        }
        Err(e) => Err(e),
    };
    let Ok((status, bytes)) = answered else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "The deployment did not answer.", "None");
    };
    if status != 200 {
        return respond(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY), &[], bytes);
    }
    let tokens = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|a| a["usage"]["total_tokens"].as_u64())
        .unwrap_or(0);
    let readings = st.meter.lock().expect("meter lock").answered(st.config.clock.now_ms(), tokens);
    let mut headers = readings.headers(&st.limits);
    headers.push(("x-litellm-model-group", model.to_string()));
    respond(StatusCode::OK, &headers, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reviewlane_core::clock::ManualClock;

    const MINUTE: u64 = 60_000;
    /// 10 s into a UTC minute.
    const T0: u64 = 29_000_000 * MINUTE + 10_000;

    fn limits(rpm: u64, tpm: Option<u64>) -> Limits {
        Limits { rpm, tpm, window_ms: MINUTE }
    }

    #[test]
    fn windows_start_at_the_clock_minute() {
        let l = limits(1, None);
        assert_eq!(l.window_start(T0), T0 - 10_000);
        assert_eq!(l.window_start(T0 - 10_000), T0 - 10_000);
        assert_eq!(l.window_start(T0 + 49_999), T0 - 10_000);
        assert_eq!(l.window_start(T0 + 50_000), T0 + 50_000);
    }

    #[test]
    fn a_used_up_window_refuses_until_the_boundary_then_serves_in_full() {
        let mut m = Meter::new(limits(2, None), CountOn::Admission);
        assert_eq!((m.admit(T0), m.admit(T0 + 1)), (Ok(()), Ok(())));
        assert_eq!(m.admit(T0 + 2), Err(Refused::Requests));
        // Nothing comes back within the window: no refill.
        assert_eq!(m.admit(T0 + 49_999), Err(Refused::Requests));
        assert_eq!((m.admit(T0 + 50_000), m.admit(T0 + 50_001)), (Ok(()), Ok(())));
        assert_eq!(m.admit(T0 + 50_002), Err(Refused::Requests));
    }

    #[test]
    fn readings_count_the_call_answered() {
        let mut m = Meter::new(limits(3, Some(400)), CountOn::Admission);
        m.admit(T0).unwrap();
        assert_eq!(m.answered(T0, 150), Readings { requests_left: 2, tokens_left: Some(250) });
        m.admit(T0).unwrap();
        m.admit(T0).unwrap();
        assert_eq!(m.answered(T0, 300), Readings { requests_left: 0, tokens_left: Some(0) });
    }

    #[test]
    fn tokens_used_up_refuse_though_requests_are_left() {
        let mut m = Meter::new(limits(100, Some(300)), CountOn::Admission);
        m.admit(T0).unwrap();
        m.answered(T0, 299);
        m.admit(T0).unwrap();
        m.answered(T0, 1);
        assert_eq!(m.admit(T0), Err(Refused::Tokens));
        assert_eq!(m.admit(T0 + 50_000), Ok(()));
    }

    #[test]
    fn counted_on_answer_a_burst_in_flight_starts_more_than_rpm() {
        let mut m = Meter::new(limits(2, None), CountOn::Answer);
        assert!((0..4).all(|_| m.admit(T0).is_ok()));
        let left: Vec<u64> = (0..4).map(|_| m.answered(T0, 0).requests_left).collect();
        assert_eq!(left, vec![1, 0, 0, 0]);
        assert_eq!(m.admit(T0), Err(Refused::Requests));

        let mut strict = Meter::new(limits(2, None), CountOn::Admission);
        let admitted = (0..4).filter(|_| strict.admit(T0).is_ok()).count();
        assert_eq!(admitted, 2);
    }

    #[test]
    fn headers_have_no_reset_and_tokens_only_with_tpm() {
        let names = |r: Readings, l: Limits| r.headers(&l).into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        let without = names(Readings { requests_left: 1, tokens_left: None }, limits(2, None));
        assert_eq!(without, vec!["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"]);
        let with = names(Readings { requests_left: 1, tokens_left: Some(5) }, limits(2, Some(9)));
        assert_eq!(with.len(), 4);
        assert!(with.iter().all(|n| !n.contains("reset")));
    }

    struct Answer {
        status: u16,
        headers: reqwest::header::HeaderMap,
        body: serde_json::Value,
    }

    async fn call(base: &str, path: &str, job: &str, key: Option<&str>) -> Answer {
        let body = json!({"model": "review-model", "messages": [{"role": "user", "content":
            "--- a/x.rs\n+++ b/x.rs\n@@ -1 +1,2 @@\n a\n+let b = c;\n"}]});
        let mut request = reqwest::Client::new().post(format!("{base}{path}")).header(JOB_ID_HEADER, job).json(&body);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let r = request.send().await.expect("gateway answers");
        let (status, headers) = (r.status().as_u16(), r.headers().clone());
        Answer { status, headers, body: r.json().await.expect("json body") }
    }

    fn header(a: &Answer, name: &str) -> Option<String> {
        a.headers.get(name).map(|v| v.to_str().expect("ascii").to_string())
    }

    fn rate_headers(a: &Answer) -> Vec<String> {
        a.headers.keys().map(|k| k.as_str().to_string()).filter(|k| k.starts_with("x-ratelimit")).collect()
    }

    fn assert_refused_without_hints(a: &Answer) {
        assert_eq!(a.status, 429);
        assert_eq!(header(a, "retry-after"), None);
        assert!(rate_headers(a).is_empty(), "{:?}", a.headers);
        let e = &a.body["error"];
        let message = e["message"].as_str().unwrap();
        assert!(message.starts_with("No deployments available for selected model"), "{message}");
        assert!(message.contains("Passed model=review-model"), "{message}");
        assert_eq!(
            (e["type"].as_str(), e["param"].as_str(), e["code"].as_str()),
            (Some("None"), Some("None"), Some("429"))
        );
    }

    #[tokio::test]
    async fn a_used_up_window_answers_429_without_hints_and_the_next_serves_in_full() {
        let clock = ManualClock::at(T0);
        let gw = SimGateway::start(GatewayConfig { rpm: 3, clock: clock.clone(), ..Default::default() }).await;
        let base = format!("http://{}", gw.addr());
        let first_window = gw.window_start_ms();
        assert_eq!(first_window, T0 - 10_000);

        for left in ["2", "1", "0"] {
            let a = call(&base, "/v1/chat/completions", "j1", None).await;
            assert_eq!(a.status, 200);
            assert!(a.body["choices"][0]["message"]["content"].as_str().unwrap().contains("let b = c;"));
            assert_eq!(header(&a, "x-ratelimit-limit-requests").as_deref(), Some("3"));
            assert_eq!(header(&a, "x-ratelimit-remaining-requests").as_deref(), Some(left));
            assert_eq!(rate_headers(&a).len(), 2, "no reset header, no tokens pair without tpm");
        }
        assert_refused_without_hints(&call(&base, "/v1/chat/completions", "j1", None).await);
        // The last millisecond of the window is still refused: nothing refills.
        clock.set(first_window + MINUTE - 1);
        assert_refused_without_hints(&call(&base, "/chat/completions", "j2", None).await);

        clock.set(first_window + MINUTE);
        for left in ["2", "1", "0"] {
            let a = call(&base, "/chat/completions", "j2", None).await;
            assert_eq!((a.status, header(&a, "x-ratelimit-remaining-requests").as_deref()), (200, Some(left)));
        }
        assert_refused_without_hints(&call(&base, "/v1/chat/completions", "j2", None).await);

        let s = gw.stats();
        assert_eq!((s.total_calls, s.calls_200, s.calls_429, s.calls_other), (9, 6, 3, 0));
        let windows: Vec<_> = s.windows.iter().map(|(start, c)| (*start, c.calls, c.served, c.refused)).collect();
        assert_eq!(windows, vec![(first_window, 5, 3, 2), (first_window + MINUTE, 4, 3, 1)]);
        assert_eq!(s.call_times_by_job["j1"], vec![T0; 4]);
        assert_eq!(s.call_times_by_job["j2"].first(), Some(&(first_window + MINUTE - 1)));
        // Refused calls never reach the deployment; the job id does.
        let d = gw.deployment().stats();
        assert_eq!((d.total_calls, d.paid_by_job["j1"], d.paid_by_job["j2"]), (6, 3, 3));
    }

    #[tokio::test]
    async fn with_tpm_the_tokens_pair_comes_and_used_up_tokens_refuse() {
        // The deployment reports 150 tokens a call.
        let clock = ManualClock::at(T0);
        let gw =
            SimGateway::start(GatewayConfig { rpm: 100, tpm: Some(400), clock: clock.clone(), ..Default::default() })
                .await;
        let base = format!("http://{}", gw.addr());
        for (requests, tokens) in [("99", "250"), ("98", "100"), ("97", "0")] {
            let a = call(&base, "/v1/chat/completions", "t", None).await;
            assert_eq!(a.status, 200);
            assert_eq!(header(&a, "x-ratelimit-limit-tokens").as_deref(), Some("400"));
            assert_eq!(header(&a, "x-ratelimit-remaining-tokens").as_deref(), Some(tokens));
            assert_eq!(header(&a, "x-ratelimit-remaining-requests").as_deref(), Some(requests));
            assert_eq!(rate_headers(&a).len(), 4);
        }
        assert_refused_without_hints(&call(&base, "/v1/chat/completions", "t", None).await);
        assert_eq!(gw.usage(), Usage { window_start_ms: T0 - 10_000, requests: 3, tokens: 450 });
        clock.advance(Duration::from_secs(50));
        let a = call(&base, "/v1/chat/completions", "t", None).await;
        assert_eq!((a.status, header(&a, "x-ratelimit-remaining-tokens").as_deref()), (200, Some("250")));
    }

    #[tokio::test]
    async fn a_master_key_is_required_when_set() {
        let gw = SimGateway::start(GatewayConfig { master_key: Some("sk-gw".into()), ..Default::default() }).await;
        let base = format!("http://{}", gw.addr());
        assert_eq!(call(&base, "/v1/chat/completions", "k", None).await.status, 401);
        assert_eq!(call(&base, "/v1/chat/completions", "k", Some("sk-other")).await.status, 401);
        assert_eq!(call(&base, "/v1/chat/completions", "k", Some("sk-gw")).await.status, 200);
        let s = gw.stats();
        assert_eq!((s.calls_other, s.calls_200, gw.deployment().stats().total_calls), (2, 1, 1));
    }
}
