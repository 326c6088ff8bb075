//! A simulated LLM provider speaking the OpenAI-compatible chat-completions contract
//! over real HTTP (hyper), with knobs for latency, a concurrency cap, what happens over
//! the cap (queue, or 429 with a retry hint), 5xx and malformed-output rates, findings
//! that point outside the diff, and scripted answers. `GET /stats` counts calls per job
//! id and the most concurrent calls seen.
//!
//! Answers are real findings: it parses the diff in the prompt and points at real added
//! lines, quoting them, so they pass validation unless a knob says otherwise.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use reviewlane_core::schema_dialect::{self, SchemaDialect};
use serde::Serialize;
use serde_json::json;
use tokio::sync::Semaphore;

pub const JOB_ID_HEADER: &str = "x-reviewlane-job-id";
pub const PART_HEADER: &str = "x-reviewlane-part";

/// What to do with a call over the concurrency cap.
#[derive(Debug, Clone, PartialEq)]
pub enum OverCap {
    /// Wait for a slot (a provider that queues).
    Queue,
    /// Answer 429 with these headers (e.g. `retry-after: 2`).
    Reject { headers: Vec<(String, String)> },
}

/// One scripted answer, used before the knobs: tests say exactly what happens.
#[derive(Debug, Clone, PartialEq)]
pub enum Scripted {
    Status {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// 200 with this text as the model's output.
    Output(String),
}

impl Scripted {
    /// OpenAI's answer for an account out of money: 429 `insufficient_quota`.
    pub fn insufficient_quota() -> Scripted {
        Scripted::Status {
            status: 429,
            headers: vec![],
            body: r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#.into(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub latency: Duration,
    pub concurrency_cap: Option<usize>,
    pub over_cap: OverCap,
    /// Share of calls answered 500.
    pub error_5xx_rate: f64,
    /// Share of calls whose output is not JSON.
    pub malformed_rate: f64,
    /// Add one finding whose path is not in the diff and one whose line is in no hunk.
    pub outside_diff: bool,
    /// Refuse a `response_format` schema this dialect's provider would refuse, with
    /// that provider's 400 answer.
    pub enforce_dialect: Option<SchemaDialect>,
    /// Rate limits by requests and tokens per minute, answered with that provider's
    /// headers and 429s (`simmeter`); the usage then counts what was sent and answered.
    pub limits: Option<crate::simmeter::SimLimits>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            latency: Duration::ZERO,
            concurrency_cap: None,
            over_cap: OverCap::Queue,
            error_5xx_rate: 0.0,
            malformed_rate: 0.0,
            outside_diff: false,
            enforce_dialect: None,
            limits: None,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct Stats {
    pub total_calls: u64,
    /// Calls per job id (`x-reviewlane-job-id`), every answer counted.
    pub calls_by_job: BTreeMap<String, u64>,
    /// Calls answered 200 per job id: the paid ones.
    pub paid_by_job: BTreeMap<String, u64>,
    pub calls_429: u64,
    pub calls_5xx: u64,
    pub max_concurrent: usize,
    /// Start times of calls (ms since the server started), per job id.
    pub call_times_ms: BTreeMap<String, Vec<u64>>,
    /// Canaries (see `start_with`) found in prompts.
    pub canaries_seen: Vec<String>,
    /// Call start times (ms since start) per bearer key, to tell callers apart in tests.
    pub call_times_by_key: BTreeMap<String, Vec<u64>>,
    /// Calls in flight when each call started, and its start time: (start_ms, end_ms).
    pub call_spans_ms: Vec<(u64, u64)>,
    /// Calls and paid calls per part of a split review (`<job id>/<part>`, from
    /// `x-reviewlane-part`).
    pub calls_by_part: BTreeMap<String, u64>,
    pub paid_by_part: BTreeMap<String, u64>,
    /// Every paid answer: job id, bearer key (one per extractor replica), and when it was
    /// sent (ms since the Unix epoch) — to tell a repeat caused by a fault on the
    /// caller from one that should not have happened.
    pub paid_calls: Vec<PaidCall>,
    /// Shape of the last request, without content: model, response_format type and
    /// json_schema strictness, whether a bearer key came.
    pub last_request: Option<RequestShape>,
    /// Calls refused with 400 for a schema the enforced dialect does not accept.
    pub schemas_refused: u64,
    /// With `limits`: tokens the account charged at the calls' start (prompt and output
    /// limit), and input tokens alone.
    #[serde(default)]
    pub tokens_charged: u64,
    #[serde(default)]
    pub input_tokens_charged: u64,
}

#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct PaidCall {
    pub job: String,
    pub key: String,
    pub started_unix_ms: u64,
    pub answered_unix_ms: u64,
    /// The same two instants in microseconds since the provider started (`epoch`).
    pub started_us: u64,
    pub answered_us: u64,
}

#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct RequestShape {
    pub model: String,
    pub response_format: String,
    pub strict: bool,
    pub schema_has_findings: bool,
    pub bearer: bool,
}

struct State {
    config: SimConfig,
    /// The OpenAI Batch API's files and batches (`simbatch`).
    batches: Mutex<crate::simbatch::Batches>,
    /// Where a held batch create waits (`release_batches`).
    batch_gate: tokio::sync::Notify,
    slots: Option<Arc<Semaphore>>,
    in_flight: AtomicUsize,
    stats: Mutex<Stats>,
    script: Mutex<VecDeque<Scripted>>,
    throttled: Mutex<Option<u64>>,
    /// Headers every 200 carries (a provider's rate-limit readings).
    answer_headers: Mutex<Vec<(String, String)>>,
    started: Instant,
    canaries: Vec<String>,
    meter: Option<Mutex<crate::simmeter::SimMeter>>,
}

/// A running simulated provider; stops when dropped.
pub struct SimProvider {
    addr: SocketAddr,
    state: Arc<State>,
    _server: crate::http::Server,
}

impl SimProvider {
    pub async fn start(config: SimConfig) -> SimProvider {
        Self::start_with(config, Vec::new()).await
    }

    /// `canaries`: strings to watch for in prompts; `stats().canaries_seen` lists hits.
    pub async fn start_with(config: SimConfig, canaries: Vec<String>) -> SimProvider {
        Self::start_on("127.0.0.1:0".parse().expect("addr"), config, canaries).await.expect("bind 127.0.0.1:0")
    }

    /// A simulated provider listening on `addr`.
    pub async fn start_on(addr: SocketAddr, config: SimConfig, canaries: Vec<String>) -> std::io::Result<SimProvider> {
        let state = Arc::new(State {
            slots: config.concurrency_cap.map(|n| Arc::new(Semaphore::new(n))),
            meter: config.limits.map(|l| Mutex::new(crate::simmeter::SimMeter::new(l))),
            batches: Mutex::default(),
            batch_gate: tokio::sync::Notify::new(),
            config,
            in_flight: AtomicUsize::new(0),
            stats: Mutex::new(Stats::default()),
            script: Mutex::new(VecDeque::new()),
            throttled: Mutex::new(None),
            answer_headers: Mutex::new(Vec::new()),
            started: Instant::now(),
            canaries,
        });
        let st = state.clone();
        let server = crate::http::serve_on(addr, move |req| handle(st.clone(), req)).await?;
        Ok(SimProvider { addr: server.addr, state, _server: server })
    }

    /// Base URL for an OpenAI-compatible client: `http://127.0.0.1:port/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How the simulated account runs batches from now on (`simbatch`).
    pub fn script_batches(&self, script: crate::simbatch::BatchScript) {
        self.state.batches.lock().expect("batches lock").script = script;
    }

    /// The clock the batch stats' 429 times are read from (the system's by default).
    pub fn set_batch_clock(&self, clock: reviewlane_core::clock::SharedClock) {
        self.state.batches.lock().expect("batches lock").clock = Some(clock);
    }

    /// Lets a held batch create go on (`BatchScript::hold_create`).
    pub fn release_batches(&self) {
        self.state.batch_gate.notify_waiters();
    }

    /// What the simulated account saw of batches.
    pub fn batch_stats(&self) -> crate::simbatch::BatchStats {
        self.state.batches.lock().expect("batches lock").stats.clone()
    }

    /// Calls in flight now (a call whose caller went away is not).
    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// The instant the `_us` times of `PaidCall` count from.
    pub fn epoch(&self) -> Instant {
        self.state.started
    }

    pub fn stats(&self) -> Stats {
        self.state.stats.lock().expect("stats lock").clone()
    }

    /// While set, every call is answered 429 with `retry-after` of this many seconds (a
    /// provider-wide burst of throttling).
    pub fn set_throttled(&self, retry_after_secs: Option<u64>) {
        *self.state.throttled.lock().expect("throttle lock") = retry_after_secs;
    }

    /// Every 200 from now on carries these headers (e.g. `x-ratelimit-remaining-tokens`).
    pub fn set_answer_headers(&self, headers: Vec<(String, String)>) {
        *self.state.answer_headers.lock().expect("headers lock") = headers;
    }

    /// Queues scripted answers, used in order before the knobs apply.
    pub fn script(&self, answers: impl IntoIterator<Item = Scripted>) {
        self.state.script.lock().expect("script lock").extend(answers);
    }
}

fn respond(status: StatusCode, headers: &[(String, String)], body: String) -> Response<Full<Bytes>> {
    let mut b = Response::builder().status(status).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(k.as_str(), v.as_str());
    }
    b.body(Full::new(Bytes::from(body))).expect("response builds")
}

fn chat_completion(output: &str, (input, produced): (u64, u64)) -> String {
    json!({
        "id": "chatcmpl-sim",
        "object": "chat.completion",
        "model": "sim",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": output}}],
        "usage": {"prompt_tokens": input, "completion_tokens": produced, "total_tokens": input + produced},
    })
    .to_string()
}

/// The 400 body the provider of `dialect` answers a schema it refuses with.
fn schema_refusal(dialect: SchemaDialect, refused: &[String]) -> String {
    match dialect {
        SchemaDialect::Anthropic => json!({
            "type": "error",
            "error": {"type": "invalid_request_error", "message": format!("output_format.schema: {}", refused[0])},
        }),
        _ => json!({"error": {
            "message": format!("Invalid schema for response_format: {}", refused[0]),
            "type": "invalid_request_error",
            "param": "response_format",
            "code": "invalid_json_schema",
        }}),
    }
    .to_string()
}

async fn handle(st: Arc<State>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() == hyper::Method::GET && req.uri().path() == "/stats" {
        let body = serde_json::to_string(&*st.stats.lock().expect("stats lock")).expect("stats serialize");
        return Ok(respond(StatusCode::OK, &[], body));
    }
    let path = req.uri().path().to_string();
    if path == "/v1/batches"
        || path.starts_with("/v1/batches/")
        || path.starts_with("/v1/files")
        || path.starts_with("/v1/messages/batches")
    {
        return Ok(batches(st, req).await);
    }
    // OpenAI-compatible chat completions, or Anthropic's Messages API (the answer then
    // comes as a `tool_use` block, the key as `x-api-key`).
    let anthropic = match req.uri().path() {
        "/v1/chat/completions" => false,
        "/v1/messages" => true,
        _ => return Ok(respond(StatusCode::NOT_FOUND, &[], "{}".into())),
    };
    if req.method() != hyper::Method::POST {
        return Ok(respond(StatusCode::NOT_FOUND, &[], "{}".into()));
    }
    let job = req.headers().get(JOB_ID_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let part = req.headers().get(PART_HEADER).and_then(|v| v.to_str().ok()).map(|p| format!("{job}/{p}"));
    let key = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::to_string);
    let bearer = key.is_some();
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let prompt = request["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string();
    let shape = RequestShape {
        model: request["model"].as_str().unwrap_or_default().to_string(),
        response_format: if anthropic {
            request["tool_choice"]["type"].as_str().map(|t| format!("tool_choice:{t}")).unwrap_or_default()
        } else {
            request["response_format"]["type"].as_str().unwrap_or_default().to_string()
        },
        strict: request["response_format"]["json_schema"]["strict"].as_bool().unwrap_or(false),
        schema_has_findings: schema_of(&request, anthropic)["properties"]["findings"].is_object(),
        bearer,
    };
    {
        let mut s = st.stats.lock().expect("stats lock");
        s.total_calls += 1;
        s.last_request = Some(shape);
        *s.calls_by_job.entry(job.clone()).or_default() += 1;
        if let Some(p) = &part {
            *s.calls_by_part.entry(p.clone()).or_default() += 1;
        }
        let at = st.started.elapsed().as_millis() as u64;
        s.call_times_ms.entry(job.clone()).or_default().push(at);
        s.call_times_by_key.entry(key.clone().unwrap_or_default()).or_default().push(at);
        for c in &st.canaries {
            if prompt.contains(c.as_str()) && !s.canaries_seen.contains(c) {
                s.canaries_seen.push(c.clone());
            }
        }
    }

    if let Some(dialect) = st.config.enforce_dialect {
        let refused = schema_dialect::violations(schema_of(&request, anthropic), dialect);
        if !refused.is_empty() {
            st.stats.lock().expect("stats lock").schemas_refused += 1;
            return Ok(respond(StatusCode::BAD_REQUEST, &[], schema_refusal(dialect, &refused)));
        }
    }

    let throttled = *st.throttled.lock().expect("throttle lock");
    if let Some(secs) = throttled {
        st.stats.lock().expect("stats lock").calls_429 += 1;
        let body =
            json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}});
        return Ok(respond(
            StatusCode::TOO_MANY_REQUESTS,
            &[("retry-after".into(), secs.to_string())],
            body.to_string(),
        ));
    }

    // The account's buckets: refused with that provider's 429 when a cost does not fit.
    let input_tokens = crate::simmeter::count(body.len());
    let max_tokens = request["max_tokens"].as_u64().unwrap_or(0);
    let charged = match &st.meter {
        None => None,
        Some(meter) => {
            let mut m = meter.lock().expect("meter lock");
            match m.admit(input_tokens, max_tokens) {
                Ok(charged) => {
                    let mut s = st.stats.lock().expect("stats lock");
                    s.tokens_charged += input_tokens + max_tokens;
                    s.input_tokens_charged += input_tokens;
                    Some(charged)
                }
                Err(short) => {
                    st.stats.lock().expect("stats lock").calls_429 += 1;
                    let mut headers = m.headers();
                    if m.style() == crate::simmeter::MeterStyle::Anthropic {
                        let wait = m.wait(short, input_tokens, max_tokens).as_secs_f64().ceil().max(1.0);
                        headers.push(("retry-after".into(), format!("{wait}")));
                    }
                    return Ok(respond(StatusCode::TOO_MANY_REQUESTS, &headers, m.refusal(short)));
                }
            }
        }
    };

    // Admission at the cap.
    let _permit = match &st.slots {
        None => None,
        Some(slots) => match &st.config.over_cap {
            OverCap::Queue => Some(slots.clone().acquire_owned().await.expect("semaphore open")),
            OverCap::Reject { headers } => match slots.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    st.stats.lock().expect("stats lock").calls_429 += 1;
                    let body = json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}});
                    return Ok(respond(StatusCode::TOO_MANY_REQUESTS, headers, body.to_string()));
                }
            },
        },
    };
    let now = st.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    // Counted out when the call ends, or when its caller goes away mid-call (the
    // connection closes and this handler is dropped).
    struct Running<'a>(&'a AtomicUsize);
    impl Drop for Running<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let running = Running(&st.in_flight);
    {
        let mut s = st.stats.lock().expect("stats lock");
        s.max_concurrent = s.max_concurrent.max(now);
    }
    let scripted = st.script.lock().expect("script lock").pop_front();
    let began = st.started.elapsed().as_millis() as u64;
    let began_us = st.started.elapsed().as_micros() as u64;
    let started_unix_ms = reviewlane_shared::telemetry::now_ms();
    // An instant provider answers at once (a zero sleep would still wait for the next
    // timer tick, about a millisecond).
    if !st.config.latency.is_zero() {
        tokio::time::sleep(st.config.latency).await;
    }
    drop(running);
    st.stats.lock().expect("stats lock").call_spans_ms.push((began, st.started.elapsed().as_millis() as u64));

    let output = match scripted {
        Some(Scripted::Status { status, headers, body }) => {
            let mut s = st.stats.lock().expect("stats lock");
            match status {
                429 => s.calls_429 += 1,
                500..=599 => s.calls_5xx += 1,
                _ => {}
            }
            return Ok(respond(
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                &headers,
                body,
            ));
        }
        Some(Scripted::Output(text)) => text,
        None => {
            if rand::random::<f64>() < st.config.error_5xx_rate {
                st.stats.lock().expect("stats lock").calls_5xx += 1;
                return Ok(respond(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &[],
                    "{\"error\":{\"message\":\"overloaded\"}}".into(),
                ));
            }
            if rand::random::<f64>() < st.config.malformed_rate {
                "Sure! Here are the findings: [oops".to_string()
            } else {
                model_output(&st, &request, anthropic, &prompt)
            }
        }
    };
    {
        let mut s = st.stats.lock().expect("stats lock");
        *s.paid_by_job.entry(job.clone()).or_default() += 1;
        if let Some(p) = part {
            *s.paid_by_part.entry(p).or_default() += 1;
        }
        s.paid_calls.push(PaidCall {
            job,
            key: key.unwrap_or_default(),
            started_unix_ms,
            answered_unix_ms: reviewlane_shared::telemetry::now_ms(),
            started_us: began_us,
            answered_us: st.started.elapsed().as_micros() as u64,
        });
    }
    let mut headers = st.answer_headers.lock().expect("headers lock").clone();
    let usage = match (&st.meter, charged) {
        (Some(meter), Some(charged)) => {
            let produced = crate::simmeter::count(output.len());
            let mut m = meter.lock().expect("meter lock");
            m.settle(charged, produced);
            headers.extend(m.headers());
            (input_tokens, produced)
        }
        _ => (100, 50),
    };
    let body = if anthropic { anthropic_message(&output, usage) } else { chat_completion(&output, usage) };
    Ok(respond(StatusCode::OK, &headers, body))
}

/// The batch endpoints (`simbatch`): OpenAI's Batch API (an upload is read before the
/// files are locked) and Anthropic's Message Batches; each line is answered as the
/// provider's synchronous endpoint would. A scripted 429 comes before anything else.
/// The batch work (a poll that ends a batch answers every line of it) runs on the
/// blocking pool: a provider's batches do not hold up its synchronous endpoint, and
/// here they would hold a worker of the runtime the chat calls are served on.
async fn batches(st: Arc<State>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or_default().to_string();
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let (content_type, host) = (header("content-type"), header("host"));
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    if let Some(throttled) = st.batches.lock().expect("batches lock").gate(method.as_str(), &path) {
        return throttled;
    }
    if method == hyper::Method::POST && path == "/v1/files" {
        let upload = crate::simbatch::parse_upload(&content_type, body).await;
        return st.batches.lock().expect("batches lock").upload(upload);
    }
    let anthropic = path.starts_with("/v1/messages/batches");
    let create = method == hyper::Method::POST && (path == "/v1/batches" || path == "/v1/messages/batches");
    let released = st.batch_gate.notified();
    tokio::pin!(released);
    let hold = match create {
        true => {
            let mut batches = st.batches.lock().expect("batches lock");
            let hold = batches.script.hold_create.take();
            if hold.is_some() {
                // Waiting before the hold shows: a release cannot come too early.
                released.as_mut().enable();
                batches.stats.creates_held += 1;
                batches.unread_next = hold == Some(crate::simbatch::HoldCreate::After);
            }
            hold
        }
        false => None,
    };
    if hold == Some(crate::simbatch::HoldCreate::Before) {
        released.await;
        let mut r = Response::new(Full::new(Bytes::from_static(b"{}")));
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        return r;
    }
    let work = Arc::clone(&st);
    let answered = tokio::task::spawn_blocking(move || {
        let st = &*work;
        let answer = |request: &serde_json::Value| {
            let prompt = request["messages"]
                .as_array()
                .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
                .and_then(|m| m["content"].as_str())
                .unwrap_or_default();
            model_output(st, request, anthropic, prompt)
        };
        let mut batches = st.batches.lock().expect("batches lock");
        if anthropic {
            let base = format!("http://{host}");
            batches.handle_messages(&method, &path, &query, &base, body, &answer)
        } else {
            batches.handle(&method, &path, &query, body, &answer)
        }
    })
    .await
    .expect("the batch endpoints do not panic");
    if hold == Some(crate::simbatch::HoldCreate::After) {
        released.await;
    }
    answered
}

/// What the model answers a request showing `prompt`: a finding per file (`findings_for`),
/// in the shape the request's schema asks for.
fn model_output(st: &State, request: &serde_json::Value, anthropic: bool, prompt: &str) -> String {
    let item = &schema_of(request, anthropic)["properties"]["findings"]["items"];
    let mut out = findings_for(prompt, st.config.outside_diff);
    if item["properties"]["suggested_action"].is_object() {
        actionable(&mut out);
    }
    strict_nulls(&mut out, item);
    out.to_string()
}

/// The JSON Schema a request asks the answer to follow.
fn schema_of(request: &serde_json::Value, anthropic: bool) -> &serde_json::Value {
    if anthropic { &request["tools"][0]["input_schema"] } else { &request["response_format"]["json_schema"]["schema"] }
}

/// An Anthropic Messages answer: the output as the input of a `report_findings` tool
/// call when it is a JSON object, else as text.
fn anthropic_message(output: &str, (input, produced): (u64, u64)) -> String {
    let block = match serde_json::from_str::<serde_json::Value>(output) {
        Ok(v) if v.is_object() => json!({"type": "tool_use", "id": "toolu_sim", "name": "report_findings", "input": v}),
        _ => json!({"type": "text", "text": output}),
    };
    json!({
        "id": "msg_sim",
        "type": "message",
        "role": "assistant",
        "model": "sim",
        "content": [block],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": input, "output_tokens": produced},
    })
    .to_string()
}

/// Makes `findings_for`'s answer a `findings.v2` one: each finding gets a suggested
/// action and a confidence.
pub fn actionable(out: &mut serde_json::Value) {
    for f in out["findings"].as_array_mut().into_iter().flatten() {
        f["suggested_action"] = json!("Look at this line again.");
        f["confidence"] = json!("medium");
    }
}

/// As a strict structured-output provider answers: every property the schema lists as
/// required is present, the ones the model has nothing for as `null`.
fn strict_nulls(out: &mut serde_json::Value, item: &serde_json::Value) {
    let required: Vec<&str> =
        item["required"].as_array().into_iter().flatten().filter_map(serde_json::Value::as_str).collect();
    for f in out["findings"].as_array_mut().into_iter().flatten() {
        for name in &required {
            if f.get(*name).is_none() {
                f[*name] = serde_json::Value::Null;
            }
        }
    }
}

/// One finding per file with an added line, at its first added line, quoting it; plus
/// two that point outside the diff when asked.
pub fn findings_for(diff_text: &str, outside_diff: bool) -> serde_json::Value {
    let mut findings = Vec::new();
    if let Ok(diff) = reviewlane_core::diff::parse(diff_text) {
        let mut seen = std::collections::HashSet::new();
        for (file, _, line) in diff.added_lines() {
            let Some(path) = file.new_path.as_deref() else { continue };
            if line.text.trim().is_empty() || !seen.insert(path.to_string()) {
                continue;
            }
            findings.push(json!({
                "path": path, "line": line.new_line, "severity": "low", "category": "maintainability",
                "title": "Simulated finding", "message": "The simulated provider points at the first added line.",
                "evidence": line.text.trim(),
            }));
        }
        if outside_diff
            && let Some((file, _, line)) =
                diff.added_lines().find(|(f, _, l)| f.new_path.is_some() && !l.text.trim().is_empty())
        {
            let path = file.new_path.clone().unwrap_or_default();
            findings.push(json!({
                "path": "not/in/the/diff.rs", "line": 1, "severity": "high", "category": "correctness",
                "title": "Outside the diff", "message": "A path the diff does not touch.", "evidence": line.text.trim(),
            }));
            findings.push(json!({
                "path": path, "line": 999_999, "severity": "high", "category": "correctness",
                "title": "Outside every hunk", "message": "A line no hunk covers.", "evidence": line.text.trim(),
            }));
        }
    }
    json!({ "findings": findings })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn http(addr: SocketAddr, request: String) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    fn chat(job: &str, diff: &str) -> String {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": diff}]}).to_string();
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\nx-reviewlane-job-id: {job}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    #[tokio::test]
    async fn answers_findings_rejects_over_the_cap_and_counts_over_http() {
        let sim = SimProvider::start(SimConfig {
            latency: Duration::from_millis(300),
            concurrency_cap: Some(1),
            over_cap: OverCap::Reject { headers: vec![("retry-after".into(), "2".into())] },
            ..Default::default()
        })
        .await;
        let diff = "--- a/x.rs\n+++ b/x.rs\n@@ -1 +1,2 @@\n a\n+let b = c;\n";
        let (first, second) = tokio::join!(http(sim.addr(), chat("j1", diff)), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            http(sim.addr(), chat("j2", diff)).await
        });
        assert!(first.starts_with("HTTP/1.1 200"), "{first}");
        assert!(first.contains("let b = c;"), "a finding quoting the added line");
        assert!(second.starts_with("HTTP/1.1 429"), "{second}");
        assert!(second.to_ascii_lowercase().contains("retry-after: 2"));

        let stats = http(sim.addr(), "GET /stats HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".into()).await;
        let body = stats.split("\r\n\r\n").nth(1).unwrap();
        let s: Stats = serde_json::from_str(body).unwrap();
        assert_eq!(s.calls_by_job.get("j1"), Some(&1));
        assert_eq!(s.calls_by_job.get("j2"), Some(&1));
        assert_eq!(s.paid_by_job.get("j2"), None);
        assert_eq!((s.calls_429, s.max_concurrent, s.total_calls), (1, 1, 2));
    }

    #[tokio::test]
    async fn queues_over_the_cap_and_fails_on_request() {
        let sim = SimProvider::start(SimConfig {
            latency: Duration::from_millis(100),
            concurrency_cap: Some(2),
            error_5xx_rate: 0.0,
            ..Default::default()
        })
        .await;
        let diff = "--- a/x.rs\n+++ b/x.rs\n@@ -1 +1,2 @@\n a\n+b\n";
        let calls = (0..5).map(|i| http(sim.addr(), chat(&format!("q{i}"), diff)));
        for r in futures::future::join_all(calls).await {
            assert!(r.starts_with("HTTP/1.1 200"));
        }
        assert_eq!(sim.stats().max_concurrent, 2);

        let broken = SimProvider::start(SimConfig { error_5xx_rate: 1.0, ..Default::default() }).await;
        assert!(http(broken.addr(), chat("x", diff)).await.starts_with("HTTP/1.1 500"));
        let malformed = SimProvider::start(SimConfig { malformed_rate: 1.0, ..Default::default() }).await;
        let r = http(malformed.addr(), chat("y", diff)).await;
        assert!(r.starts_with("HTTP/1.1 200") && r.contains("[oops"));
    }
}
