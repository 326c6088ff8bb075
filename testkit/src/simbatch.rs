//! The simulated provider's OpenAI Batch API: `/v1/files` (a multipart upload with
//! purpose `batch`, and the content of a file) and `/v1/batches` (create, get, list,
//! cancel).
//!
//! A batch moves one step each time it is read, so a test drives it by polling, with
//! no clock: `validating` for `validate_polls` reads, `in_progress` for
//! `progress_polls` (its counts rising), `finalizing` for `finalize_polls`, then
//! `completed` with its output and error files. Each line is answered as the
//! synchronous endpoint would answer its body (the same findings), unless the script
//! says otherwise for its custom id: a status (4xx, 5xx) or `expired`. A batch can also
//! fail whole at validation (`token_limit_exceeded`), expire while in progress, or be
//! cancelled; then the lines that ran are in the output file and the others are
//! `batch_expired` or `batch_cancelled` in the error file. Output lines come in reverse
//! order (a reader must never trust the order), and a line can be scripted to be cut
//! off (not JSON); the error file id is `""` when no line failed, and the output file
//! id `null` when every line did. A 429 can be scripted on
//! the batch endpoints too.
//!
//! Anthropic's Message Batches API (`/v1/messages/batches`) runs alike: requests inline,
//! `in_progress` for `progress_polls` reads (a cancel: `canceling`, then ended with what
//! ran), then `ended` with a `results_url`; each result `succeeded` (billed), `errored`
//! (a scripted 4xx as `invalid_request_error`, a 5xx as `api_error`), `canceled` or
//! `expired`, in reverse order.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Response, StatusCode};
use serde::Serialize;
use serde_json::{Value, json};

/// How the simulated account runs batches.
#[derive(Debug, Clone)]
pub struct BatchScript {
    pub validate_polls: u32,
    pub progress_polls: u32,
    pub finalize_polls: u32,
    /// Per custom id, how its line is answered instead of a success.
    pub lines: HashMap<String, LineFault>,
    /// Fail every batch at validation with this error code (`token_limit_exceeded`).
    pub fail_with: Option<String>,
    /// Expire every batch halfway through its progress.
    pub expire: bool,
    /// Answer this many requests to the batch endpoints 429 first.
    pub throttle_requests: u32,
    /// Hold the next create until `SimProvider::release_batches` (so a test can kill
    /// its caller there): before the batch exists (it is then never created), or after
    /// it is created and before the answer.
    pub hold_create: Option<HoldCreate>,
}

/// Where a held create waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldCreate {
    /// The request arrived; no batch is made (its caller died before the create).
    Before,
    /// The batch is made; its answer waits (its caller dies before it records the id).
    After,
}

impl Default for BatchScript {
    fn default() -> Self {
        BatchScript {
            validate_polls: 1,
            progress_polls: 2,
            finalize_polls: 1,
            lines: HashMap::new(),
            fail_with: None,
            expire: false,
            throttle_requests: 0,
            hold_create: None,
        }
    }
}

/// A line answered otherwise than with a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineFault {
    Status(u16),
    /// An error that is no HTTP answer (OpenAI: a line of the error file with
    /// `"response": null` and `error.code`, such as `request_timeout`; Anthropic: an
    /// `errored` result whose error has this type).
    Error(&'static str),
    Expired,
    /// Its line is not JSON: it names no item.
    Malformed,
}

/// What the simulated account saw of batches.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct BatchStats {
    pub files_uploaded: u64,
    pub batches_created: u64,
    /// Lines answered with a success (the billed ones), per custom id.
    pub paid_lines: BTreeMap<String, u64>,
    pub throttled: u64,
    /// Creates held (`BatchScript::hold_create`).
    pub creates_held: u64,
    /// Most batches running at once (counted at each create).
    pub max_running: u64,
    /// Request lines in every batch created (items sent again count again).
    pub lines_received: u64,
}

#[derive(Default)]
pub(crate) struct Batches {
    files: HashMap<String, (String, Bytes)>,
    batches: BTreeMap<String, Batch>,
    /// Anthropic's message batches.
    messages: BTreeMap<String, MessageBatch>,
    next: u64,
    pub(crate) script: BatchScript,
    pub(crate) stats: BatchStats,
}

/// An Anthropic message batch: its requests inline, and its results once ended.
struct MessageBatch {
    id: String,
    requests: Vec<Value>,
    status: &'static str,
    reads: u32,
    created_at: u64,
    cancel_requested: bool,
    results: Option<Vec<Value>>,
}

struct Batch {
    id: String,
    input_file_id: String,
    metadata: Value,
    status: &'static str,
    reads: u32,
    created_at: u64,
    total: usize,
    completed: usize,
    failed: usize,
    output_file_id: Option<String>,
    error_file_id: String,
    errors: Option<Value>,
}

/// The file of a `multipart/form-data` upload with purpose `batch`: its name and bytes.
pub(crate) async fn parse_upload(content_type: &str, body: Bytes) -> Option<(String, Bytes)> {
    let boundary = multer::parse_boundary(content_type).ok()?;
    let stream = futures::stream::once(async move { Ok::<Bytes, std::convert::Infallible>(body) });
    let mut form = multer::Multipart::new(stream, boundary);
    let (mut purpose, mut file) = (None, None);
    while let Some(field) = form.next_field().await.ok()? {
        match field.name() {
            Some("purpose") => purpose = Some(field.text().await.ok()?),
            Some("file") => {
                let name = field.file_name().unwrap_or_default().to_string();
                file = Some((name, field.bytes().await.ok()?));
            }
            _ => {}
        }
    }
    file.filter(|_| purpose.as_deref() == Some("batch"))
}

fn respond(status: StatusCode, body: Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("response builds")
}

impl Batches {
    /// Counts the batches running with `new` more.
    fn note_running(&mut self, new: u64) {
        let openai = self
            .batches
            .values()
            .filter(|b| matches!(b.status, "validating" | "in_progress" | "finalizing" | "cancelling"))
            .count();
        let anthropic = self.messages.values().filter(|b| b.status != "ended").count();
        self.stats.max_running = self.stats.max_running.max(openai as u64 + anthropic as u64 + new);
    }

    fn id(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}-sim{:06}", self.next)
    }

    fn throttle(&mut self) -> Response<Full<Bytes>> {
        self.script.throttle_requests -= 1;
        self.stats.throttled += 1;
        let error = json!({"error": {"message": "Rate limit reached for requests", "type": "requests"}});
        let mut r = respond(StatusCode::TOO_MANY_REQUESTS, error);
        r.headers_mut().insert("retry-after", hyper::header::HeaderValue::from_static("1"));
        r
    }

    /// Serves one request to `/v1/files/…` or `/v1/batches…` other than an upload;
    /// `answer` answers one line's body as the synchronous endpoint would.
    pub(crate) fn handle(
        &mut self,
        method: &hyper::Method,
        path: &str,
        query: &str,
        body: Bytes,
        answer: &dyn Fn(&Value) -> String,
    ) -> Response<Full<Bytes>> {
        if self.script.throttle_requests > 0 {
            return self.throttle();
        }
        let segments: Vec<&str> = path.trim_start_matches("/v1/").split('/').collect();
        match (method.as_str(), segments.as_slice()) {
            ("GET", ["files", id, "content"]) => match self.files.get(*id) {
                Some((_, bytes)) => Response::new(Full::new(bytes.clone())),
                None => respond(StatusCode::NOT_FOUND, json!({"error": {"message": "No such file"}})),
            },
            ("POST", ["batches"]) => self.create(&body),
            ("GET", ["batches"]) => self.list(query),
            ("GET", ["batches", id]) => match self.batches.contains_key(*id) {
                true => {
                    self.advance(id, answer);
                    respond(StatusCode::OK, self.object(id))
                }
                false => respond(StatusCode::NOT_FOUND, json!({"error": {"message": "No such batch"}})),
            },
            ("POST", ["batches", id, "cancel"]) => self.cancel(id, answer),
            _ => respond(StatusCode::NOT_FOUND, json!({"error": {"message": "unknown endpoint"}})),
        }
    }

    /// Keeps an uploaded file (`parse_upload`'s); refuses anything else.
    pub(crate) fn upload(&mut self, upload: Option<(String, Bytes)>) -> Response<Full<Bytes>> {
        if self.script.throttle_requests > 0 {
            return self.throttle();
        }
        let Some((name, bytes)) = upload else {
            return respond(StatusCode::BAD_REQUEST, json!({"error": {"message": "a file with purpose batch"}}));
        };
        let id = self.id("file");
        self.stats.files_uploaded += 1;
        let object = json!({"id": id, "object": "file", "bytes": bytes.len(), "filename": name, "purpose": "batch"});
        self.files.insert(id, (name, bytes));
        respond(StatusCode::OK, object)
    }

    fn create(&mut self, body: &[u8]) -> Response<Full<Bytes>> {
        let req: Value = serde_json::from_slice(body).unwrap_or_default();
        let input = req["input_file_id"].as_str().unwrap_or_default().to_string();
        let Some((_, bytes)) = self.files.get(&input) else {
            return respond(StatusCode::BAD_REQUEST, json!({"error": {"message": "unknown input_file_id"}}));
        };
        if req["endpoint"] != "/v1/chat/completions" || req["completion_window"] != "24h" {
            return respond(StatusCode::BAD_REQUEST, json!({"error": {"message": "endpoint or window"}}));
        }
        let total = bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()).count();
        let id = self.id("batch");
        self.stats.batches_created += 1;
        self.stats.lines_received += total as u64;
        self.note_running(1);
        let created_at = self.next;
        self.batches.insert(
            id.clone(),
            Batch {
                id: id.clone(),
                input_file_id: input,
                metadata: req["metadata"].clone(),
                status: "validating",
                reads: 0,
                created_at,
                total,
                completed: 0,
                failed: 0,
                output_file_id: None,
                error_file_id: String::new(),
                errors: None,
            },
        );
        respond(StatusCode::OK, self.object(&id))
    }

    fn list(&self, query: &str) -> Response<Full<Bytes>> {
        let param = |name: &str| {
            query.split('&').find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
        };
        let limit: usize = param("limit").and_then(|l| l.parse().ok()).unwrap_or(20);
        let after = param("after");
        // Newest first, as the API lists.
        let mut all: Vec<&Batch> = self.batches.values().collect();
        all.sort_by_key(|b| std::cmp::Reverse(b.created_at));
        let start = after.and_then(|a| all.iter().position(|b| b.id == a).map(|p| p + 1)).unwrap_or(0);
        let page: Vec<Value> = all.iter().skip(start).take(limit).map(|b| self.object(&b.id)).collect();
        let has_more = start + page.len() < all.len();
        respond(StatusCode::OK, json!({"object": "list", "data": page, "has_more": has_more}))
    }

    fn cancel(&mut self, id: &str, answer: &dyn Fn(&Value) -> String) -> Response<Full<Bytes>> {
        let Some(b) = self.batches.get(id) else {
            return respond(StatusCode::NOT_FOUND, json!({"error": {"message": "No such batch"}}));
        };
        if matches!(b.status, "validating" | "in_progress" | "finalizing") {
            let ran = if b.status == "validating" { 0 } else { b.completed.max(b.total / 2) };
            self.finish(id, "cancelled", ran, "batch_cancelled", answer);
        }
        respond(StatusCode::OK, self.object(id))
    }

    /// One read of the batch: it moves one step.
    fn advance(&mut self, id: &str, answer: &dyn Fn(&Value) -> String) {
        let script = self.script.clone();
        let polls = script.progress_polls.max(1);
        let b = self.batches.get_mut(id).expect("checked");
        b.reads += 1;
        let end = match b.status {
            "validating" if b.reads >= script.validate_polls => {
                match &script.fail_with {
                    Some(code) => {
                        b.status = "failed";
                        b.errors = Some(
                            json!({"object": "list", "data": [{"code": code, "message": "simulated", "line": null}]}),
                        );
                    }
                    None => {
                        b.status = "in_progress";
                        b.reads = 0;
                    }
                }
                None
            }
            "in_progress" => {
                b.completed = b.total * b.reads.min(polls) as usize / polls as usize;
                if script.expire && b.reads * 2 >= polls {
                    Some(("expired", b.total / 2, "batch_expired"))
                } else {
                    if b.reads >= polls {
                        b.status = "finalizing";
                        b.reads = 0;
                    }
                    None
                }
            }
            "finalizing" if b.reads >= script.finalize_polls => Some(("completed", b.total, "")),
            _ => None,
        };
        if let Some((status, ran, code)) = end {
            self.finish(id, status, ran, code, answer);
        }
    }

    /// Ends the batch as `status`: its first `ran` lines answered (or failed as
    /// scripted), the rest in the error file with `code`.
    fn finish(&mut self, id: &str, status: &'static str, ran: usize, code: &str, answer: &dyn Fn(&Value) -> String) {
        let input = self.batches[id].input_file_id.clone();
        let lines: Vec<Value> = self.files[&input]
            .1
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap_or_default())
            .collect();
        let (mut output, mut errors) = (Vec::new(), Vec::new());
        for (i, line) in lines.iter().enumerate() {
            let custom_id = line["custom_id"].as_str().unwrap_or_default().to_string();
            let req_id = format!("batch_req_{i}");
            let fault = self.script.lines.get(&custom_id).copied();
            if i >= ran || fault == Some(LineFault::Expired) {
                let code = if fault == Some(LineFault::Expired) { "batch_expired" } else { code };
                errors.push(json!({"id": req_id, "custom_id": custom_id, "response": null, "error": {"code": code, "message": "not run"}}));
                continue;
            }
            match fault {
                Some(LineFault::Error(code)) => errors.push(json!({
                    "id": req_id, "custom_id": custom_id, "response": null,
                    "error": {"code": code, "message": "simulated"},
                })),
                Some(LineFault::Malformed) => output.push(Value::String("{\"custom_id\": \"cut off".into())),
                Some(LineFault::Status(status)) => errors.push(json!({
                    "id": req_id, "custom_id": custom_id, "error": null,
                    "response": {"status_code": status, "request_id": req_id, "body": {"error": {"message": "simulated", "type": if status < 500 { "invalid_request_error" } else { "server_error" }}}},
                })),
                _ => {
                    let out = answer(&line["body"]);
                    *self.stats.paid_lines.entry(custom_id.clone()).or_default() += 1;
                    output.push(json!({
                        "id": req_id, "custom_id": custom_id, "error": null,
                        "response": {"status_code": 200, "request_id": req_id, "body": {
                            "object": "chat.completion", "model": "sim",
                            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": out}}],
                            "usage": {"prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150},
                        }},
                    }));
                }
            }
        }
        // The order of the lines is not the input's.
        output.reverse();
        let file = |ids: &mut Self, lines: &[Value]| {
            let id = ids.id("file");
            let bytes: String = lines
                .iter()
                .map(|l| match l {
                    Value::String(raw) => format!("{raw}\n"),
                    l => format!("{l}\n"),
                })
                .collect();
            ids.files.insert(id.clone(), (format!("{id}.jsonl"), Bytes::from(bytes)));
            id
        };
        let output_file_id = (!output.is_empty()).then(|| file(self, &output));
        let error_file_id = if errors.is_empty() { String::new() } else { file(self, &errors) };
        let b = self.batches.get_mut(id).expect("checked");
        b.status = status;
        b.completed = output.len();
        b.failed = errors.len();
        b.output_file_id = output_file_id;
        b.error_file_id = error_file_id;
    }

    /// Serves one request to Anthropic's `/v1/messages/batches…`; `base` is the
    /// server's own address (for `results_url`); `answer` answers one request's params
    /// as the Messages API would.
    pub(crate) fn handle_messages(
        &mut self,
        method: &hyper::Method,
        path: &str,
        query: &str,
        base: &str,
        body: Bytes,
        answer: &dyn Fn(&Value) -> String,
    ) -> Response<Full<Bytes>> {
        if self.script.throttle_requests > 0 {
            return self.throttle();
        }
        let rest: Vec<&str> =
            path.trim_start_matches("/v1/messages/batches").split('/').filter(|s| !s.is_empty()).collect();
        let missing = || {
            respond(
                StatusCode::NOT_FOUND,
                json!({"type": "error", "error": {"type": "not_found_error", "message": "no such batch"}}),
            )
        };
        match (method.as_str(), rest.as_slice()) {
            ("POST", []) => {
                let req: Value = serde_json::from_slice(&body).unwrap_or_default();
                let Some(requests) = req["requests"].as_array().filter(|r| !r.is_empty()).cloned() else {
                    return respond(
                        StatusCode::BAD_REQUEST,
                        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "requests"}}),
                    );
                };
                let id = self.id("msgbatch");
                self.stats.batches_created += 1;
                self.stats.lines_received += requests.len() as u64;
                self.note_running(1);
                let created_at = self.next;
                self.messages.insert(
                    id.clone(),
                    MessageBatch {
                        id: id.clone(),
                        requests,
                        status: "in_progress",
                        reads: 0,
                        created_at,
                        cancel_requested: false,
                        results: None,
                    },
                );
                respond(StatusCode::OK, self.message_object(&id, base))
            }
            ("GET", []) => {
                let param = |name: &str| {
                    query
                        .split('&')
                        .find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
                };
                let limit: usize = param("limit").and_then(|l| l.parse().ok()).unwrap_or(20);
                let mut all: Vec<&MessageBatch> = self.messages.values().collect();
                all.sort_by_key(|b| std::cmp::Reverse(b.created_at));
                let start =
                    param("after_id").and_then(|a| all.iter().position(|b| b.id == a).map(|p| p + 1)).unwrap_or(0);
                let page: Vec<Value> =
                    all.iter().skip(start).take(limit).map(|b| self.message_object(&b.id, base)).collect();
                let has_more = start + page.len() < all.len();
                respond(StatusCode::OK, json!({"data": page, "has_more": has_more}))
            }
            ("GET", [id]) if self.messages.contains_key(*id) => {
                self.advance_messages(id, answer);
                respond(StatusCode::OK, self.message_object(id, base))
            }
            ("POST", [id, "cancel"]) if self.messages.contains_key(*id) => {
                let b = self.messages.get_mut(*id).expect("checked");
                if b.status == "in_progress" {
                    b.status = "canceling";
                    b.cancel_requested = true;
                }
                respond(StatusCode::OK, self.message_object(id, base))
            }
            ("GET", [id, "results"]) => match self.messages.get(*id).and_then(|b| b.results.as_ref()) {
                Some(lines) => {
                    let raw = |l: &Value| match l {
                        Value::String(raw) => format!("{raw}\n"),
                        l => format!("{l}\n"),
                    };
                    Response::new(Full::new(Bytes::from(lines.iter().map(raw).collect::<String>())))
                }
                None => missing(),
            },
            _ => missing(),
        }
    }

    /// One read of a message batch: in progress for `progress_polls` reads (a cancel
    /// takes one more), then ended with its results.
    fn advance_messages(&mut self, id: &str, answer: &dyn Fn(&Value) -> String) {
        let script = self.script.clone();
        let b = self.messages.get_mut(id).expect("checked");
        b.reads += 1;
        let ran = match b.status {
            "canceling" => b.requests.len() / 2,
            "in_progress" if script.expire && b.reads * 2 >= script.progress_polls.max(1) => b.requests.len() / 2,
            "in_progress" if b.reads >= script.progress_polls => b.requests.len(),
            _ => return,
        };
        let (cancelled, requests) = (b.cancel_requested, b.requests.clone());
        let mut results = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let custom_id = r["custom_id"].as_str().unwrap_or_default().to_string();
            let fault = script.lines.get(&custom_id).copied();
            let result = if i >= ran || fault == Some(LineFault::Expired) {
                json!({"type": if cancelled && fault.is_none() { "canceled" } else { "expired" }})
            } else {
                match fault {
                    Some(LineFault::Malformed) => {
                        results.push(Value::String("{\"custom_id\": \"cut off".into()));
                        continue;
                    }
                    Some(LineFault::Error(kind)) => {
                        json!({"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": "simulated"}}})
                    }
                    Some(LineFault::Status(status)) => {
                        let kind = if status < 500 { "invalid_request_error" } else { "api_error" };
                        json!({"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": "simulated"}}})
                    }
                    _ => {
                        let out = answer(&r["params"]);
                        *self.stats.paid_lines.entry(custom_id.clone()).or_default() += 1;
                        let input = serde_json::from_str::<Value>(&out).unwrap_or_default();
                        json!({"type": "succeeded", "message": {
                            "id": format!("msg_sim_{i}"), "type": "message", "role": "assistant", "model": "sim",
                            "content": [{"type": "tool_use", "id": "toolu_sim", "name": "report_findings", "input": input}],
                            "stop_reason": "tool_use", "usage": {"input_tokens": 100, "output_tokens": 50},
                        }})
                    }
                }
            };
            results.push(json!({"custom_id": custom_id, "result": result}));
        }
        // The order of the results is not the requests'.
        results.reverse();
        let b = self.messages.get_mut(id).expect("checked");
        b.status = "ended";
        b.results = Some(results);
    }

    fn message_object(&self, id: &str, base: &str) -> Value {
        let b = &self.messages[id];
        let count = |t: &str| b.results.iter().flatten().filter(|r| r["result"]["type"] == t).count();
        let processing = if b.results.is_some() { 0 } else { b.requests.len() };
        json!({
            "id": b.id,
            "type": "message_batch",
            "processing_status": b.status,
            "request_counts": {
                "processing": processing, "succeeded": count("succeeded"), "errored": count("errored"),
                "canceled": count("canceled"), "expired": count("expired"),
            },
            "created_at": format!("2026-01-01T00:00:{:02}Z", b.created_at % 60),
            "ended_at": null,
            "results_url": b.results.as_ref().map(|_| format!("{base}/v1/messages/batches/{}/results", b.id)),
        })
    }

    fn object(&self, id: &str) -> Value {
        let b = &self.batches[id];
        json!({
            "id": b.id,
            "object": "batch",
            "endpoint": "/v1/chat/completions",
            "input_file_id": b.input_file_id,
            "completion_window": "24h",
            "status": b.status,
            "output_file_id": b.output_file_id,
            "error_file_id": b.error_file_id,
            "created_at": b.created_at,
            "errors": b.errors,
            "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
            "metadata": b.metadata,
        })
    }
}
