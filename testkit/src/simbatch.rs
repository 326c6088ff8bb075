//! The simulated provider's batch APIs, OpenAI's Batch API and Anthropic's Message
//! Batches API. It owns the providers' contracts as read from their documentation,
//! independently of this project's batch client, so a test can catch the client reading
//! them wrong.
//!
//! A batch moves one step each time it is read, so a test drives it by polling, with no
//! clock: `validating` for `validate_polls` reads, `in_progress` for `progress_polls`,
//! `finalizing` for `finalize_polls`, then `completed` (Anthropic: `in_progress`, then
//! `ended`). Each line is answered as the synchronous endpoint would answer its body (the
//! same findings), unless `BatchScript::lines` says otherwise for its custom id. A batch
//! made by another application (`BatchScript::foreign_batches`) moves one step on every
//! request to the batch endpoints instead, since nobody of ours polls it; so does ours
//! whose create was held after it was made (`HoldCreate::After`: its caller may have
//! died without its id) until it is first read by id.
//!
//! What a test can script (`BatchScript`): a line's HTTP status, non-HTTP error, expiry
//! or cut-off; a whole batch failed, expired or over the enqueued-token limit; 429s per
//! kind of endpoint with their hints; a create held in its crash window; another
//! application's batch. `BatchStats` says what the client did: uploads, creates, paid
//! lines, each 429 and how long the client waited after it, each batch's tokens, and
//! which batches it read, read results of and cancelled.
//!
//! OpenAI, and where each rule comes from (API reference "Batch" and "Files", the "Batch
//! API" guide and FAQ, and the OpenAPI types as generated into openai-python):
//! - `POST /v1/files` (multipart, purpose `batch`), `GET /v1/files/{id}/content`;
//!   `POST /v1/batches` (`input_file_id`, endpoint `/v1/chat/completions`, window `24h`,
//!   `metadata`) answers 200 with status `validating`; `GET /v1/batches/{id}`; `GET
//!   /v1/batches?after=&limit=` newest first, with `first_id`, `last_id`, `has_more`
//!   (limit 1 to 100, 20 by default); `POST /v1/batches/{id}/cancel`.
//! - `request_counts`: `completed` are "requests that have been completed successfully",
//!   `failed` "requests that have failed" (`BatchRequestCounts`). While the batch runs
//!   both rise with the lines that have run, each line in the count it ends in; neither
//!   ever falls.
//! - Output and error files hold one `BatchRequestOutput` a line: `id`, `custom_id`,
//!   `response` (`status_code`, `request_id`, `body`) and `error`, which is set "for
//!   requests that failed with a non-HTTP error" (`BatchRequestOutputError`: `code`, e.g.
//!   `batch_expired`, `batch_cancelled`, `request_timeout`, and `message`), `response`
//!   then null. `output_file_id` is null when no line succeeded. Lines come in another
//!   order than the input's.
//! - Enqueued tokens: "each model has a maximum number of enqueued prompt tokens allowed
//!   for batch processing", "there are no limits for output tokens" (guide, "Rate
//!   limits"); "once your batch request is completed, your batch rate limit is reset, as
//!   your input tokens are cleared" (FAQ). A batch over it is accepted (200,
//!   `validating`) and then fails: `status: failed`, `errors.data[0]` with code
//!   `token_limit_exceeded`, `line` and `param` null and the message the API gives,
//!   "Enqueued token limit reached for <model> in organization <org>. Limit: <n> enqueued
//!   tokens. Please try again once some in_progress batches have been completed." (quoted
//!   from the API in openai/openai-python#2084).
//! - A 429: `{"error": {"message", "type", "param", "code": "rate_limit_exceeded"}}` with
//!   `retry-after` in seconds.
//!
//! Anthropic (API reference "Message Batches": create, retrieve, list, cancel, results;
//! the "Batch processing" guide; the types of anthropic-sdk-python):
//! - `POST /v1/messages/batches` (`requests`: `custom_id`, `params`) starts `in_progress`;
//!   a cancel makes it `canceling`, then `ended` with what ran; `results_url` once ended,
//!   JSONL "not guaranteed to be in the same order as requests".
//! - The list is newest first: `after_id`, `before_id`, `limit` (1 to 1000, 20 by
//!   default) answer `data`, `has_more` ("more results in the requested page
//!   direction"), `first_id` and `last_id`; the SDK's next page is `after_id = last_id`,
//!   or `before_id = first_id` when paging back.
//! - `request_counts`: `processing` holds every request until the batch ends;
//!   `succeeded`, `errored`, `canceled` and `expired` are "zero until processing of the
//!   entire Message Batch has ended" (`MessageBatchRequestCounts`).
//! - A result is `succeeded` (a message), `errored` (an `ErrorResponse`, `{"type":
//!   "error", "error": {"type", "message"}}`, its type one of `ErrorType`:
//!   `invalid_request_error`, `authentication_error`, `permission_error`,
//!   `not_found_error`, `rate_limit_error`, `timeout_error`, `overloaded_error`,
//!   `api_error`, `billing_error`), `canceled` or `expired`.
//! - "Batches are scoped to a Workspace": every batch made there, another application's
//!   too, is listed, read and cancelled with any of its keys (guide, limitations).
//! - A 429: `{"type": "error", "error": {"type": "rate_limit_error", "message"}}` with
//!   `retry-after` in seconds ("Errors", "Rate limits").
//!
//! Both: `retry-after-ms` is the SDKs' ("the non-standard `retry-after-ms` header", read
//! before `retry-after` by openai-python's and anthropic-sdk-python's retry code).
//!
//! Not confirmed, and chosen here:
//! - How OpenAI counts a request's enqueued tokens. Here: its `body`'s bytes / 4
//!   (`request_tokens`; OpenAI's rule of thumb is about four characters a token, and
//!   `simmeter` counts a synchronous call alike), prompt only, no `max_tokens`. A batch
//!   is measured at the end of its validation against the account's batches of the
//!   same model already admitted (`in_progress`, `finalizing`): one limit, applied to
//!   each model apart, its first line's `model` naming a batch's.
//! - The message of a 429 from the batch endpoints, and whether they send
//!   `retry-after-ms` (tests script either hint, or none).
//! - Whether `request_counts.total` is known while validating (here it is), and whether
//!   a line answered an HTTP error sits in the error file (here it does).
//! - OpenAI's `cancelling` lasts "up to 10 minutes"; here a cancel ends the batch at once
//!   (`cancelled`), keeping what ran.
//! - The `message` of a non-HTTP line error: here the reference's words for its code.
//!
//! Not simulated: Anthropic's limit on requests waiting in the queue, results kept 29
//! days, file expiry, the `/v1/responses` endpoint.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Response, StatusCode};
use reviewlane_core::clock::SharedClock;
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
    /// Answer this many requests to the batch endpoints 429 first (`retry-after: 1`).
    pub throttle_requests: u32,
    /// Hold the next create until `SimProvider::release_batches` (so a test can kill
    /// its caller there): before the batch exists (it is then never created), or after
    /// it is created and before the answer.
    pub hold_create: Option<HoldCreate>,
    /// OpenAI: the organisation's limit on enqueued prompt tokens per model. A batch
    /// whose tokens and those of the account's batches of its model in progress exceed
    /// it is accepted, then fails its validation with `token_limit_exceeded`.
    pub enqueued_token_limit: Option<u64>,
    /// 429s on given kinds of endpoint, with their hints (after `throttle_requests`).
    pub throttles: Vec<Throttle>,
    /// The next this many creates are each followed at once by another application's
    /// batch on the account: as many requests, its own custom ids, none of our metadata.
    pub foreign_batches: u32,
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
            enqueued_token_limit: None,
            throttles: Vec::new(),
            foreign_batches: 0,
        }
    }
}

/// A line answered otherwise than with a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineFault {
    /// Its call answered this HTTP status.
    Status(u16),
    Expired,
    /// Its line is not JSON: it names no item.
    Malformed,
    /// It failed without an HTTP answer: OpenAI's `error.code` (`request_timeout`),
    /// Anthropic's `errored` result of this error type (`overloaded_error`).
    Error {
        code: &'static str,
    },
}

/// A kind of batch endpoint, on either provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Endpoint {
    /// `POST /v1/files` (OpenAI).
    Upload,
    Create,
    Get,
    List,
    Cancel,
    /// `GET /v1/files/{id}/content`: an input, output or error file (OpenAI).
    FileContent,
    /// `GET /v1/messages/batches/{id}/results`, the `results_url` (Anthropic).
    Results,
}

/// Requests to one kind of endpoint answered 429.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttle {
    pub endpoint: Endpoint,
    /// How many of its next requests.
    pub times: u32,
    /// `retry-after`, in seconds.
    pub retry_after_secs: Option<u64>,
    /// `retry-after-ms`.
    pub retry_after_ms: Option<u64>,
}

/// One 429 answered, and when the next request to the same kind of endpoint came.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Throttled {
    pub endpoint: Endpoint,
    /// Milliseconds by the batch clock (`SimProvider::set_batch_clock`).
    pub at_ms: u64,
    pub retry_after_secs: Option<u64>,
    pub retry_after_ms: Option<u64>,
    pub next_at_ms: Option<u64>,
}

impl Throttled {
    /// The wait the hints ask for, read as the SDKs read them: `retry-after-ms` first.
    pub fn hint_ms(&self) -> Option<u64> {
        self.retry_after_ms.or(self.retry_after_secs.map(|s| s * 1000))
    }

    /// How long the client waited before its next request to the endpoint.
    pub fn waited_ms(&self) -> Option<u64> {
        self.next_at_ms.map(|n| n.saturating_sub(self.at_ms))
    }
}

/// What the simulated account saw of batches.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct BatchStats {
    pub files_uploaded: u64,
    /// Our creates (another application's batches are not counted).
    pub batches_created: u64,
    /// Lines answered with a success (the billed ones), per custom id.
    pub paid_lines: BTreeMap<String, u64>,
    pub throttled: u64,
    /// Creates held (`BatchScript::hold_create`).
    pub creates_held: u64,
    /// Most of our batches running at once (counted at each create).
    pub max_running: u64,
    /// Request lines in every batch created (items sent again count again).
    pub lines_received: u64,
    /// OpenAI: each batch's enqueued prompt tokens as counted against the limit
    /// (`request_tokens`), by batch id; another application's too.
    pub enqueued_tokens: BTreeMap<String, u64>,
    /// Every 429 of the batch endpoints, in order.
    pub throttle_log: Vec<Throttled>,
    /// Batches made by another application (`BatchScript::foreign_batches`).
    pub foreign_batches: Vec<String>,
    /// Request lines of each of our batches, in the order they were created.
    pub batch_sizes: Vec<u64>,
    /// Per batch id: reads of the batch, reads of its results (OpenAI's output or error
    /// file, Anthropic's `results_url`), and cancels, by the client.
    pub reads_by_batch: BTreeMap<String, u64>,
    pub results_by_batch: BTreeMap<String, u64>,
    pub cancels_by_batch: BTreeMap<String, u64>,
}

impl BatchStats {
    /// Another application's batches the client read, read results of, or cancelled.
    pub fn foreign_touched(&self) -> Vec<String> {
        let touched = |id: &String| {
            self.reads_by_batch.contains_key(id)
                || self.results_by_batch.contains_key(id)
                || self.cancels_by_batch.contains_key(id)
        };
        self.foreign_batches.iter().filter(|id| touched(id)).cloned().collect()
    }
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
    /// What `Throttled` times are read from; the system clock when unset.
    pub(crate) clock: Option<SharedClock>,
    /// The next create's answer is held (`HoldCreate::After`): its batch moves on by
    /// itself until it is first read by id.
    pub(crate) unread_next: bool,
}

/// An Anthropic message batch: its requests inline, and its results once ended.
struct MessageBatch {
    id: String,
    requests: Vec<Value>,
    status: &'static str,
    reads: u32,
    created_at: u64,
    cancel_initiated_at: Option<u64>,
    ended_at: Option<u64>,
    foreign: bool,
    /// Ours, its create's answer held, not read by id since: nobody may poll it.
    unread: bool,
    results: Option<Vec<Value>>,
}

struct Batch {
    id: String,
    input_file_id: String,
    metadata: Value,
    status: &'static str,
    reads: u32,
    created_at: u64,
    /// The input file's lines.
    lines: Vec<Value>,
    /// Enqueued prompt tokens (`request_tokens`).
    tokens: u64,
    foreign: bool,
    /// Ours, its create's answer held, not read by id since: nobody may poll it.
    unread: bool,
    /// Lines run so far.
    processed: usize,
    completed: usize,
    failed: usize,
    output_file_id: Option<String>,
    error_file_id: String,
    errors: Option<Value>,
}

impl Batch {
    /// The model its requests name (its first line's); the limit is per model.
    fn model(&self) -> &str {
        self.lines.first().and_then(|l| l["body"]["model"].as_str()).unwrap_or("unknown")
    }
}

/// OpenAI statuses whose batch holds its enqueued tokens (admitted, not ended).
const ADMITTED: [&str; 3] = ["in_progress", "finalizing", "cancelling"];

/// How a line ends, by its script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// In the output file (a line cut off too: the API sent it).
    Succeeds,
    /// In the error file, having run.
    Fails,
    /// In the error file, never run (`batch_expired`).
    NotRun,
}

fn outcome(fault: Option<LineFault>) -> Outcome {
    match fault {
        None | Some(LineFault::Malformed) => Outcome::Succeeds,
        Some(LineFault::Status(_) | LineFault::Error { .. }) => Outcome::Fails,
        Some(LineFault::Expired) => Outcome::NotRun,
    }
}

/// `request_counts` (`completed`, `failed`) of an OpenAI batch whose lines with these
/// faults have run: each line counted in the one it ends in, so neither falls later.
fn live_counts(ran: &[Option<LineFault>]) -> (usize, usize) {
    let count = |o: Outcome| ran.iter().filter(|f| outcome(**f) == o).count();
    (count(Outcome::Succeeds), count(Outcome::Fails))
}

/// Prompt tokens of one OpenAI batch request as counted against the enqueued-token
/// limit: the bytes of its `body` / 4, as `simmeter` counts a synchronous call. Output
/// tokens (`max_tokens`) are not limited, so not counted.
pub fn request_tokens(body: &Value) -> u64 {
    crate::simmeter::count(body.to_string().len())
}

/// `n` with a comma every three digits, as the API writes its limits.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn token_limit_message(model: &str, limit: u64) -> String {
    format!(
        "Enqueued token limit reached for {model} in organization org-sim. Limit: {} enqueued tokens. Please try \
         again once some in_progress batches have been completed.",
        thousands(limit)
    )
}

/// The message of a non-HTTP line error, as the reference describes its code.
fn line_error_message(code: &str) -> &'static str {
    match code {
        "batch_expired" => "The request could not be executed before the completion window ended.",
        "batch_cancelled" => "The batch was cancelled before this request executed.",
        "request_timeout" => "The underlying call to the model timed out.",
        _ => "simulated",
    }
}

/// The kind of batch endpoint a request is for; `None` for any other.
pub fn endpoint(method: &str, path: &str) -> Option<Endpoint> {
    if let Some(rest) = path.strip_prefix("/v1/files") {
        let parts: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
        return match (method, parts.as_slice()) {
            ("POST", []) if rest.is_empty() => Some(Endpoint::Upload),
            ("GET", [_, "content"]) if rest.starts_with('/') => Some(Endpoint::FileContent),
            _ => None,
        };
    }
    let (anthropic, rest) = match (path.strip_prefix("/v1/messages/batches"), path.strip_prefix("/v1/batches")) {
        (Some(rest), _) => (true, rest),
        (None, Some(rest)) => (false, rest),
        (None, None) => return None,
    };
    if !(rest.is_empty() || rest.starts_with('/')) {
        return None;
    }
    let parts: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    match (method, parts.as_slice()) {
        ("POST", []) => Some(Endpoint::Create),
        ("GET", []) => Some(Endpoint::List),
        ("GET", [_]) => Some(Endpoint::Get),
        ("POST", [_, "cancel"]) => Some(Endpoint::Cancel),
        ("GET", [_, "results"]) if anthropic => Some(Endpoint::Results),
        _ => None,
    }
}

/// One page of a list newest first (`ids`): just after `after`, else just before
/// `before`, else the first; and whether more lie in that direction. A cursor not in
/// the list is taken as none.
fn page(ids: &[&str], after: Option<&str>, before: Option<&str>, limit: usize) -> (Range<usize>, bool) {
    let at = |cursor: Option<&str>| cursor.and_then(|c| ids.iter().position(|id| *id == c));
    match (at(after), at(before)) {
        (Some(a), _) => {
            let end = (a + 1 + limit).min(ids.len());
            (a + 1..end, end < ids.len())
        }
        (None, Some(b)) => {
            let start = b.saturating_sub(limit);
            (start..b, start > 0)
        }
        (None, None) => {
            let end = limit.min(ids.len());
            (0..end, end < ids.len())
        }
    }
}

/// The value of query parameter `name`.
fn param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
}

/// Another application's requests: as many as ours, with its own custom ids.
fn foreign_requests(ours: &[Value], tag: u64) -> Vec<Value> {
    let mut theirs = ours.to_vec();
    for (i, r) in theirs.iter_mut().enumerate() {
        r["custom_id"] = json!(format!("other-app-{tag}-{i}"));
    }
    theirs
}

fn custom_id(line: &Value) -> String {
    line["custom_id"].as_str().unwrap_or_default().to_string()
}

/// A sequence number as an RFC 3339 time, `days` after the first day.
fn rfc3339(seq: u64, days: u64) -> String {
    format!("2026-01-{:02}T{:02}:{:02}:{:02}Z", 1 + days, (seq / 3600) % 24, (seq / 60) % 60, seq % 60)
}

/// The JSONL of `lines` (a `Value::String` is written raw: a line cut off).
fn jsonl(lines: &[Value]) -> String {
    lines
        .iter()
        .map(|l| match l {
            Value::String(raw) => format!("{raw}\n"),
            l => format!("{l}\n"),
        })
        .collect()
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

/// A 429 in the provider's shape, with the hints given.
fn too_many(anthropic: bool, secs: Option<u64>, ms: Option<u64>) -> Response<Full<Bytes>> {
    let body = if anthropic {
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": "Number of requests has exceeded your rate limit."}})
    } else {
        json!({"error": {"message": "Rate limit reached for requests", "type": "requests", "param": null, "code": "rate_limit_exceeded"}})
    };
    let mut r = respond(StatusCode::TOO_MANY_REQUESTS, body);
    let hints = [("retry-after", secs), ("retry-after-ms", ms)];
    for (name, value) in hints.into_iter().filter_map(|(n, v)| v.map(|v| (n, v))) {
        r.headers_mut().insert(name, hyper::header::HeaderValue::from(value));
    }
    r
}

impl Batches {
    fn now_ms(&self) -> u64 {
        self.clock.as_ref().map_or_else(reviewlane_core::clock::now_ms, |c| c.now_ms())
    }

    /// Counts our batches running with `new` more.
    fn note_running(&mut self, new: u64) {
        let openai = self
            .batches
            .values()
            .filter(|b| !b.foreign && matches!(b.status, "validating" | "in_progress" | "finalizing" | "cancelling"))
            .count();
        let anthropic = self.messages.values().filter(|b| !b.foreign && b.status != "ended").count();
        self.stats.max_running = self.stats.max_running.max(openai as u64 + anthropic as u64 + new);
    }

    fn id(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}-sim{:06}", self.next)
    }

    /// Notes a request to a batch endpoint and answers it 429 if the script says so.
    pub(crate) fn gate(&mut self, method: &str, path: &str) -> Option<Response<Full<Bytes>>> {
        let endpoint = endpoint(method, path)?;
        let now = self.now_ms();
        let open = self.stats.throttle_log.iter_mut().filter(|t| t.endpoint == endpoint && t.next_at_ms.is_none());
        open.for_each(|t| t.next_at_ms = Some(now));
        let (secs, ms) = if self.script.throttle_requests > 0 {
            self.script.throttle_requests -= 1;
            (Some(1), None)
        } else {
            let t = self.script.throttles.iter_mut().find(|t| t.endpoint == endpoint && t.times > 0)?;
            t.times -= 1;
            (t.retry_after_secs, t.retry_after_ms)
        };
        self.stats.throttled += 1;
        let event = Throttled { endpoint, at_ms: now, retry_after_secs: secs, retry_after_ms: ms, next_at_ms: None };
        self.stats.throttle_log.push(event);
        Some(too_many(path.starts_with("/v1/messages/batches"), secs, ms))
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
        self.advance_foreign(answer);
        let missing =
            |what: &str| respond(StatusCode::NOT_FOUND, json!({"error": {"message": format!("No such {what}")}}));
        let segments: Vec<&str> = path.trim_start_matches("/v1/").split('/').collect();
        match (method.as_str(), segments.as_slice()) {
            ("GET", ["files", id, "content"]) => {
                let Some((_, bytes)) = self.files.get(*id).cloned() else { return missing("file") };
                let of =
                    self.batches.values().find(|b| b.output_file_id.as_deref() == Some(*id) || b.error_file_id == *id);
                if let Some(batch) = of.map(|b| b.id.clone()) {
                    *self.stats.results_by_batch.entry(batch).or_default() += 1;
                }
                Response::new(Full::new(bytes))
            }
            ("POST", ["batches"]) => self.create(&body),
            ("GET", ["batches"]) => self.list(query),
            ("GET", ["batches", id]) if self.batches.contains_key(*id) => {
                *self.stats.reads_by_batch.entry(id.to_string()).or_default() += 1;
                self.batches.get_mut(*id).expect("checked").unread = false;
                self.advance(id, answer);
                respond(StatusCode::OK, self.object(id))
            }
            ("POST", ["batches", id, "cancel"]) if self.batches.contains_key(*id) => {
                *self.stats.cancels_by_batch.entry(id.to_string()).or_default() += 1;
                self.cancel(id, answer)
            }
            ("GET", ["batches", _]) | ("POST", ["batches", _, "cancel"]) => missing("batch"),
            _ => respond(StatusCode::NOT_FOUND, json!({"error": {"message": "unknown endpoint"}})),
        }
    }

    /// Keeps an uploaded file (`parse_upload`'s); refuses anything else.
    pub(crate) fn upload(&mut self, upload: Option<(String, Bytes)>) -> Response<Full<Bytes>> {
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
        let lines: Vec<Value> = bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap_or_default())
            .collect();
        self.stats.batches_created += 1;
        self.stats.lines_received += lines.len() as u64;
        self.note_running(1);
        self.stats.batch_sizes.push(lines.len() as u64);
        let id = self.insert_batch(input, req["metadata"].clone(), lines.clone(), false);
        self.batches.get_mut(&id).expect("inserted").unread = std::mem::take(&mut self.unread_next);
        if self.script.foreign_batches > 0 {
            self.script.foreign_batches -= 1;
            let theirs = foreign_requests(&lines, self.next);
            let file = self.id("file");
            self.files.insert(file.clone(), ("other-application.jsonl".into(), Bytes::from(jsonl(&theirs))));
            let foreign = self.insert_batch(file, json!({"source": "another-application"}), theirs, true);
            self.stats.foreign_batches.push(foreign);
        }
        respond(StatusCode::OK, self.object(&id))
    }

    fn insert_batch(&mut self, input_file_id: String, metadata: Value, lines: Vec<Value>, foreign: bool) -> String {
        let id = self.id("batch");
        let tokens = lines.iter().map(|l| request_tokens(&l["body"])).sum();
        self.stats.enqueued_tokens.insert(id.clone(), tokens);
        let batch = Batch {
            id: id.clone(),
            input_file_id,
            metadata,
            status: "validating",
            reads: 0,
            created_at: self.next,
            lines,
            tokens,
            foreign,
            unread: false,
            processed: 0,
            completed: 0,
            failed: 0,
            output_file_id: None,
            error_file_id: String::new(),
            errors: None,
        };
        self.batches.insert(id.clone(), batch);
        id
    }

    fn list(&self, query: &str) -> Response<Full<Bytes>> {
        let limit = param(query, "limit").and_then(|l| l.parse().ok()).unwrap_or(20_usize).clamp(1, 100);
        // Newest first, as the API lists.
        let mut all: Vec<&Batch> = self.batches.values().collect();
        all.sort_by_key(|b| std::cmp::Reverse(b.created_at));
        let ids: Vec<&str> = all.iter().map(|b| b.id.as_str()).collect();
        let (range, has_more) = page(&ids, param(query, "after").as_deref(), None, limit);
        let page = &ids[range];
        let data: Vec<Value> = page.iter().map(|id| self.object(id)).collect();
        let (first, last) = (page.first(), page.last());
        respond(
            StatusCode::OK,
            json!({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}),
        )
    }

    fn cancel(&mut self, id: &str, answer: &dyn Fn(&Value) -> String) -> Response<Full<Bytes>> {
        let b = &self.batches[id];
        if matches!(b.status, "validating" | "in_progress" | "finalizing") {
            let ran = if b.status == "validating" { 0 } else { b.processed.max(b.lines.len() / 2) };
            self.finish(id, "cancelled", ran, "batch_cancelled", answer);
        }
        respond(StatusCode::OK, self.object(id))
    }

    /// Moves the running batches nobody of ours polls (another application's, ours
    /// unread since a held create) one step each.
    fn advance_foreign(&mut self, answer: &dyn Fn(&Value) -> String) {
        let running =
            |b: &&Batch| (b.foreign || b.unread) && matches!(b.status, "validating" | "in_progress" | "finalizing");
        let ids: Vec<String> = self.batches.values().filter(running).map(|b| b.id.clone()).collect();
        for id in ids {
            self.advance(&id, answer);
        }
    }

    /// One read of the batch: it moves one step.
    fn advance(&mut self, id: &str, answer: &dyn Fn(&Value) -> String) {
        let script = self.script.clone();
        let polls = script.progress_polls.max(1);
        let model = self.batches[id].model().to_string();
        let admitted: u64 = self
            .batches
            .values()
            .filter(|o| o.id != id && ADMITTED.contains(&o.status) && o.model() == model)
            .map(|o| o.tokens)
            .sum();
        let b = self.batches.get_mut(id).expect("checked");
        b.reads += 1;
        let end = match b.status {
            "validating" if b.reads >= script.validate_polls => {
                let refused = match (&script.fail_with, script.enqueued_token_limit) {
                    (Some(code), _) => Some((code.clone(), "simulated".to_string())),
                    (None, Some(limit)) if admitted + b.tokens > limit => {
                        Some(("token_limit_exceeded".into(), token_limit_message(&model, limit)))
                    }
                    _ => None,
                };
                match refused {
                    Some((code, message)) => {
                        b.status = "failed";
                        let error = json!({"code": code, "message": message, "param": null, "line": null});
                        b.errors = Some(json!({"object": "list", "data": [error]}));
                    }
                    None => {
                        b.status = "in_progress";
                        b.reads = 0;
                    }
                }
                None
            }
            "in_progress" => {
                b.processed = b.lines.len() * b.reads.min(polls) as usize / polls as usize;
                let ran: Vec<Option<LineFault>> =
                    b.lines[..b.processed].iter().map(|l| script.lines.get(&custom_id(l)).copied()).collect();
                (b.completed, b.failed) = live_counts(&ran);
                if script.expire && b.reads * 2 >= polls {
                    Some(("expired", b.lines.len() / 2, "batch_expired"))
                } else {
                    if b.reads >= polls {
                        b.status = "finalizing";
                        b.reads = 0;
                    }
                    None
                }
            }
            "finalizing" if b.reads >= script.finalize_polls => Some(("completed", b.lines.len(), "")),
            _ => None,
        };
        if let Some((status, ran, code)) = end {
            self.finish(id, status, ran, code, answer);
        }
    }

    /// Ends the batch as `status`: its first `ran` lines answered (or failed as
    /// scripted), the rest in the error file with `code`.
    fn finish(&mut self, id: &str, status: &'static str, ran: usize, code: &str, answer: &dyn Fn(&Value) -> String) {
        let (lines, foreign) = (self.batches[id].lines.clone(), self.batches[id].foreign);
        let (mut output, mut errors) = (Vec::new(), Vec::new());
        for (i, line) in lines.iter().enumerate() {
            let custom_id = custom_id(line);
            let req_id = format!("batch_req_{i}");
            let fault = self.script.lines.get(&custom_id).copied();
            let non_http = |code: &str| {
                json!({"id": req_id, "custom_id": custom_id, "response": null,
                    "error": {"code": code, "message": line_error_message(code)}})
            };
            if i >= ran || fault == Some(LineFault::Expired) {
                let code = if fault == Some(LineFault::Expired) { "batch_expired" } else { code };
                errors.push(non_http(code));
                continue;
            }
            match fault {
                Some(LineFault::Malformed) => output.push(Value::String("{\"custom_id\": \"cut off".into())),
                Some(LineFault::Error { code }) => errors.push(non_http(code)),
                Some(LineFault::Status(status)) => errors.push(json!({
                    "id": req_id, "custom_id": custom_id, "error": null,
                    "response": {"status_code": status, "request_id": req_id, "body": {"error": {"message": "simulated", "type": if status < 500 { "invalid_request_error" } else { "server_error" }}}},
                })),
                _ => {
                    let out = answer(&line["body"]);
                    if !foreign {
                        *self.stats.paid_lines.entry(custom_id.clone()).or_default() += 1;
                    }
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
        let mut file = |lines: &[Value]| {
            let id = self.id("file");
            self.files.insert(id.clone(), (format!("{id}.jsonl"), Bytes::from(jsonl(lines))));
            id
        };
        let output_file_id = (!output.is_empty()).then(|| file(&output));
        let error_file_id = if errors.is_empty() { String::new() } else { file(&errors) };
        let b = self.batches.get_mut(id).expect("checked");
        b.status = status;
        b.processed = ran.min(b.lines.len());
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
        self.advance_foreign_messages(answer);
        let rest: Vec<&str> =
            path.trim_start_matches("/v1/messages/batches").split('/').filter(|s| !s.is_empty()).collect();
        let missing = || {
            respond(
                StatusCode::NOT_FOUND,
                json!({"type": "error", "error": {"type": "not_found_error", "message": "no such batch"}}),
            )
        };
        match (method.as_str(), rest.as_slice()) {
            ("POST", []) => self.create_messages(&body, base),
            ("GET", []) => self.list_messages(query, base),
            ("GET", [id]) if self.messages.contains_key(*id) => {
                *self.stats.reads_by_batch.entry(id.to_string()).or_default() += 1;
                self.messages.get_mut(*id).expect("checked").unread = false;
                self.advance_messages(id, answer);
                respond(StatusCode::OK, self.message_object(id, base))
            }
            ("POST", [id, "cancel"]) if self.messages.contains_key(*id) => {
                *self.stats.cancels_by_batch.entry(id.to_string()).or_default() += 1;
                self.next += 1;
                let at = self.next;
                let b = self.messages.get_mut(*id).expect("checked");
                if b.status == "in_progress" {
                    b.status = "canceling";
                    b.cancel_initiated_at = Some(at);
                }
                respond(StatusCode::OK, self.message_object(id, base))
            }
            ("GET", [id, "results"]) if self.messages.contains_key(*id) => {
                *self.stats.results_by_batch.entry(id.to_string()).or_default() += 1;
                match &self.messages[*id].results {
                    Some(lines) => Response::new(Full::new(Bytes::from(jsonl(lines)))),
                    None => missing(),
                }
            }
            _ => missing(),
        }
    }

    fn create_messages(&mut self, body: &[u8], base: &str) -> Response<Full<Bytes>> {
        let req: Value = serde_json::from_slice(body).unwrap_or_default();
        let Some(requests) = req["requests"].as_array().filter(|r| !r.is_empty()).cloned() else {
            return respond(
                StatusCode::BAD_REQUEST,
                json!({"type": "error", "error": {"type": "invalid_request_error", "message": "requests"}}),
            );
        };
        self.stats.batches_created += 1;
        self.stats.lines_received += requests.len() as u64;
        self.note_running(1);
        self.stats.batch_sizes.push(requests.len() as u64);
        let id = self.insert_message_batch(requests.clone(), false);
        self.messages.get_mut(&id).expect("inserted").unread = std::mem::take(&mut self.unread_next);
        if self.script.foreign_batches > 0 {
            self.script.foreign_batches -= 1;
            let theirs = foreign_requests(&requests, self.next);
            let foreign = self.insert_message_batch(theirs, true);
            self.stats.foreign_batches.push(foreign);
        }
        respond(StatusCode::OK, self.message_object(&id, base))
    }

    fn insert_message_batch(&mut self, requests: Vec<Value>, foreign: bool) -> String {
        let id = self.id("msgbatch");
        let batch = MessageBatch {
            id: id.clone(),
            requests,
            status: "in_progress",
            reads: 0,
            created_at: self.next,
            cancel_initiated_at: None,
            ended_at: None,
            foreign,
            unread: false,
            results: None,
        };
        self.messages.insert(id.clone(), batch);
        id
    }

    fn list_messages(&self, query: &str, base: &str) -> Response<Full<Bytes>> {
        let limit = param(query, "limit").and_then(|l| l.parse().ok()).unwrap_or(20_usize).clamp(1, 1000);
        let mut all: Vec<&MessageBatch> = self.messages.values().collect();
        all.sort_by_key(|b| std::cmp::Reverse(b.created_at));
        let ids: Vec<&str> = all.iter().map(|b| b.id.as_str()).collect();
        let (after, before) = (param(query, "after_id"), param(query, "before_id"));
        let (range, has_more) = page(&ids, after.as_deref(), before.as_deref(), limit);
        let page = &ids[range];
        let data: Vec<Value> = page.iter().map(|id| self.message_object(id, base)).collect();
        let (first, last) = (page.first(), page.last());
        respond(StatusCode::OK, json!({"data": data, "has_more": has_more, "first_id": first, "last_id": last}))
    }

    /// Moves the message batches nobody of ours polls (another application's, ours
    /// unread since a held create) one step each.
    fn advance_foreign_messages(&mut self, answer: &dyn Fn(&Value) -> String) {
        let ids: Vec<String> = self
            .messages
            .values()
            .filter(|b| (b.foreign || b.unread) && b.status != "ended")
            .map(|b| b.id.clone())
            .collect();
        for id in ids {
            self.advance_messages(&id, answer);
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
        let (cancelled, foreign, requests) = (b.cancel_initiated_at.is_some(), b.foreign, b.requests.clone());
        let mut results = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let custom_id = custom_id(r);
            let fault = script.lines.get(&custom_id).copied();
            let result = if i >= ran || fault == Some(LineFault::Expired) {
                json!({"type": if cancelled && fault != Some(LineFault::Expired) { "canceled" } else { "expired" }})
            } else {
                let errored = |kind: &str| json!({"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": "simulated"}}});
                match fault {
                    Some(LineFault::Malformed) => {
                        results.push(Value::String("{\"custom_id\": \"cut off".into()));
                        continue;
                    }
                    Some(LineFault::Status(status)) => {
                        errored(if status < 500 { "invalid_request_error" } else { "api_error" })
                    }
                    Some(LineFault::Error { code }) => errored(code),
                    _ => {
                        let out = answer(&r["params"]);
                        if !foreign {
                            *self.stats.paid_lines.entry(custom_id.clone()).or_default() += 1;
                        }
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
        self.next += 1;
        let ended_at = self.next;
        let b = self.messages.get_mut(id).expect("checked");
        b.status = "ended";
        b.ended_at = Some(ended_at);
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
            "created_at": rfc3339(b.created_at, 0),
            "expires_at": rfc3339(b.created_at, 1),
            "cancel_initiated_at": b.cancel_initiated_at.map(|t| rfc3339(t, 0)),
            "ended_at": b.ended_at.map(|t| rfc3339(t, 0)),
            "archived_at": null,
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
            "request_counts": {"total": b.lines.len(), "completed": b.completed, "failed": b.failed},
            "metadata": b.metadata,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use reviewlane_core::clock::ManualClock;

    use super::*;
    use crate::simprovider::{SimConfig, SimProvider};
    use crate::stack::poll_until;

    const DIFF: &str = "--- a/x.rs\n+++ b/x.rs\n@@ -1 +1,2 @@\n a\n+let b = c;\n";

    #[test]
    fn endpoints_are_told_apart_on_both_providers() {
        let cases = [
            ("POST", "/v1/files", Some(Endpoint::Upload)),
            ("GET", "/v1/files/file-1/content", Some(Endpoint::FileContent)),
            ("POST", "/v1/batches", Some(Endpoint::Create)),
            ("GET", "/v1/batches", Some(Endpoint::List)),
            ("GET", "/v1/batches/batch-1", Some(Endpoint::Get)),
            ("POST", "/v1/batches/batch-1/cancel", Some(Endpoint::Cancel)),
            ("POST", "/v1/messages/batches", Some(Endpoint::Create)),
            ("GET", "/v1/messages/batches", Some(Endpoint::List)),
            ("GET", "/v1/messages/batches/msgbatch-1", Some(Endpoint::Get)),
            ("POST", "/v1/messages/batches/msgbatch-1/cancel", Some(Endpoint::Cancel)),
            ("GET", "/v1/messages/batches/msgbatch-1/results", Some(Endpoint::Results)),
            ("GET", "/v1/batches/batch-1/results", None),
            ("GET", "/v1/batchesx", None),
            ("POST", "/v1/filesx", None),
            ("POST", "/v1/chat/completions", None),
        ];
        for (method, path, want) in cases {
            assert_eq!(endpoint(method, path), want, "{method} {path}");
        }
    }

    #[test]
    fn live_counts_put_each_line_that_ran_in_the_count_it_ends_in() {
        let timeout = Some(LineFault::Error { code: "request_timeout" });
        let ran = [None, Some(LineFault::Status(500)), timeout, Some(LineFault::Expired), Some(LineFault::Malformed)];
        assert_eq!(live_counts(&ran[..0]), (0, 0));
        assert_eq!(live_counts(&ran[..2]), (1, 1));
        // A line that never runs (expired) is in neither while the batch runs.
        assert_eq!(live_counts(&ran), (2, 2));
    }

    #[test]
    fn pages_go_after_last_id_and_before_first_id() {
        let ids = ["e", "d", "c", "b", "a"];
        assert_eq!(page(&ids, None, None, 2), (0..2, true));
        assert_eq!(page(&ids, Some("d"), None, 2), (2..4, true));
        assert_eq!(page(&ids, Some("b"), None, 2), (4..5, false));
        assert_eq!(page(&ids, None, Some("c"), 2), (0..2, false));
        assert_eq!(page(&ids, None, Some("b"), 2), (1..3, true));
        assert_eq!(page(&ids, None, None, 20), (0..5, false));
    }

    #[test]
    fn the_token_limit_message_is_the_apis() {
        assert_eq!(thousands(2_000_000), "2,000,000");
        assert_eq!(thousands(999), "999");
        assert_eq!(
            token_limit_message("gpt-4o-mini", 90_000),
            "Enqueued token limit reached for gpt-4o-mini in organization org-sim. Limit: 90,000 enqueued tokens. \
             Please try again once some in_progress batches have been completed."
        );
    }

    /// One answer: status, headers, body as JSON (or as a string when not JSON).
    struct Answer {
        status: u16,
        headers: reqwest::header::HeaderMap,
        body: Value,
        text: String,
    }

    async fn answer(r: reqwest::RequestBuilder) -> Answer {
        let r = r.send().await.expect("the simulated provider answers");
        let (status, headers) = (r.status().as_u16(), r.headers().clone());
        let text = r.text().await.expect("a body");
        Answer { status, headers, body: serde_json::from_str(&text).unwrap_or(Value::Null), text }
    }

    fn header(a: &Answer, name: &str) -> Option<String> {
        a.headers.get(name).map(|v| v.to_str().expect("ascii").to_string())
    }

    struct Api {
        base: String,
        http: reqwest::Client,
    }

    impl Api {
        fn new(sim: &SimProvider) -> Api {
            Api { base: format!("http://{}", sim.addr()), http: reqwest::Client::new() }
        }

        async fn get(&self, path: &str) -> Answer {
            answer(self.http.get(format!("{}{path}", self.base))).await
        }

        async fn post(&self, path: &str, body: Value) -> Answer {
            answer(self.http.post(format!("{}{path}", self.base)).json(&body)).await
        }

        async fn upload(&self, lines: &[Value]) -> Answer {
            let part = reqwest::multipart::Part::bytes(jsonl(lines).into_bytes()).file_name("input.jsonl");
            let form = reqwest::multipart::Form::new().text("purpose", "batch").part("file", part);
            answer(self.http.post(format!("{}/v1/files", self.base)).multipart(form)).await
        }

        /// Uploads `lines` and creates an OpenAI batch of them.
        async fn openai_batch(&self, lines: &[Value]) -> Answer {
            let file = self.upload(lines).await;
            assert_eq!(file.status, 200, "{}", file.text);
            let create = json!({"input_file_id": file.body["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h", "metadata": {"owner": "us"}});
            self.post("/v1/batches", create).await
        }

        /// Reads the batch until its status is one of `until` (bounded: each read moves
        /// it one step); every answer read.
        async fn poll(&self, path: &str, field: &str, until: &[&str]) -> Vec<Value> {
            let mut seen = Vec::new();
            for _ in 0..30 {
                let a = self.get(path).await;
                assert_eq!(a.status, 200, "{}", a.text);
                let done = until.iter().any(|s| a.body[field] == *s);
                seen.push(a.body);
                if done {
                    return seen;
                }
            }
            panic!("{path} not {until:?} in 30 reads: {seen:?}");
        }
    }

    fn chat_line(id: &str) -> Value {
        json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim-model", "max_tokens": 512, "messages": [{"role": "user", "content": DIFF}]}})
    }

    fn chat_lines(prefix: &str, n: usize) -> Vec<Value> {
        (0..n).map(|i| chat_line(&format!("{prefix}-{i}"))).collect()
    }

    fn message_request(id: &str) -> Value {
        json!({"custom_id": id, "params": {"model": "sim-model", "max_tokens": 512,
            "messages": [{"role": "user", "content": DIFF}]}})
    }

    /// The custom ids in a JSONL body.
    fn custom_ids(text: &str) -> Vec<String> {
        text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).map(|l| custom_id(&l)).collect()
    }

    #[tokio::test]
    async fn over_the_enqueued_token_limit_a_batch_is_accepted_then_fails_and_one_that_fits_runs() {
        let sim = SimProvider::start(SimConfig::default()).await;
        let api = Api::new(&sim);
        // Every line's body is the same: its tokens are known before any batch exists.
        let line = request_tokens(&chat_line("x")["body"]);
        sim.script_batches(BatchScript {
            progress_polls: 3,
            enqueued_token_limit: Some(3 * line),
            ..Default::default()
        });

        // Two lines fit alone and stay in progress, holding their tokens.
        let a = api.openai_batch(&chat_lines("a", 2)).await;
        let a_id = a.body["id"].as_str().unwrap().to_string();
        assert_eq!(api.get(&format!("/v1/batches/{a_id}")).await.body["status"], "in_progress");

        // Two more do not fit beside them: accepted, then failed at validation.
        let b = api.openai_batch(&chat_lines("b", 2)).await;
        assert_eq!((b.status, b.body["status"].as_str()), (200, Some("validating")));
        let b_id = b.body["id"].as_str().unwrap().to_string();
        let failed = api.get(&format!("/v1/batches/{b_id}")).await.body;
        assert_eq!(failed["status"], "failed", "{failed}");
        let error = &failed["errors"]["data"][0];
        assert_eq!(error["code"], "token_limit_exceeded");
        assert_eq!(error["message"].as_str(), Some(token_limit_message("sim-model", 3 * line).as_str()));
        assert_eq!((error["line"].clone(), error["param"].clone()), (Value::Null, Value::Null));
        assert_eq!((failed["output_file_id"].clone(), failed["error_file_id"].as_str()), (Value::Null, Some("")));

        // One line fits beside them and runs through.
        let c = api.openai_batch(&chat_lines("c", 1)).await;
        let c_id = c.body["id"].as_str().unwrap().to_string();
        let seen = api.poll(&format!("/v1/batches/{c_id}"), "status", &["completed", "failed"]).await;
        assert_eq!(seen.last().unwrap()["status"], "completed", "{seen:?}");

        // Once the first batch ends its tokens are given back: two lines fit again.
        api.poll(&format!("/v1/batches/{a_id}"), "status", &["completed"]).await;
        let d = api.openai_batch(&chat_lines("d", 2)).await;
        let d_id = d.body["id"].as_str().unwrap().to_string();
        assert_eq!(api.get(&format!("/v1/batches/{d_id}")).await.body["status"], "in_progress");

        // The limit holds for each model apart: three lines of another fit beside them.
        let mut other = chat_lines("e", 3);
        other.iter_mut().for_each(|l| l["body"]["model"] = json!("sim-other"));
        assert_eq!(request_tokens(&other[0]["body"]), line, "a name as long");
        let e = api.openai_batch(&other).await;
        let e_id = e.body["id"].as_str().unwrap().to_string();
        assert_eq!(api.get(&format!("/v1/batches/{e_id}")).await.body["status"], "in_progress");

        let enqueued = sim.batch_stats().enqueued_tokens;
        let want: BTreeMap<String, u64> =
            [(a_id, 2 * line), (b_id, 2 * line), (c_id, line), (d_id, 2 * line), (e_id, 3 * line)].into();
        assert_eq!(enqueued, want);
        // Prompt bytes / 4: the 512 `max_tokens` are not counted.
        assert!(line < 100, "{line}");
    }

    #[tokio::test]
    async fn openai_counts_rise_while_in_progress_and_a_line_can_fail_without_an_http_answer() {
        let sim = SimProvider::start(SimConfig::default()).await;
        let api = Api::new(&sim);
        let lines = chat_lines("l", 4);
        sim.script_batches(BatchScript {
            progress_polls: 4,
            lines: [
                ("l-1".to_string(), LineFault::Status(500)),
                ("l-2".to_string(), LineFault::Error { code: "request_timeout" }),
            ]
            .into(),
            ..Default::default()
        });
        let created = api.openai_batch(&lines).await;
        let path = format!("/v1/batches/{}", created.body["id"].as_str().unwrap());
        let seen = api.poll(&path, "status", &["completed"]).await;
        let counts: Vec<(u64, u64, &str)> = seen
            .iter()
            .map(|b| {
                let c = &b["request_counts"];
                (c["completed"].as_u64().unwrap(), c["failed"].as_u64().unwrap(), b["status"].as_str().unwrap())
            })
            .collect();
        for pair in counts.windows(2) {
            assert!(pair[1].0 >= pair[0].0 && pair[1].1 >= pair[0].1, "a count fell: {counts:?}");
        }
        assert!(counts.iter().any(|(c, f, s)| *s == "in_progress" && *c > 0 && *f > 0), "live: {counts:?}");
        assert_eq!(counts.last().map(|(c, f, _)| (*c, *f)), Some((2, 2)), "{counts:?}");

        // The error file: the 5xx with its response, the timeout with `error` alone.
        let done = seen.last().unwrap();
        let errors = api.get(&format!("/v1/files/{}/content", done["error_file_id"].as_str().unwrap())).await;
        let lines: BTreeMap<String, Value> = errors
            .text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .map(|l| (custom_id(&l), l))
            .collect();
        assert_eq!(lines["l-1"]["response"]["status_code"], 500);
        assert_eq!(lines["l-1"]["error"], Value::Null);
        assert_eq!(lines["l-2"]["response"], Value::Null);
        assert_eq!(lines["l-2"]["error"]["code"], "request_timeout");
        assert_eq!(lines["l-2"]["error"]["message"], "The underlying call to the model timed out.");
        assert_eq!(sim.batch_stats().paid_lines.keys().collect::<Vec<_>>(), ["l-0", "l-3"]);
    }

    #[tokio::test]
    async fn anthropic_counts_stay_processing_until_the_end_and_a_result_errors_with_a_given_type() {
        let sim = SimProvider::start(SimConfig::default()).await;
        let api = Api::new(&sim);
        sim.script_batches(BatchScript {
            progress_polls: 3,
            lines: [("m-1".to_string(), LineFault::Error { code: "overloaded_error" })].into(),
            ..Default::default()
        });
        let requests: Vec<Value> = (0..3).map(|i| message_request(&format!("m-{i}"))).collect();
        let created = api.post("/v1/messages/batches", json!({"requests": requests})).await;
        let path = format!("/v1/messages/batches/{}", created.body["id"].as_str().unwrap());
        let seen = api.poll(&path, "processing_status", &["ended"]).await;
        for b in &seen[..seen.len() - 1] {
            let c = &b["request_counts"];
            assert_eq!(
                (c["processing"].as_u64(), c["succeeded"].as_u64(), c["errored"].as_u64()),
                (Some(3), Some(0), Some(0))
            );
            assert_eq!(b["ended_at"], Value::Null);
        }
        let ended = seen.last().unwrap();
        let c = &ended["request_counts"];
        assert_eq!(
            (c["processing"].as_u64(), c["succeeded"].as_u64(), c["errored"].as_u64()),
            (Some(0), Some(2), Some(1))
        );
        assert!(ended["ended_at"].is_string());
        let results = api.get(&format!("{path}/results")).await;
        let errored = results
            .text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .find(|l| l["custom_id"] == "m-1")
            .expect("its result");
        assert_eq!(errored["result"]["type"], "errored");
        assert_eq!(errored["result"]["error"]["type"], "error");
        assert_eq!(errored["result"]["error"]["error"]["type"], "overloaded_error");
    }

    /// Sends `request` and expects a 429 with exactly the hints given.
    async fn expect_429(request: impl std::future::Future<Output = Answer>, secs: Option<&str>, ms: Option<&str>) {
        let a = request.await;
        assert_eq!(a.status, 429, "{}", a.text);
        assert_eq!((header(&a, "retry-after").as_deref(), header(&a, "retry-after-ms").as_deref()), (secs, ms));
    }

    fn throttle(endpoint: Endpoint, secs: Option<u64>, ms: Option<u64>) -> Throttle {
        Throttle { endpoint, times: 1, retry_after_secs: secs, retry_after_ms: ms }
    }

    #[tokio::test]
    async fn every_openai_batch_endpoint_can_answer_429_with_hints_and_the_wait_is_recorded() {
        let sim = SimProvider::start(SimConfig::default()).await;
        let clock = ManualClock::at(1_000_000);
        sim.set_batch_clock(clock.clone());
        let api = Api::new(&sim);
        let lines = chat_lines("t", 2);
        // Made before any 429 is scripted, for the endpoints that need one.
        let ready = api.openai_batch(&lines).await.body["id"].as_str().unwrap().to_string();
        let done = api.poll(&format!("/v1/batches/{ready}"), "status", &["completed"]).await.pop().unwrap();
        let output = format!("/v1/files/{}/content", done["output_file_id"].as_str().unwrap());
        let file = api.upload(&lines).await.body["id"].clone();
        let create = json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h"});
        sim.script_batches(BatchScript {
            throttles: vec![
                throttle(Endpoint::Upload, Some(2), None),
                throttle(Endpoint::Create, Some(1), Some(1500)),
                throttle(Endpoint::Get, None, Some(250)),
                throttle(Endpoint::List, Some(3), None),
                throttle(Endpoint::Cancel, Some(1), None),
                throttle(Endpoint::FileContent, None, None),
            ],
            progress_polls: 5,
            ..Default::default()
        });

        expect_429(api.upload(&lines), Some("2"), None).await;
        clock.advance(Duration::from_secs(2));
        assert_eq!(api.upload(&lines).await.status, 200);

        expect_429(api.post("/v1/batches", create.clone()), Some("1"), Some("1500")).await;
        clock.advance(Duration::from_millis(1500));
        let created = api.post("/v1/batches", create).await;
        assert_eq!(created.status, 200);
        let id = created.body["id"].as_str().unwrap().to_string();

        let a = api.get(&format!("/v1/batches/{id}")).await;
        assert_eq!(a.body["error"]["code"], "rate_limit_exceeded", "the OpenAI shape: {}", a.text);
        assert_eq!((a.status, header(&a, "retry-after-ms").as_deref()), (429, Some("250")));
        clock.advance(Duration::from_millis(100));
        assert_eq!(api.get(&format!("/v1/batches/{id}")).await.status, 200, "retried too soon, and served");

        expect_429(api.get("/v1/batches?limit=5"), Some("3"), None).await;
        clock.advance(Duration::from_secs(4));
        assert_eq!(api.get("/v1/batches?limit=5").await.status, 200);

        expect_429(api.post(&format!("/v1/batches/{id}/cancel"), json!({})), Some("1"), None).await;
        clock.advance(Duration::from_secs(1));
        assert_eq!(api.post(&format!("/v1/batches/{id}/cancel"), json!({})).await.body["status"], "cancelled");

        expect_429(api.get(&output), None, None).await;
        assert_eq!(custom_ids(&api.get(&output).await.text).len(), 2);

        let log = sim.batch_stats().throttle_log;
        let waits: Vec<(Endpoint, Option<u64>, Option<u64>)> =
            log.iter().map(|t| (t.endpoint, t.hint_ms(), t.waited_ms())).collect();
        assert_eq!(
            waits,
            vec![
                (Endpoint::Upload, Some(2000), Some(2000)),
                (Endpoint::Create, Some(1500), Some(1500)),
                (Endpoint::Get, Some(250), Some(100)),
                (Endpoint::List, Some(3000), Some(4000)),
                (Endpoint::Cancel, Some(1000), Some(1000)),
                (Endpoint::FileContent, None, Some(0)),
            ]
        );
        assert_eq!(sim.batch_stats().throttled, 6);
    }

    #[tokio::test]
    async fn every_anthropic_batch_endpoint_can_answer_429_in_its_shape() {
        let sim = SimProvider::start(SimConfig::default()).await;
        let clock = ManualClock::at(5_000);
        sim.set_batch_clock(clock.clone());
        let api = Api::new(&sim);
        let body = json!({"requests": [message_request("r-0")]});
        let ended = api.post("/v1/messages/batches", body.clone()).await.body["id"].as_str().unwrap().to_string();
        api.poll(&format!("/v1/messages/batches/{ended}"), "processing_status", &["ended"]).await;
        let endpoints = [Endpoint::Create, Endpoint::Get, Endpoint::List, Endpoint::Cancel, Endpoint::Results];
        sim.script_batches(BatchScript {
            throttles: endpoints.iter().map(|e| Throttle { times: 2, ..throttle(*e, Some(7), None) }).collect(),
            ..Default::default()
        });
        let every = || async {
            vec![
                api.post("/v1/messages/batches", body.clone()).await,
                api.get(&format!("/v1/messages/batches/{ended}")).await,
                api.get("/v1/messages/batches?limit=1").await,
                api.post(&format!("/v1/messages/batches/{ended}/cancel"), json!({})).await,
                api.get(&format!("/v1/messages/batches/{ended}/results")).await,
            ]
        };
        for _ in 0..2 {
            for a in every().await {
                assert_eq!((a.status, header(&a, "retry-after").as_deref()), (429, Some("7")));
                assert_eq!(a.body["type"], "error");
                assert_eq!(a.body["error"]["type"], "rate_limit_error", "{}", a.text);
            }
            clock.advance(Duration::from_secs(7));
        }
        let served = every().await;
        assert!(served.iter().all(|a| a.status == 200), "the third of each is served");
        assert_eq!(custom_ids(&served[4].text), ["r-0"]);
        let log = sim.batch_stats().throttle_log;
        assert_eq!(log.len(), 10);
        assert!(log.iter().all(|t| t.waited_ms() == Some(7000)), "{log:?}");
    }

    #[tokio::test]
    async fn another_applications_message_batch_appears_in_the_crash_window_and_ends_on_its_own() {
        let sim = SimProvider::start(SimConfig::default()).await;
        let api = Api::new(&sim);
        sim.script_batches(BatchScript {
            hold_create: Some(HoldCreate::After),
            foreign_batches: 1,
            progress_polls: 2,
            ..Default::default()
        });
        let requests: Vec<Value> = (0..3).map(|i| message_request(&format!("ours-{i}"))).collect();
        let create = api.post("/v1/messages/batches", json!({"requests": requests}));
        let (created, listed) = tokio::join!(create, async {
            // In the crash window: ours is made, its answer not yet sent.
            let made = || async {
                let listed = api.get("/v1/messages/batches").await;
                (sim.batch_stats().creates_held == 1 && listed.body["data"].as_array()?.len() == 2).then_some(listed)
            };
            let listed = poll_until(Duration::from_secs(10), made).await.expect("the create is held, its batch made");
            sim.release_batches();
            listed
        });
        let ours = created.body["id"].as_str().unwrap().to_string();
        let stats = sim.batch_stats();
        let theirs = stats.foreign_batches.first().cloned().expect("a foreign batch");
        assert_ne!(theirs, ours);
        let ids: Vec<&str> =
            listed.body["data"].as_array().unwrap().iter().map(|b| b["id"].as_str().unwrap()).collect();
        assert_eq!(ids, [theirs.as_str(), ours.as_str()], "theirs is the newest");
        assert_eq!(listed.body["data"][0]["request_counts"]["processing"], 3, "as many requests as ours");
        assert_eq!((stats.batches_created, stats.lines_received), (1, 3), "only ours counted");

        // Ours is polled to its end; theirs ends too, unread.
        let path = format!("/v1/messages/batches/{ours}");
        api.poll(&path, "processing_status", &["ended"]).await;
        let list = api.get("/v1/messages/batches").await.body;
        assert!(list["data"].as_array().unwrap().iter().all(|b| b["processing_status"] == "ended"), "{list}");
        assert_eq!(custom_ids(&api.get(&format!("{path}/results")).await.text).len(), 3);
        let stats = sim.batch_stats();
        assert!(stats.foreign_touched().is_empty(), "{stats:?}");
        assert_eq!(stats.paid_lines.len(), 3, "their lines are not ours to pay");

        // Touching theirs shows, and it holds their own custom ids.
        let results = api.get(&format!("/v1/messages/batches/{theirs}/results")).await;
        let their_ids = custom_ids(&results.text);
        assert_eq!(their_ids.len(), 3);
        assert!(their_ids.iter().all(|id| id.starts_with("other-app-")), "{their_ids:?}");
        api.post(&format!("/v1/messages/batches/{theirs}/cancel"), json!({})).await;
        let stats = sim.batch_stats();
        assert_eq!(stats.foreign_touched(), std::slice::from_ref(&theirs));
        assert_eq!((stats.results_by_batch.get(&theirs), stats.cancels_by_batch.get(&theirs)), (Some(&1), Some(&1)));
        assert_eq!(stats.reads_by_batch.keys().collect::<Vec<_>>(), [&ours]);
    }

    #[tokio::test]
    async fn another_applications_openai_batch_has_none_of_our_metadata_and_ends_on_its_own() {
        let sim = SimProvider::start(SimConfig::default()).await;
        let api = Api::new(&sim);
        sim.script_batches(BatchScript { foreign_batches: 1, ..Default::default() });
        let ours = api.openai_batch(&chat_lines("ours", 2)).await.body["id"].as_str().unwrap().to_string();
        let listed = api.get("/v1/batches").await.body;
        let theirs = listed["data"][0].clone();
        assert_ne!(theirs["id"].as_str(), Some(ours.as_str()), "theirs is the newest");
        assert_eq!(
            (listed["first_id"].clone(), listed["last_id"].as_str()),
            (theirs["id"].clone(), Some(ours.as_str()))
        );
        assert_eq!(theirs["metadata"]["owner"], Value::Null);
        assert_eq!(theirs["request_counts"]["total"], 2);
        let theirs = theirs["id"].as_str().unwrap().to_string();

        api.poll(&format!("/v1/batches/{ours}"), "status", &["completed"]).await;
        let listed = api.get("/v1/batches").await.body;
        assert_eq!(listed["data"][0]["status"], "completed", "theirs ended unread: {listed}");
        let stats = sim.batch_stats();
        assert_eq!(stats.foreign_batches, std::slice::from_ref(&theirs));
        assert!(stats.foreign_touched().is_empty(), "{stats:?}");
        assert_eq!((stats.files_uploaded, stats.batches_created, stats.paid_lines.len()), (1, 1, 2));
        let output =
            api.get(&format!("/v1/files/{}/content", listed["data"][0]["output_file_id"].as_str().unwrap())).await;
        assert!(custom_ids(&output.text).iter().all(|id| id.starts_with("other-app-")));
        assert_eq!(sim.batch_stats().foreign_touched(), [theirs]);
    }

    #[tokio::test]
    async fn anthropic_lists_page_by_after_id_and_before_id() {
        let sim = SimProvider::start(SimConfig::default()).await;
        let api = Api::new(&sim);
        let mut made = Vec::new();
        for i in 0..5 {
            let a = api.post("/v1/messages/batches", json!({"requests": [message_request(&format!("p-{i}"))]})).await;
            made.push(a.body["id"].as_str().unwrap().to_string());
        }
        made.reverse();
        let ids = |page: &Value| -> Vec<String> {
            page["data"].as_array().unwrap().iter().map(|b| b["id"].as_str().unwrap().to_string()).collect()
        };
        let first = api.get("/v1/messages/batches?limit=2").await.body;
        assert_eq!((ids(&first), first["has_more"].as_bool()), (made[0..2].to_vec(), Some(true)));
        assert_eq!(
            (first["first_id"].as_str(), first["last_id"].as_str()),
            (Some(made[0].as_str()), Some(made[1].as_str()))
        );
        let second = api.get(&format!("/v1/messages/batches?limit=2&after_id={}", made[1])).await.body;
        assert_eq!((ids(&second), second["has_more"].as_bool()), (made[2..4].to_vec(), Some(true)));
        let last = api.get(&format!("/v1/messages/batches?limit=2&after_id={}", made[3])).await.body;
        assert_eq!((ids(&last), last["has_more"].as_bool()), (made[4..].to_vec(), Some(false)));
        let back = api.get(&format!("/v1/messages/batches?limit=2&before_id={}", made[2])).await.body;
        assert_eq!((ids(&back), back["has_more"].as_bool()), (made[0..2].to_vec(), Some(false)));
    }
}
