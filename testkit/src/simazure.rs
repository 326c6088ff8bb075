//! A simulated Azure OpenAI resource: deployments with their own models and TPM/RPM
//! limits, `api-key` or Entra bearer authentication, content filtering, and the Global
//! Batch API, in front of a simulated provider (`simprovider`) that writes the answers.
//! It owns Azure OpenAI's data-plane contract as read from Microsoft's documentation
//! and from what the service is seen to answer in public issue threads, independently
//! of this project's client, so a test can catch the client reading Azure wrong.
//!
//! What it answers, and where each rule comes from:
//! - `POST {endpoint}/openai/deployments/{deployment-id}/chat/completions?api-version=`
//!   with `api-version` a required query parameter and `messages` the only required
//!   body field: the body has no `model`, the deployment names it ("Azure OpenAI Service
//!   REST API reference", learn.microsoft.com/azure/ai-services/openai/reference, data
//!   plane inference `2024-10-21`; MicrosoftDocs/azure-ai-docs
//!   `includes/api-versions/latest-inference.md`). Here a body's `model` is ignored and
//!   replaced by the deployment's before the answer is written; the answer's `model` is
//!   the deployment's. `response_format: {"type": "json_schema", ...}` is passed to the
//!   simulated provider as is, which answers findings in the schema's shape.
//! - Without `api-version` the answer is 404 `{"error": {"code": "404", "message":
//!   "Resource not found"}}`, not a 400 (MicrosoftDocs/azure-docs#114602 "Chat
//!   completions API returns 404 if api-version is not present"; the same body in
//!   langchain-ai/langchain#13284, ThinkInAIXYZ/deepchat#262). Any path under
//!   `/openai/` not served here gets the same answer.
//! - Authentication: the key in the `api-key` header, or a Microsoft Entra token as
//!   `Authorization: Bearer <token>` (reference, "Authentication"). A wrong or missing key
//!   is 401 `{"error": {"code": "401", "message": "Access denied due to invalid
//!   subscription key or wrong API endpoint. Make sure to provide a valid key for an
//!   active subscription and use a correct regional API endpoint for your resource."}}`
//!   (SciSharp/BotSharp#386, microsoft/semantic-kernel#10337). A bearer token that is no
//!   valid Entra token, an API key sent as a bearer included, is 401 in another shape,
//!   `{"statusCode": 401, "message": "Unauthorized. Access token is missing, invalid,
//!   audience is incorrect (https://cognitiveservices.azure.com), or have expired."}`
//!   (run-llama/llama_index#12484, Azure-Samples/azure-search-openai-demo#2219).
//! - An unknown deployment is 404 `{"error": {"code": "DeploymentNotFound", "message":
//!   "The API deployment for this resource does not exist. If you created the deployment
//!   within the last 5 minutes, please wait a moment and try again."}}`
//!   (chatboxai/chatbox#646, Azure-Samples/azure-search-openai-demo-csharp#379).
//! - Limits per deployment ("Manage Azure OpenAI Service quota",
//!   learn.microsoft.com/azure/ai-services/openai/how-to/quota, "Understanding rate
//!   limits"): the TPM assigned to a deployment is its tokens-per-minute limit and "6 RPM
//!   per 1000 TPM" its requests limit (`AzureDeployment::standard`). A request's tokens
//!   are "estimated ... at the time the request is received" from the prompt text and
//!   `max_tokens` (and `best_of`); the estimate "is added to a running token count of all
//!   requests that is reset each minute. If at any time during that minute, the TPM rate
//!   limit value is reached, then further requests will receive a 429" (so the call that
//!   reaches the limit is still let through). RPM is evaluated "over a small period of
//!   time, typically 1 or 10 seconds": over the limit's share of that period new
//!   requests get 429 "until the next evaluation period".
//! - A 200 carries `x-ratelimit-remaining-requests` and `x-ratelimit-remaining-tokens`
//!   and neither the `x-ratelimit-limit-*` nor the `x-ratelimit-reset-*` headers of
//!   OpenAI: "the only headers that are available are x-ratelimit-remaining-requests and
//!   x-ratelimit-remaining-tokens" (Azure/azure-rest-api-specs#26884; the header dump in
//!   EvolvingPrograms/oaib#11; "Azure only returns a part of the rate limit headers",
//!   openai-php/client#307; only the Responses API, not simulated, has been seen sending
//!   `x-ratelimit-limit-tokens` and `x-ratelimit-reset-tokens`, openai/openai-dotnet#838).
//!   The requests count is of the short window: a 120 RPM
//!   deployment answers `x-ratelimit-remaining-requests: 19` after one call, a 300 RPM one
//!   50 before a burst and 45 after five ("Understanding Azure OpenAI's
//!   x-ratelimit-remaining-tokens and x-ratelimit-remaining-requests headers",
//!   clemenssiebler.com; Microsoft Q&A 2156987 "Rate limiting inconsistent with
//!   x-ratelimit-remaining-requests header"): a 10-second window with rpm / 6 requests.
//! - Over a limit: 429 `{"error": {"code": "429", "message": "Requests to the
//!   ChatCompletions_Create Operation under Azure OpenAI API version <v> have exceeded
//!   token rate limit of your current OpenAI S0 pricing tier. Please retry after <n>
//!   seconds. Please go here: https://aka.ms/oai/quotaincrease if you would like to
//!   further increase the default rate limit."}}` (jasonacox/TinyLLM#17,
//!   vanderschaarlab/climb#1, alex-wolf-ps/dbchatprov2#2, Microsoft Q&A 2140040), with
//!   `retry-after` in seconds and `retry-after-ms` ("the `retry-after-ms` and
//!   `retry-after` headers in the response tell you the time to wait", "Provisioned
//!   throughput" concept page; icereed/paperless-gpt#814 for `Retry-After` on standard
//!   deployments) and the remaining headers, as a 429's own dump shows them
//!   (openai/openai-python#937). The wait is to the end of the window that refused.
//! - Content filtering ("Azure OpenAI Service content filtering",
//!   learn.microsoft.com/azure/ai-services/openai/concepts/content-filter, "Scenario
//!   details" and "Annotations"): a filtered prompt is 400 with `error.code
//!   "content_filter"`, `param: "prompt"`, `status: 400` and `innererror: {"code":
//!   "ResponsibleAIPolicyViolation", "content_filter_result": {<category>: {"filtered",
//!   "severity"}}}`; a filtered completion is a 200 whose choice has `finish_reason:
//!   "content_filter"` and no content. The message, and the categories (`hate`,
//!   `jailbreak`, `self_harm`, `sexual`, `violence`), are the service's as quoted in
//!   vibrantlabsai/ragas#649 and simonw/research#16 ("The response was filtered due to
//!   the prompt triggering Azure OpenAI's content management policy. ..."); the page's
//!   own sample differs in words ("Azure Content management policy", `self-harm`), and
//!   the service is followed. Every 200 carries the annotations: top-level
//!   `prompt_filter_results` and `content_filter_results` on each choice. "When content
//!   filtering is triggered for a prompt and a status 400 is received ... there will be a
//!   charge for this request", and a 200 with `finish_reason: content_filter` is charged
//!   too: `AzureStats::billed_by_job` counts those; `paid_by_job` only 200s.
//! - Global Batch ("Getting started with Azure OpenAI global batch deployments",
//!   learn.microsoft.com/azure/ai-services/openai/how-to/batch, with its REST and Python
//!   includes): `POST /openai/files` (multipart, `purpose=batch`), `GET
//!   /openai/files/{id}`, `GET /openai/files/{id}/content`, `POST /openai/batches`
//!   (`input_file_id`, `endpoint: "/chat/completions"`, `completion_window: "24h"`),
//!   `GET /openai/batches/{id}`, `GET /openai/batches`, `POST
//!   /openai/batches/{id}/cancel`, all with `api-version`. "Each line of your input file
//!   ... has a `model` attribute that requires a global batch deployment name ... all
//!   names must be the same deployment name. This is different from OpenAI". Statuses
//!   `validating`, `failed`, `in_progress`, `finalizing`, `completed`, `expired`,
//!   `cancelling` (which "can take up to 10 minutes"), `cancelled`. "We do not expire
//!   the jobs that take longer" than 24 h. Output lines are `{"custom_id", "response":
//!   {"body", "request_id", "status_code"}, "error"}`, without OpenAI's line `id`, their
//!   bodies with the filter annotations; "Responses won't be returned in identical order"
//!   (here: the reverse of the input's). "Successful jobs will still generate an
//!   error_file_id, but it will be associated with an empty file with zero bytes."
//!   Validation errors are the article's table (`invalid_json_line`, `too_many_tasks`
//!   over 100,000, `url_mismatch`, `model_not_found`, `duplicate_custom_id`,
//!   `model_mismatch`, `invalid_request` for a deployment that is not Global-Batch) and
//!   its troubleshooting sample's `empty_file`, in `errors: {"object": "list", "data":
//!   [{"code", "message", "line", "param"}]}`. Enqueued tokens: "Until the batch job
//!   reaches a terminal state, those tokens will count against your total enqueued token
//!   limit" ("Global batch quota"), per deployment; over it the batch fails with
//!   `token_limit_exceeded`, "The number of enqueued tokens has surpassed the configured
//!   limit of 30K for the deployment 'gpt-4.1-batch'. Please either increase the limit or
//!   try again once the current jobs have finished." (Microsoft Q&A 2285577).
//! - Quota exhausted: Azure has no `insufficient_quota` (quota is TPM assigned to
//!   deployments, "Manage Azure OpenAI Service quota"); a subscription or deployment out
//!   of quota is answered the token 429 above with "Please retry after 86400 seconds"
//!   (jasonacox/TinyLLM#17, alex-wolf-ps/dbchatprov2#2, Microsoft Q&A 1938028):
//!   `Failure::QuotaExhausted` answers that, `retry-after: 86400`.
//!
//! Not confirmed, and chosen here:
//! - The RPM window: 10 s by default (`AzureConfig::rpm_window`), allowing rpm × window /
//!   60 s requests (at least one); the docs say "1 or 10 seconds", the headers seen fit
//!   10. Windows, the minute's and the short one, start at multiples of their length
//!   since the Unix epoch by the injected clock. A refused call is not counted.
//! - The token estimate: the request body's bytes / 4 (`simmeter::count`, as the rest of
//!   the test kit counts tokens; the docs say "based in part on the character count of
//!   the API request") plus `max_completion_tokens` or `max_tokens` times `n`, or
//!   `UNSET_MAX_TOKENS_ESTIMATE` when neither is set (the docs: "If the max_tokens
//!   parameter is not specified, the service estimates a value", provisioned page).
//! - The RPM 429's message says "call rate limit" where the token one says "token rate
//!   limit"; only the token wording is quoted in the threads read. A newer wording ("Your
//!   requests to <deployment> for <model> in <region> have exceeded the token rate limit
//!   ...", icereed/paperless-gpt#814) is not simulated. `x-rate-limit-reset-tokens` and
//!   `policy-id`, seen on a 429 in late 2023 (openai/openai-python#937), are not sent.
//! - The order of the checks: `api-version`, then the key, then the deployment, then the
//!   failure knob, then the limits, then the prompt filter.
//! - `RefuseKey(403)` answers `{"error": {"code": "PermissionDenied", "message": "The
//!   principal ... lacks the required data action ..."}}` (the shape seen on Foundry in
//!   davrous/AzureAgentToM365#3); a 5xx answers `{"error": {"code", "message"}}` with
//!   codes `InternalServerError` / `ServiceUnavailable`; a sync call to a Global-Batch
//!   deployment answers 400 `OperationNotSupported`.
//! - The filtered category (violence, high) and the filtered completion's `content:
//!   null` ("won't return any content").
//! - Batch: timestamps are Unix seconds and statuses lower case, as in the Batch object
//!   table and the Python sample (the REST sample shows `"Validating"` and RFC 3339 dates);
//!   an upload answers `status: "processed"`; `request_counts` are 0 while validating,
//!   `total` once validated, `completed`/`failed` once the lines ran (when the batch
//!   reaches `finalizing`); a completion window other than `24h` fails the batch at
//!   validation with `invalid_request`; a batch's enqueued tokens (the lines' `body` bytes
//!   / 4, `simbatch::request_tokens`) count from the end of its validation until it
//!   ends; a cancel makes it `cancelling` and the next read `cancelled`, with what ran; a
//!   line answered other than 200 goes to the error file with its status; an output file
//!   is made only when a line succeeded; a batch that failed validation has neither
//!   file; cancelling an ended batch is 409.
//!
//! Not simulated: streaming; the v1 API (`/openai/v1/...`); `Ocp-Apim-Subscription-Key`;
//! provisioned (PTU) and dynamic quota; the `$filter`/`$orderby` batch list; file
//! deletion, file expiry and the 500-file limit; content filtering of batch lines;
//! other operations (completions, embeddings); a bad `api-version` value (any is taken).
//!
//! Knobs: per deployment at run time (`SimAzure::set_failure`) 5xx, holding answers,
//! refusing every key, quota exhausted; filters by job id (`x-reviewlane-job-id`) or for
//! the next N calls. The answers themselves come from the wrapped `SimProvider`, whose
//! own knobs (latency, 5xx rate, scripts) apply to the calls let through and to batch
//! lines alike. `GET /stats` returns `AzureStats`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use reviewlane_core::clock::{self, SharedClock};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::http::HttpResponse;
use crate::simprovider::{JOB_ID_HEADER, PART_HEADER, SimConfig, SimProvider};

/// The `api-key` the default config accepts.
pub const SIM_API_KEY: &str = "sim-azure-key";
/// The Entra bearer token the default config accepts.
pub const SIM_BEARER_TOKEN: &str = "sim-entra-token";
/// Output tokens a call is estimated at when it sets neither `max_tokens` nor
/// `max_completion_tokens`.
pub const UNSET_MAX_TOKENS_ESTIMATE: u64 = 4096;
/// Most request lines in one batch input file (`too_many_tasks`).
pub const MAX_BATCH_LINES: usize = 100_000;

const MINUTE_MS: u64 = 60_000;
const DAY_S: u64 = 86_400;

/// One model deployment of the resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AzureDeployment {
    /// The deployment name callers put in the path (or a batch line's `model`).
    pub name: String,
    /// The model and version behind it, as answers report it (`gpt-4o-2024-08-06`).
    pub model: String,
    /// Requests per minute; `None`: unlimited (and no `-requests` header).
    pub rpm: Option<u32>,
    /// Tokens per minute; `None`: unlimited (and no `-tokens` header).
    pub tpm: Option<u32>,
    /// A Global-Batch deployment: served by the batch API only.
    pub global_batch: bool,
    /// Global batch: enqueued prompt tokens its unfinished batches may hold.
    pub enqueued_token_limit: Option<u64>,
}

impl AzureDeployment {
    /// A standard deployment of `tpm` tokens per minute and, as Azure sets it, 6 requests
    /// per minute per 1000 of them.
    pub fn standard(name: &str, model: &str, tpm: u32) -> AzureDeployment {
        let rpm = (u64::from(tpm) * 6 / 1000) as u32;
        AzureDeployment {
            name: name.into(),
            model: model.into(),
            rpm: Some(rpm),
            tpm: Some(tpm),
            global_batch: false,
            enqueued_token_limit: None,
        }
    }

    /// A Global-Batch deployment.
    pub fn global_batch(name: &str, model: &str, enqueued_token_limit: Option<u64>) -> AzureDeployment {
        AzureDeployment {
            name: name.into(),
            model: model.into(),
            rpm: None,
            tpm: None,
            global_batch: true,
            enqueued_token_limit,
        }
    }
}

/// Reads of a batch spent in each status before it moves on (a batch moves only when
/// read by id, so a test drives it by polling, with no clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSteps {
    pub validating: u32,
    pub in_progress: u32,
    pub finalizing: u32,
}

impl Default for BatchSteps {
    fn default() -> Self {
        BatchSteps { validating: 1, in_progress: 1, finalizing: 1 }
    }
}

#[derive(Clone)]
pub struct AzureConfig {
    pub deployments: Vec<AzureDeployment>,
    /// Keys accepted in the `api-key` header.
    pub api_keys: Vec<String>,
    /// Entra tokens accepted as `Authorization: Bearer <token>`.
    pub bearer_tokens: Vec<String>,
    /// The simulated provider that writes the answers.
    pub provider: SimConfig,
    /// Windows are read from this clock.
    pub clock: SharedClock,
    /// The short period RPM is evaluated over.
    pub rpm_window: Duration,
    pub batch_steps: BatchSteps,
}

impl Default for AzureConfig {
    fn default() -> Self {
        AzureConfig {
            deployments: Vec::new(),
            api_keys: vec![SIM_API_KEY.into()],
            bearer_tokens: vec![SIM_BEARER_TOKEN.into()],
            provider: SimConfig::default(),
            clock: clock::system(),
            rpm_window: Duration::from_secs(10),
            batch_steps: BatchSteps::default(),
        }
    }
}

/// A deployment's failure, switched on and off at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Every call let through is answered this status (500, 503, ...); a batch's lines too.
    Status5xx(u16),
    /// Every call let through is held this long before it is answered as usual.
    Timeout(Duration),
    /// Every key and token is refused with this status (401 or 403).
    RefuseKey(u16),
    /// The deployment has no quota left: 429, retry after a day.
    QuotaExhausted,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AzureStats {
    /// Every configured deployment's, from the start.
    pub deployments: BTreeMap<String, DeploymentStats>,
    /// Chat calls to a deployment that does not exist (404 `DeploymentNotFound`).
    pub unknown_deployment: u64,
    /// Requests answered 404 `Resource not found` (no `api-version`, or a path not served).
    pub not_found: u64,
    /// Requests to no known deployment refused for their key (files and batches included).
    pub unauthorized: u64,
    /// Chat calls per job id (`x-reviewlane-job-id`), every answer counted.
    pub calls_by_job: BTreeMap<String, u64>,
    /// Chat calls answered 200 per job id.
    pub paid_by_job: BTreeMap<String, u64>,
    /// Chat calls Azure charges per job id: 200s and prompts refused by the filter.
    pub billed_by_job: BTreeMap<String, u64>,
    /// Every chat call, in the order answered.
    pub calls: Vec<AzureCall>,
    pub files_uploaded: u64,
    pub batches_created: u64,
    /// Request lines in every batch created.
    pub batch_lines_received: u64,
    /// Batch lines answered 200, per custom id.
    pub paid_batch_lines: BTreeMap<String, u64>,
    /// Each validated batch's enqueued tokens, by batch id.
    pub enqueued_tokens: BTreeMap<String, u64>,
    /// Reads of each batch by id.
    pub batch_reads: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeploymentStats {
    pub calls: u64,
    pub ok: u64,
    /// 429 for TPM or RPM.
    pub rate_limited: u64,
    /// 429 for `Failure::QuotaExhausted`.
    pub quota_exhausted: u64,
    /// 400 `content_filter`.
    pub prompt_filtered: u64,
    /// 200 with `finish_reason: content_filter` (counted in `ok` too).
    pub completion_filtered: u64,
    /// 401 or 403.
    pub unauthorized: u64,
    pub server_errors: u64,
    /// Calls held by `Failure::Timeout`.
    pub held: u64,
    /// Estimated tokens let through per minute window (start, ms by the clock).
    pub tokens_by_minute: BTreeMap<u64, u64>,
    /// Requests let through per RPM window (start, ms by the clock).
    pub requests_by_window: BTreeMap<u64, u64>,
    /// Each rate-limit 429's `retry-after-ms`, in order.
    pub retry_after_ms: Vec<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct AzureCall {
    /// When it came (ms since the Unix epoch by the clock).
    pub at_ms: u64,
    pub deployment: String,
    pub job: String,
    pub status: u16,
}

/// The tokens Azure counts against TPM when a call arrives: its body's bytes / 4, plus
/// the output it may produce (`max_completion_tokens` or `max_tokens`, times `n`).
pub fn estimate_tokens(body: &Value) -> u64 {
    let prompt = crate::simmeter::count(body.to_string().len());
    let output = body["max_completion_tokens"]
        .as_u64()
        .or_else(|| body["max_tokens"].as_u64())
        .unwrap_or(UNSET_MAX_TOKENS_ESTIMATE);
    prompt + output * body["n"].as_u64().unwrap_or(1).max(1)
}

/// Which limit refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Limit {
    Requests,
    Tokens,
}

/// What is left in the current windows, for the headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Readings {
    requests_left: Option<u64>,
    tokens_left: Option<u64>,
}

impl Readings {
    fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Some(r) = self.requests_left {
            h.push(("x-ratelimit-remaining-requests", r.to_string()));
        }
        if let Some(t) = self.tokens_left {
            h.push(("x-ratelimit-remaining-tokens", t.to_string()));
        }
        h
    }
}

struct Refusal {
    limit: Limit,
    wait_ms: u64,
    readings: Readings,
}

/// A deployment's counters: the current minute's tokens and the current short window's
/// requests, each dropped whole when the next window starts.
struct Meter {
    window_ms: u64,
    per_window: Option<u64>,
    tpm: Option<u64>,
    requests: (u64, u64),
    tokens: (u64, u64),
}

impl Meter {
    fn new(d: &AzureDeployment, window: Duration) -> Meter {
        let window_ms = (window.as_millis() as u64).max(1);
        Meter {
            window_ms,
            per_window: d.rpm.map(|rpm| (u64::from(rpm) * window_ms / MINUTE_MS).max(1)),
            tpm: d.tpm.map(u64::from),
            requests: (0, 0),
            tokens: (0, 0),
        }
    }

    fn roll(&mut self, now: u64) {
        let start = now - now % self.window_ms;
        if start != self.requests.0 {
            self.requests = (start, 0);
        }
        let minute = now - now % MINUTE_MS;
        if minute != self.tokens.0 {
            self.tokens = (minute, 0);
        }
    }

    fn readings(&self) -> Readings {
        Readings {
            requests_left: self.per_window.map(|p| p.saturating_sub(self.requests.1)),
            tokens_left: self.tpm.map(|t| t.saturating_sub(self.tokens.1)),
        }
    }

    /// Lets a call estimated at `estimate` tokens through at `now`, or says which limit
    /// refused it and how long until its window ends.
    fn admit(&mut self, now: u64, estimate: u64) -> Result<Readings, Refusal> {
        self.roll(now);
        if self.tpm.is_some_and(|tpm| self.tokens.1 >= tpm) {
            let wait_ms = self.tokens.0 + MINUTE_MS - now;
            return Err(Refusal { limit: Limit::Tokens, wait_ms, readings: self.readings() });
        }
        if self.per_window.is_some_and(|p| self.requests.1 >= p) {
            let wait_ms = self.requests.0 + self.window_ms - now;
            return Err(Refusal { limit: Limit::Requests, wait_ms, readings: self.readings() });
        }
        self.requests.1 += 1;
        self.tokens.1 += estimate;
        Ok(self.readings())
    }
}

/// Who the filters refuse.
#[derive(Default)]
struct Filters {
    prompt_jobs: HashSet<String>,
    completion_jobs: HashSet<String>,
    next_prompts: u32,
    next_completions: u32,
}

fn take(jobs: &HashSet<String>, next: &mut u32, job: &str) -> bool {
    if jobs.contains(job) {
        return true;
    }
    let hit = *next > 0;
    *next = next.saturating_sub(1);
    hit
}

struct StoredFile {
    id: String,
    filename: String,
    purpose: &'static str,
    created_at: u64,
    bytes: Bytes,
}

impl StoredFile {
    fn json(&self) -> Value {
        json!({
            "id": self.id, "object": "file", "bytes": self.bytes.len(), "created_at": self.created_at,
            "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": null,
        })
    }
}

struct Batch {
    id: String,
    seq: u64,
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    metadata: Value,
    status: &'static str,
    /// Reads in the current status.
    reads: u32,
    created_at: u64,
    in_progress_at: Option<u64>,
    finalizing_at: Option<u64>,
    completed_at: Option<u64>,
    failed_at: Option<u64>,
    cancelling_at: Option<u64>,
    cancelled_at: Option<u64>,
    /// The input file's lines, as uploaded.
    lines: Vec<String>,
    /// Set at validation: the deployment its lines name, and their enqueued tokens.
    deployment: Option<String>,
    tokens: u64,
    total: usize,
    completed: usize,
    failed: usize,
    /// Its lines are being answered (a read meanwhile changes nothing).
    running: bool,
    ok_lines: Vec<Value>,
    error_lines: Vec<Value>,
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    errors: Option<Value>,
}

impl Batch {
    fn set_status(&mut self, status: &'static str, now_s: u64) {
        self.status = status;
        self.reads = 0;
        let at = Some(now_s);
        match status {
            "in_progress" => self.in_progress_at = at,
            "finalizing" => self.finalizing_at = at,
            "completed" => self.completed_at = at,
            "failed" => self.failed_at = at,
            "cancelling" => self.cancelling_at = at,
            "cancelled" => self.cancelled_at = at,
            _ => {}
        }
    }

    /// Holds enqueued tokens: validated, not ended.
    fn admitted(&self) -> bool {
        matches!(self.status, "in_progress" | "finalizing" | "cancelling")
    }

    fn json(&self) -> Value {
        json!({
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": self.errors,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at,
            "expires_at": self.created_at + DAY_S, "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at, "failed_at": self.failed_at, "expired_at": null,
            "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        })
    }
}

/// A batch's lines to answer, taken out under the lock.
struct LineRun {
    lines: Vec<Value>,
    deployment: AzureDeployment,
    failure: Option<Failure>,
}

#[derive(Default)]
struct Inner {
    meters: HashMap<String, Meter>,
    failures: HashMap<String, Failure>,
    filters: Filters,
    stats: AzureStats,
    files: HashMap<String, StoredFile>,
    batches: BTreeMap<String, Batch>,
    seq: u64,
}

impl Inner {
    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn deployment(&mut self, name: &str) -> &mut DeploymentStats {
        self.stats.deployments.entry(name.to_string()).or_default()
    }

    fn store_file(&mut self, filename: String, purpose: &'static str, now_s: u64, bytes: Bytes) -> String {
        let id = format!("file-{:032x}", self.next_seq());
        let file = StoredFile { id: id.clone(), filename, purpose, created_at: now_s, bytes };
        self.files.insert(id.clone(), file);
        id
    }
}

/// How a chat call ended, for the stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok { filtered: bool },
    RateLimited(u64),
    QuotaExhausted,
    PromptFiltered,
    Unauthorized,
    UnknownDeployment,
    ServerError,
    Other,
}

struct State {
    config: AzureConfig,
    deployments: HashMap<String, AzureDeployment>,
    provider: SimProvider,
    client: reqwest::Client,
    inner: Mutex<Inner>,
    request_ids: AtomicU64,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("azure lock")
    }

    fn now_s(&self) -> u64 {
        self.config.clock.now_ms() / 1000
    }

    fn request_id(&self) -> String {
        let n = self.request_ids.fetch_add(1, Ordering::SeqCst) + 1;
        format!("{n:08x}-0000-4000-8000-{n:012x}")
    }

    /// Records a chat call's end and hands its answer back.
    fn finished(
        &self,
        at_ms: u64,
        deployment: &str,
        job: &str,
        outcome: Outcome,
        answer: HttpResponse,
    ) -> HttpResponse {
        let status = answer.status().as_u16();
        let mut inner = self.lock();
        let s = &mut inner.stats;
        match outcome {
            Outcome::UnknownDeployment => s.unknown_deployment += 1,
            Outcome::Unauthorized if !self.deployments.contains_key(deployment) => s.unauthorized += 1,
            _ => {}
        }
        if matches!(outcome, Outcome::Ok { .. } | Outcome::PromptFiltered) {
            *s.billed_by_job.entry(job.to_string()).or_default() += 1;
        }
        if matches!(outcome, Outcome::Ok { .. }) {
            *s.paid_by_job.entry(job.to_string()).or_default() += 1;
        }
        s.calls.push(AzureCall { at_ms, deployment: deployment.to_string(), job: job.to_string(), status });
        if self.deployments.contains_key(deployment) {
            let d = inner.deployment(deployment);
            match outcome {
                Outcome::Ok { filtered } => {
                    d.ok += 1;
                    d.completion_filtered += u64::from(filtered);
                }
                Outcome::RateLimited(ms) => {
                    d.rate_limited += 1;
                    d.retry_after_ms.push(ms);
                }
                Outcome::QuotaExhausted => d.quota_exhausted += 1,
                Outcome::PromptFiltered => d.prompt_filtered += 1,
                Outcome::Unauthorized => d.unauthorized += 1,
                Outcome::ServerError => d.server_errors += 1,
                Outcome::UnknownDeployment | Outcome::Other => {}
            }
        }
        answer
    }
}

/// A running simulated Azure OpenAI resource and the provider behind it; stops when
/// dropped.
pub struct SimAzure {
    addr: SocketAddr,
    state: Arc<State>,
    _server: crate::http::Server,
}

impl SimAzure {
    /// Starts on 127.0.0.1, a free port.
    pub async fn start(config: AzureConfig) -> SimAzure {
        let deployments: HashMap<String, AzureDeployment> =
            config.deployments.iter().map(|d| (d.name.clone(), d.clone())).collect();
        let meters = deployments.values().map(|d| (d.name.clone(), Meter::new(d, config.rpm_window))).collect();
        let stats = AzureStats {
            deployments: deployments.keys().map(|name| (name.clone(), DeploymentStats::default())).collect(),
            ..AzureStats::default()
        };
        let state = Arc::new(State {
            provider: SimProvider::start(config.provider.clone()).await,
            client: reqwest::Client::new(),
            inner: Mutex::new(Inner { meters, stats, ..Inner::default() }),
            request_ids: AtomicU64::new(0),
            deployments,
            config,
        });
        let st = state.clone();
        let server = crate::http::serve(move |req| handle(st.clone(), req)).await;
        SimAzure { addr: server.addr, state, _server: server }
    }

    /// The resource endpoint, `http://127.0.0.1:port` (paths start with `/openai/`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> AzureStats {
        self.state.lock().stats.clone()
    }

    /// The provider writing the answers (it sees the calls let through and batch lines).
    pub fn provider(&self) -> &SimProvider {
        &self.state.provider
    }

    /// Every prompt of this job id is refused by the content filter (400).
    pub fn filter_prompt(&self, job_id: &str) {
        self.state.lock().filters.prompt_jobs.insert(job_id.to_string());
    }

    /// Every completion of this job id is filtered (200, `finish_reason: content_filter`).
    pub fn filter_completion(&self, job_id: &str) {
        self.state.lock().filters.completion_jobs.insert(job_id.to_string());
    }

    /// The next `n` prompts let through, whatever their job, are refused by the filter.
    pub fn filter_next_prompts(&self, n: u32) {
        self.state.lock().filters.next_prompts = n;
    }

    /// The next `n` completions, whatever their job, are filtered.
    pub fn filter_next_completions(&self, n: u32) {
        self.state.lock().filters.next_completions = n;
    }

    pub fn clear_filters(&self) {
        self.state.lock().filters = Filters::default();
    }

    /// Makes a deployment fail from now on, or (`None`) work again.
    pub fn set_failure(&self, deployment: &str, failure: Option<Failure>) {
        let mut inner = self.state.lock();
        match failure {
            Some(f) => inner.failures.insert(deployment.to_string(), f),
            None => inner.failures.remove(deployment),
        };
    }
}

fn respond(status: StatusCode, headers: &[(&str, String)], body: impl Into<Bytes>) -> HttpResponse {
    let mut b = Response::builder().status(status).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, v.as_str());
    }
    b.body(Full::new(body.into())).expect("response builds")
}

fn error(status: StatusCode, code: &str, message: &str) -> HttpResponse {
    respond(status, &[], json!({"error": {"code": code, "message": message}}).to_string())
}

fn resource_not_found() -> HttpResponse {
    error(StatusCode::NOT_FOUND, "404", "Resource not found")
}

/// Whether a request's credentials pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Auth {
    Ok,
    BadKey,
    BadToken,
}

fn authorize(config: &AzureConfig, headers: &hyper::HeaderMap) -> Auth {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let key = get("api-key");
    let bearer = get("authorization").and_then(|a| a.strip_prefix("Bearer "));
    if key.is_some_and(|k| config.api_keys.iter().any(|a| a == k))
        || bearer.is_some_and(|t| config.bearer_tokens.iter().any(|b| b == t))
    {
        return Auth::Ok;
    }
    if bearer.is_some() && key.is_none() { Auth::BadToken } else { Auth::BadKey }
}

fn unauthorized(auth: Auth) -> HttpResponse {
    if auth == Auth::BadToken {
        let body = json!({"statusCode": 401, "message": "Unauthorized. Access token is missing, invalid, audience is \
            incorrect (https://cognitiveservices.azure.com), or have expired."});
        return respond(StatusCode::UNAUTHORIZED, &[], body.to_string());
    }
    error(
        StatusCode::UNAUTHORIZED,
        "401",
        "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key for an \
         active subscription and use a correct regional API endpoint for your resource.",
    )
}

/// `Failure::RefuseKey`: 401 as for a wrong key, or 403 as for a principal without the
/// data action.
fn refused(status: u16) -> HttpResponse {
    if status == 401 {
        return unauthorized(Auth::BadKey);
    }
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN);
    error(
        status,
        "PermissionDenied",
        "The principal `sim-principal` lacks the required data action \
         `Microsoft.CognitiveServices/accounts/OpenAI/deployments/chat/completions/action` to perform `POST \
         /openai/deployments/{deployment-id}/chat/completions` operation.",
    )
}

fn deployment_not_found() -> HttpResponse {
    error(
        StatusCode::NOT_FOUND,
        "DeploymentNotFound",
        "The API deployment for this resource does not exist. If you created the deployment within the last 5 \
         minutes, please wait a moment and try again.",
    )
}

fn server_error(status: u16) -> HttpResponse {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let (code, message) = match status.as_u16() {
        503 => {
            ("ServiceUnavailable", "The service is temporarily unable to process your request. Please try again later.")
        }
        _ => ("InternalServerError", "The server had an error while processing your request. Sorry about that!"),
    };
    error(status, code, message)
}

/// The 429 of an exhausted rate limit, or (86400 s) of a deployment with no quota left.
fn too_many(limit: Limit, api_version: &str, wait_ms: u64, readings: Readings) -> HttpResponse {
    let secs = wait_ms.div_ceil(1000).max(1);
    let what = match limit {
        Limit::Tokens => "token rate limit",
        Limit::Requests => "call rate limit",
    };
    let message = format!(
        "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version {api_version} have exceeded \
         {what} of your current OpenAI S0 pricing tier. Please retry after {secs} seconds. Please go here: \
         https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."
    );
    let mut headers = vec![("retry-after", secs.to_string()), ("retry-after-ms", wait_ms.to_string())];
    headers.extend(readings.headers());
    respond(StatusCode::TOO_MANY_REQUESTS, &headers, json!({"error": {"code": "429", "message": message}}).to_string())
}

fn safe(category: &str) -> Value {
    match category {
        "jailbreak" => json!({"filtered": false, "detected": false}),
        _ => json!({"filtered": false, "severity": "safe"}),
    }
}

/// Annotations of content nothing was found in; `flag` marks violence filtered.
fn filter_results(prompt: bool, flag: bool) -> Value {
    let mut r = json!({"hate": safe("hate"), "self_harm": safe("self_harm"), "sexual": safe("sexual"),
        "violence": safe("violence")});
    if prompt {
        r["jailbreak"] = safe("jailbreak");
    }
    if flag {
        r["violence"] = json!({"filtered": true, "severity": "high"});
    }
    r
}

fn prompt_filtered() -> HttpResponse {
    let body = json!({"error": {
        "message": "The response was filtered due to the prompt triggering Azure OpenAI's content management policy. \
            Please modify your prompt and retry. To learn more about our content filtering policies please read our \
            documentation: https://go.microsoft.com/fwlink/?linkid=2198766",
        "type": null,
        "param": "prompt",
        "code": "content_filter",
        "status": 400,
        "innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": filter_results(true, true)},
    }});
    respond(StatusCode::BAD_REQUEST, &[], body.to_string())
}

/// The provider's chat completion as Azure answers it: the deployment's model, the
/// filter annotations, and (`filtered`) the completion withheld.
fn azure_answer(provider_body: &[u8], model: &str, created: u64, filtered: bool) -> Value {
    let mut v: Value = serde_json::from_slice(provider_body).unwrap_or_else(|_| json!({"choices": []}));
    v["model"] = json!(model);
    v["created"] = json!(created);
    v["object"] = json!("chat.completion");
    v["prompt_filter_results"] = json!([{"prompt_index": 0, "content_filter_results": filter_results(true, false)}]);
    for (i, choice) in v["choices"].as_array_mut().into_iter().flatten().enumerate() {
        let flag = filtered && i == 0;
        choice["content_filter_results"] = filter_results(false, flag);
        if flag {
            choice["finish_reason"] = json!("content_filter");
            choice["message"]["content"] = Value::Null;
        }
    }
    v
}

/// The value of query parameter `name`.
fn param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
}

async fn handle(st: Arc<State>, req: Request<Incoming>) -> Result<HttpResponse, Infallible> {
    let path = req.uri().path().to_string();
    let method = req.method().as_str().to_string();
    if req.method() == Method::GET && path == "/stats" {
        let body = serde_json::to_string(&st.lock().stats).expect("stats serialize");
        return Ok(respond(StatusCode::OK, &[], body));
    }
    let query = req.uri().query().unwrap_or_default().to_string();
    let Some(api_version) = param(&query, "api-version").filter(|v| !v.is_empty()) else {
        st.lock().stats.not_found += 1;
        return Ok(resource_not_found());
    };
    let parts: Vec<String> = path.trim_matches('/').split('/').map(str::to_string).collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    if let ("POST", ["openai", "deployments", name, "chat", "completions"]) = (method.as_str(), parts.as_slice()) {
        let name = name.to_string();
        return Ok(chat(&st, req, name, api_version).await);
    }
    let auth = authorize(&st.config, req.headers());
    if auth != Auth::Ok {
        st.lock().stats.unauthorized += 1;
        return Ok(unauthorized(auth));
    }
    let answer = match (method.as_str(), parts.as_slice()) {
        ("POST", ["openai", "files"]) => upload(&st, req).await,
        ("GET", ["openai", "files", id]) => file(&st, id, false),
        ("GET", ["openai", "files", id, "content"]) => file(&st, id, true),
        ("POST", ["openai", "batches"]) => {
            let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            create_batch(&st, &body)
        }
        ("GET", ["openai", "batches"]) => list_batches(&st, &query),
        ("GET", ["openai", "batches", id]) => get_batch(&st, id).await,
        ("POST", ["openai", "batches", id, "cancel"]) => cancel_batch(&st, id),
        _ => {
            st.lock().stats.not_found += 1;
            resource_not_found()
        }
    };
    Ok(answer)
}

/// One chat completion: key, deployment, failure knob, limits, prompt filter, then the
/// provider's answer.
async fn chat(st: &State, req: Request<Incoming>, name: String, api_version: String) -> HttpResponse {
    let header = |n: &str| req.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
    let job = header(JOB_ID_HEADER).unwrap_or_default();
    let passed: Vec<(&str, String)> =
        [JOB_ID_HEADER, PART_HEADER].into_iter().filter_map(|n| header(n).map(|v| (n, v))).collect();
    let at = st.config.clock.now_ms();
    let auth = authorize(&st.config, req.headers());
    let deployment = st.deployments.get(&name).cloned();
    let failure = {
        let mut inner = st.lock();
        *inner.stats.calls_by_job.entry(job.clone()).or_default() += 1;
        if deployment.is_some() {
            inner.deployment(&name).calls += 1;
        }
        inner.failures.get(&name).copied()
    };
    let done = |outcome, answer| st.finished(at, &name, &job, outcome, answer);
    if auth != Auth::Ok {
        return done(Outcome::Unauthorized, unauthorized(auth));
    }
    let Some(deployment) = deployment else {
        return done(Outcome::UnknownDeployment, deployment_not_found());
    };
    if deployment.global_batch {
        let message = format!(
            "The chatCompletion operation does not work with the specified deployment, {}. It is a Global-Batch \
             deployment: use the batch API.",
            deployment.name
        );
        return done(Outcome::Other, error(StatusCode::BAD_REQUEST, "OperationNotSupported", &message));
    }
    match failure {
        Some(Failure::RefuseKey(status)) => return done(Outcome::Unauthorized, refused(status)),
        Some(Failure::QuotaExhausted) => {
            let readings = Readings { requests_left: None, tokens_left: Some(0) };
            return done(Outcome::QuotaExhausted, too_many(Limit::Tokens, &api_version, DAY_S * 1000, readings));
        }
        _ => {}
    }
    let bytes = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        return done(
            Outcome::Other,
            error(StatusCode::BAD_REQUEST, "BadRequest", "The request body is not valid JSON."),
        );
    };
    let estimate = estimate_tokens(&body);
    let admitted = {
        let mut inner = st.lock();
        let meter = inner.meters.get_mut(&name).expect("every deployment has a meter");
        let admitted = meter.admit(at, estimate);
        let (window, minute) = (meter.requests.0, meter.tokens.0);
        if admitted.is_ok() {
            let d = inner.deployment(&name);
            *d.requests_by_window.entry(window).or_default() += 1;
            *d.tokens_by_minute.entry(minute).or_default() += estimate;
        }
        admitted
    };
    let readings = match admitted {
        Ok(r) => r,
        Err(r) => {
            return done(Outcome::RateLimited(r.wait_ms), too_many(r.limit, &api_version, r.wait_ms, r.readings));
        }
    };
    match failure {
        Some(Failure::Status5xx(status)) => return done(Outcome::ServerError, server_error(status)),
        Some(Failure::Timeout(hold)) => {
            st.lock().deployment(&name).held += 1;
            tokio::time::sleep(hold).await;
        }
        _ => {}
    }
    let refuse_prompt = {
        let mut inner = st.lock();
        let f = &mut inner.filters;
        take(&f.prompt_jobs, &mut f.next_prompts, &job)
    };
    if refuse_prompt {
        return done(Outcome::PromptFiltered, prompt_filtered());
    }
    let (status, answer) = forward(st, &deployment, body, &passed).await;
    if status != 200 {
        let outcome = if status >= 500 { Outcome::ServerError } else { Outcome::Other };
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        return done(outcome, respond(status, &[], answer));
    }
    let filtered = {
        let mut inner = st.lock();
        let f = &mut inner.filters;
        take(&f.completion_jobs, &mut f.next_completions, &job)
    };
    let body = azure_answer(&answer, &deployment.model, at / 1000, filtered);
    let mut headers = readings.headers();
    let id = st.request_id();
    headers.extend([("apim-request-id", id.clone()), ("x-request-id", id), ("x-ms-region", "Sim Region".into())]);
    done(Outcome::Ok { filtered }, respond(StatusCode::OK, &headers, body.to_string()))
}

/// Sends a body to the provider as the deployment's model; its status and answer.
async fn forward(st: &State, deployment: &AzureDeployment, mut body: Value, passed: &[(&str, String)]) -> (u16, Bytes) {
    body["model"] = json!(deployment.model);
    let mut request = st.client.post(format!("{}/chat/completions", st.provider.base_url())).json(&body);
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
    answered.unwrap_or_else(|_| {
        let body = json!({"error": {"code": "InternalServerError", "message": "The model did not answer."}});
        (500, Bytes::from(body.to_string()))
    })
}

async fn upload(st: &State, req: Request<Incoming>) -> HttpResponse {
    let content_type = req.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let Some((filename, bytes)) = crate::simbatch::parse_upload(&content_type, body).await else {
        return error(StatusCode::BAD_REQUEST, "invalidPayload", "A multipart file with purpose 'batch' is required.");
    };
    let now_s = st.now_s();
    let mut inner = st.lock();
    inner.stats.files_uploaded += 1;
    let id = inner.store_file(filename, "batch", now_s, bytes);
    respond(StatusCode::OK, &[], inner.files[&id].json().to_string())
}

fn file(st: &State, id: &str, content: bool) -> HttpResponse {
    let inner = st.lock();
    let Some(f) = inner.files.get(id) else {
        return error(StatusCode::NOT_FOUND, "NotFound", &format!("File with id '{id}' was not found."));
    };
    if !content {
        return respond(StatusCode::OK, &[], f.json().to_string());
    }
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/octet-stream")
        .body(Full::new(f.bytes.clone()))
        .expect("response builds")
}

fn create_batch(st: &State, body: &[u8]) -> HttpResponse {
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return error(StatusCode::BAD_REQUEST, "invalid_request", "The request body is not valid JSON.");
    };
    let input_file_id = request["input_file_id"].as_str().unwrap_or_default().to_string();
    let now_s = st.now_s();
    let mut inner = st.lock();
    let Some(file) = inner.files.get(&input_file_id) else {
        let message = format!("The input file '{input_file_id}' was not found.");
        return error(StatusCode::BAD_REQUEST, "invalid_request", &message);
    };
    let text = String::from_utf8_lossy(&file.bytes).into_owned();
    let lines: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    let seq = inner.next_seq();
    let id = format!("batch_{seq:08x}-0000-4000-8000-{seq:012x}");
    inner.stats.batches_created += 1;
    inner.stats.batch_lines_received += lines.len() as u64;
    let batch = Batch {
        id: id.clone(),
        seq,
        input_file_id,
        endpoint: request["endpoint"].as_str().unwrap_or_default().to_string(),
        completion_window: request["completion_window"].as_str().unwrap_or_default().to_string(),
        metadata: request.get("metadata").cloned().unwrap_or(Value::Null),
        status: "validating",
        reads: 0,
        created_at: now_s,
        in_progress_at: None,
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        cancelling_at: None,
        cancelled_at: None,
        lines,
        deployment: None,
        tokens: 0,
        total: 0,
        completed: 0,
        failed: 0,
        running: false,
        ok_lines: Vec::new(),
        error_lines: Vec::new(),
        output_file_id: None,
        error_file_id: None,
        errors: None,
    };
    let answer = batch.json();
    inner.batches.insert(id, batch);
    respond(StatusCode::OK, &[], answer.to_string())
}

fn line_error(code: &str, message: String, line: Option<usize>) -> Value {
    json!({"code": code, "message": message, "line": line, "param": null})
}

/// `30K`, `2M`, as the enqueued-token message writes a limit.
fn short_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n.is_multiple_of(1_000_000) => format!("{}M", n / 1_000_000),
        n if n >= 1000 && n.is_multiple_of(1000) => format!("{}K", n / 1000),
        n => n.to_string(),
    }
}

/// A batch's input checked as the article's error table says: the deployment its lines
/// name and their enqueued tokens, or the errors.
fn validate(batch: &Batch, deployments: &HashMap<String, AzureDeployment>) -> Result<(String, u64), Vec<Value>> {
    if batch.completion_window != "24h" {
        let message = format!("The completion window '{}' is not supported; it must be 24h.", batch.completion_window);
        return Err(vec![line_error("invalid_request", message, None)]);
    }
    if batch.lines.is_empty() {
        let message = "The input file is empty. Please ensure that the batch contains at least one request.".into();
        return Err(vec![line_error("empty_file", message, None)]);
    }
    if batch.lines.len() > MAX_BATCH_LINES {
        let message =
            format!("The number of requests in the input file exceeds the maximum allowed value of {MAX_BATCH_LINES}.");
        return Err(vec![line_error("too_many_tasks", message, None)]);
    }
    let mut errors = Vec::new();
    let mut ids = HashSet::new();
    let (mut first, mut tokens) = (None::<String>, 0);
    for (i, raw) in batch.lines.iter().enumerate() {
        let n = Some(i + 1);
        let Ok(line) = serde_json::from_str::<Value>(raw) else {
            errors.push(line_error("invalid_json_line", "This line is not valid JSON.".into(), n));
            continue;
        };
        if batch.endpoint != "/chat/completions" || line["url"].as_str() != Some(batch.endpoint.as_str()) {
            let message = "The URL of this request does not match the batch's endpoint, /chat/completions.".into();
            errors.push(line_error("url_mismatch", message, n));
            continue;
        }
        let model = line["body"]["model"].as_str().unwrap_or_default();
        let Some(deployment) = deployments.get(model) else {
            let message = format!("The model deployment '{model}' was not found.");
            errors.push(line_error("model_not_found", message, n));
            continue;
        };
        if first.get_or_insert_with(|| model.to_string()) != model {
            let message = "The model deployment of this request does not match the rest of the file.".into();
            errors.push(line_error("model_mismatch", message, n));
            continue;
        }
        if !deployment.global_batch {
            let message = format!("The deployment '{model}' is not a Global-Batch deployment.");
            errors.push(line_error("invalid_request", message, n));
            continue;
        }
        if !ids.insert(line["custom_id"].as_str().unwrap_or_default().to_string()) {
            let message = "The custom ID for this request is a duplicate of the custom ID in another request.".into();
            errors.push(line_error("duplicate_custom_id", message, n));
            continue;
        }
        tokens += crate::simbatch::request_tokens(&line["body"]);
    }
    match (errors.is_empty(), first) {
        (true, Some(deployment)) => Ok((deployment, tokens)),
        _ => Err(errors),
    }
}

/// Moves a batch one read on; when its lines are due, takes them out to be answered.
fn step(inner: &mut Inner, st: &State, id: &str) -> Option<LineRun> {
    let now_s = st.now_s();
    let steps = st.config.batch_steps;
    let (status, reads) = {
        let b = inner.batches.get_mut(id)?;
        if b.running {
            return None;
        }
        b.reads += 1;
        (b.status, b.reads)
    };
    match status {
        "validating" if reads > steps.validating => {
            let checked = validate(&inner.batches[id], &st.deployments);
            let checked = checked.and_then(|(deployment, tokens)| {
                let held: u64 = inner
                    .batches
                    .values()
                    .filter(|b| b.admitted() && b.deployment.as_deref() == Some(deployment.as_str()))
                    .map(|b| b.tokens)
                    .sum();
                match st.deployments[&deployment].enqueued_token_limit {
                    Some(limit) if held + tokens > limit => {
                        let message = format!(
                            "The number of enqueued tokens has surpassed the configured limit of {} for the \
                             deployment '{deployment}'. Please either increase the limit or try again once the \
                             current jobs have finished.",
                            short_count(limit)
                        );
                        Err(vec![line_error("token_limit_exceeded", message, None)])
                    }
                    _ => Ok((deployment, tokens)),
                }
            });
            let b = inner.batches.get_mut(id).expect("batch");
            match checked {
                Ok((deployment, tokens)) => {
                    b.deployment = Some(deployment);
                    b.tokens = tokens;
                    b.total = b.lines.len();
                    b.set_status("in_progress", now_s);
                    inner.stats.enqueued_tokens.insert(id.to_string(), tokens);
                }
                Err(data) => {
                    b.errors = Some(json!({"object": "list", "data": data}));
                    b.set_status("failed", now_s);
                }
            }
            None
        }
        "in_progress" if reads > steps.in_progress => {
            let failures = inner.failures.clone();
            let b = inner.batches.get_mut(id).expect("batch");
            let name = b.deployment.clone().unwrap_or_default();
            b.running = true;
            let lines = b.lines.iter().filter_map(|l| serde_json::from_str(l).ok()).collect();
            Some(LineRun { lines, deployment: st.deployments[&name].clone(), failure: failures.get(&name).copied() })
        }
        "finalizing" if reads > steps.finalizing => {
            end(inner, id, "completed", now_s);
            None
        }
        "cancelling" => {
            end(inner, id, "cancelled", now_s);
            None
        }
        _ => None,
    }
}

/// Ends a batch: its output file (when a line succeeded) and error file (always).
fn end(inner: &mut Inner, id: &str, status: &'static str, now_s: u64) {
    let (ok, failed) = {
        let b = &inner.batches[id];
        (b.ok_lines.clone(), b.error_lines.clone())
    };
    let jsonl = |lines: &[Value]| Bytes::from(lines.iter().map(|l| format!("{l}\n")).collect::<String>());
    let output =
        (!ok.is_empty()).then(|| inner.store_file(format!("{id}_output.jsonl"), "batch_output", now_s, jsonl(&ok)));
    let errors = inner.store_file(format!("{id}_error.jsonl"), "batch_output", now_s, jsonl(&failed));
    let b = inner.batches.get_mut(id).expect("batch");
    b.output_file_id = output;
    b.error_file_id = Some(errors);
    b.set_status(status, now_s);
}

async fn get_batch(st: &State, id: &str) -> HttpResponse {
    let run = {
        let mut inner = st.lock();
        if !inner.batches.contains_key(id) {
            return error(StatusCode::NOT_FOUND, "NotFound", &format!("Batch with id '{id}' was not found."));
        }
        *inner.stats.batch_reads.entry(id.to_string()).or_default() += 1;
        step(&mut inner, st, id)
    };
    if let Some(run) = run {
        let answered = answer_lines(st, run).await;
        let now_s = st.now_s();
        let mut inner = st.lock();
        for (custom_id, ok) in answered.iter().map(|(c, ok, _)| (c.clone(), *ok)) {
            if ok {
                *inner.stats.paid_batch_lines.entry(custom_id).or_default() += 1;
            }
        }
        let b = inner.batches.get_mut(id).expect("batch");
        b.running = false;
        // Not the input's order.
        for (_, ok, line) in answered.into_iter().rev() {
            if ok {
                b.completed += 1;
                b.ok_lines.push(line);
            } else {
                b.failed += 1;
                b.error_lines.push(line);
            }
        }
        if b.status == "in_progress" {
            b.set_status("finalizing", now_s);
        }
    }
    let inner = st.lock();
    respond(StatusCode::OK, &[], inner.batches[id].json().to_string())
}

/// Answers a batch's lines as the deployment's synchronous endpoint would: (custom id,
/// succeeded, output line).
async fn answer_lines(st: &State, run: LineRun) -> Vec<(String, bool, Value)> {
    let mut out = Vec::new();
    for line in run.lines {
        let custom_id = line["custom_id"].as_str().unwrap_or_default().to_string();
        let (status, bytes) = match run.failure {
            Some(Failure::Status5xx(s)) => {
                let body = json!({"error": {"code": "InternalServerError", "message": "The server had an error."}});
                (s, Bytes::from(body.to_string()))
            }
            _ => forward(st, &run.deployment, line["body"].clone(), &[]).await,
        };
        let body = if status == 200 {
            azure_answer(&bytes, &run.deployment.model, st.now_s(), false)
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| json!(String::from_utf8_lossy(&bytes)))
        };
        let response = json!({"body": body, "request_id": st.request_id(), "status_code": status});
        out.push((
            custom_id.clone(),
            status == 200,
            json!({"custom_id": custom_id, "response": response, "error": null}),
        ));
    }
    out
}

fn list_batches(st: &State, query: &str) -> HttpResponse {
    let limit = param(query, "limit").and_then(|l| l.parse::<usize>().ok()).unwrap_or(20).clamp(1, 100);
    let after = param(query, "after");
    let inner = st.lock();
    let mut all: Vec<&Batch> = inner.batches.values().collect();
    all.sort_by_key(|b| std::cmp::Reverse(b.seq));
    let start = after.and_then(|a| all.iter().position(|b| b.id == a).map(|p| p + 1)).unwrap_or(0);
    let page: Vec<&Batch> = all.iter().skip(start).take(limit).copied().collect();
    let body = json!({
        "object": "list",
        "data": page.iter().map(|b| b.json()).collect::<Vec<_>>(),
        "first_id": page.first().map(|b| b.id.clone()),
        "last_id": page.last().map(|b| b.id.clone()),
        "has_more": start + page.len() < all.len(),
    });
    respond(StatusCode::OK, &[], body.to_string())
}

fn cancel_batch(st: &State, id: &str) -> HttpResponse {
    let now_s = st.now_s();
    let mut inner = st.lock();
    let Some(b) = inner.batches.get_mut(id) else {
        return error(StatusCode::NOT_FOUND, "NotFound", &format!("Batch with id '{id}' was not found."));
    };
    match b.status {
        "validating" | "in_progress" | "finalizing" => b.set_status("cancelling", now_s),
        "cancelling" => {}
        other => {
            let message = format!("Batch '{id}' is {other} and cannot be cancelled.");
            return error(StatusCode::CONFLICT, "invalid_request", &message);
        }
    }
    respond(StatusCode::OK, &[], b.json().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use reviewlane_core::clock::ManualClock;

    const MINUTE: u64 = 60_000;
    /// 2 s into a UTC minute, and into a 10 s window.
    const T0: u64 = 29_000_000 * MINUTE + 2_000;
    const VERSION: &str = "2024-10-21";
    const DIFF: &str = "--- a/x.rs\n+++ b/x.rs\n@@ -1 +1,2 @@\n a\n+let b = c;\n";
    const MODEL: &str = "gpt-4o-2024-08-06";

    fn chat_body() -> Value {
        json!({"messages": [{"role": "user", "content": DIFF}], "max_tokens": 300})
    }

    fn deployment(name: &str, rpm: Option<u32>, tpm: Option<u32>) -> AzureDeployment {
        AzureDeployment { rpm, tpm, ..AzureDeployment::standard(name, MODEL, 0) }
    }

    async fn azure(deployments: Vec<AzureDeployment>, clock: SharedClock) -> SimAzure {
        SimAzure::start(AzureConfig { deployments, clock, ..AzureConfig::default() }).await
    }

    #[derive(Clone, Copy)]
    enum Key<'a> {
        Api(&'a str),
        Bearer(&'a str),
        Missing,
    }

    struct Answer {
        status: u16,
        headers: reqwest::header::HeaderMap,
        body: Value,
    }

    impl Answer {
        fn header(&self, name: &str) -> Option<String> {
            self.headers.get(name).map(|v| v.to_str().expect("ascii").to_string())
        }

        fn rate_headers(&self) -> Vec<String> {
            let names = self.headers.keys().map(|k| k.as_str().to_string());
            names.filter(|k| k.contains("ratelimit") || k.contains("rate-limit")).collect()
        }
    }

    fn with_key(request: reqwest::RequestBuilder, key: Key) -> reqwest::RequestBuilder {
        match key {
            Key::Api(k) => request.header("api-key", k),
            Key::Bearer(t) => request.bearer_auth(t),
            Key::Missing => request,
        }
    }

    async fn send(request: reqwest::RequestBuilder) -> Answer {
        let r = request.send().await.expect("azure answers");
        let (status, headers) = (r.status().as_u16(), r.headers().clone());
        let bytes = r.bytes().await.expect("body");
        Answer { status, headers, body: serde_json::from_slice(&bytes).unwrap_or(Value::Null) }
    }

    async fn chat_at(url: String, job: &str, key: Key<'_>, body: &Value) -> Answer {
        let request = reqwest::Client::new().post(url).header(JOB_ID_HEADER, job).json(body);
        send(with_key(request, key)).await
    }

    async fn chat(az: &SimAzure, deployment: &str, job: &str, key: Key<'_>, body: &Value) -> Answer {
        let url = format!("{}/openai/deployments/{deployment}/chat/completions?api-version={VERSION}", az.base_url());
        chat_at(url, job, key, body).await
    }

    const KEY: Key = Key::Api(SIM_API_KEY);

    fn content(a: &Answer) -> String {
        a.body["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string()
    }

    #[test]
    fn standard_deployments_get_six_rpm_per_thousand_tpm_and_windows_share_them() {
        let d = AzureDeployment::standard("d", MODEL, 50_000);
        assert_eq!((d.rpm, d.tpm), (Some(300), Some(50_000)));
        let m = Meter::new(&d, Duration::from_secs(10));
        assert_eq!((m.per_window, m.tpm), (Some(50), Some(50_000)));
        let one_second = Meter::new(&AzureDeployment::standard("d", MODEL, 100_000), Duration::from_secs(1));
        assert_eq!(one_second.per_window, Some(10), "600 RPM on 1 s intervals: 10 a second, as the docs say");
    }

    #[test]
    fn the_estimate_counts_max_tokens_or_a_default() {
        let with = json!({"messages": [], "max_tokens": 300});
        assert_eq!(estimate_tokens(&with), crate::simmeter::count(with.to_string().len()) + 300);
        let newer = json!({"messages": [], "max_completion_tokens": 50, "max_tokens": 300, "n": 2});
        assert_eq!(estimate_tokens(&newer), crate::simmeter::count(newer.to_string().len()) + 100);
        let without = json!({"messages": []});
        assert_eq!(
            estimate_tokens(&without),
            crate::simmeter::count(without.to_string().len()) + UNSET_MAX_TOKENS_ESTIMATE
        );
    }

    #[tokio::test]
    async fn a_key_or_a_bearer_token_is_required_and_refused_in_azures_shapes() {
        let az = azure(vec![deployment("gpt4o", None, None)], clock::system()).await;
        let body = chat_body();

        let by_key = chat(&az, "gpt4o", "k", KEY, &body).await;
        assert_eq!(by_key.status, 200, "{}", by_key.body);
        assert!(content(&by_key).contains("let b = c;"), "a real finding: {}", by_key.body);
        let by_token = chat(&az, "gpt4o", "t", Key::Bearer(SIM_BEARER_TOKEN), &body).await;
        assert_eq!(by_token.status, 200, "{}", by_token.body);

        for key in [Key::Api("wrong"), Key::Missing] {
            let a = chat(&az, "gpt4o", "x", key, &body).await;
            assert_eq!(a.status, 401);
            assert_eq!(a.body["error"]["code"], "401");
            let message = a.body["error"]["message"].as_str().unwrap();
            assert!(message.starts_with("Access denied due to invalid subscription key or wrong API endpoint."));
        }
        // The key sent as a bearer token is no Entra token.
        let a = chat(&az, "gpt4o", "x", Key::Bearer(SIM_API_KEY), &body).await;
        assert_eq!(a.status, 401);
        assert_eq!(a.body["statusCode"], 401);
        assert!(a.body["message"].as_str().unwrap().starts_with("Unauthorized. Access token is missing"));
        assert!(a.body.get("error").is_none());

        let s = az.stats();
        let d = &s.deployments["gpt4o"];
        assert_eq!((d.calls, d.ok, d.unauthorized), (5, 2, 3));
        assert_eq!((s.paid_by_job.get("k"), s.paid_by_job.get("x")), (Some(&1), None));
        assert_eq!(s.calls_by_job["x"], 3);
        assert_eq!(az.provider().stats().total_calls, 2, "refused calls never reach the model");
    }

    #[tokio::test]
    async fn unknown_deployments_and_a_missing_api_version_are_404() {
        let az = azure(vec![deployment("gpt4o", None, None)], clock::system()).await;
        let body = chat_body();
        let a = chat(&az, "nope", "j", KEY, &body).await;
        assert_eq!(a.status, 404);
        assert_eq!(a.body["error"]["code"], "DeploymentNotFound");
        assert!(a.body["error"]["message"].as_str().unwrap().starts_with("The API deployment for this resource"));
        // A wrong key is refused before the deployment is looked up.
        assert_eq!(chat(&az, "nope", "j", Key::Api("wrong"), &body).await.status, 401);

        let without = format!("{}/openai/deployments/gpt4o/chat/completions", az.base_url());
        let a = chat_at(without, "j", KEY, &body).await;
        assert_eq!(a.status, 404, "no api-version: 404, not 400");
        assert_eq!(a.body, json!({"error": {"code": "404", "message": "Resource not found"}}));
        let empty = format!("{}/openai/deployments/gpt4o/chat/completions?api-version=", az.base_url());
        assert_eq!(chat_at(empty, "j", KEY, &body).await.status, 404);
        // OpenAI's path is no Azure path.
        let openai = format!("{}/v1/chat/completions?api-version={VERSION}", az.base_url());
        assert_eq!(chat_at(openai, "j", KEY, &body).await.status, 404);

        let s = az.stats();
        assert_eq!((s.unknown_deployment, s.not_found, s.unauthorized), (1, 3, 1));
        assert_eq!(s.deployments["gpt4o"].calls, 0);
        assert_eq!(az.provider().stats().total_calls, 0);
    }

    #[tokio::test]
    async fn the_model_comes_from_the_deployment_and_structured_outputs_pass_through() {
        let az = azure(vec![deployment("reviewer", None, None)], clock::system()).await;
        let item = json!({"type": "object", "required": ["path", "line", "extra"],
            "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                "extra": {"type": ["string", "null"]}}});
        let schema = json!({"type": "object", "properties": {"findings": {"type": "array", "items": item}},
            "required": ["findings"], "additionalProperties": false});
        let body = json!({"model": "something-else", "messages": [{"role": "user", "content": DIFF}],
            "response_format": {"type": "json_schema",
                "json_schema": {"name": "findings", "strict": true, "schema": schema}}});
        let a = chat(&az, "reviewer", "m", KEY, &body).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.body["model"], MODEL);
        let findings: Value = serde_json::from_str(&content(&a)).expect("the output is the schema's JSON");
        assert_eq!(findings["findings"][0]["path"], "x.rs");
        assert!(findings["findings"][0].get("extra").is_some(), "strict: every required property, null if unknown");
        assert_eq!(a.body["choices"][0]["finish_reason"], "stop");
        assert_eq!(a.body["choices"][0]["content_filter_results"]["violence"]["severity"], "safe");
        assert_eq!(a.body["prompt_filter_results"][0]["content_filter_results"]["jailbreak"]["detected"], false);
        let shape = az.provider().stats().last_request.expect("the provider saw the call");
        assert_eq!((shape.model.as_str(), shape.response_format.as_str(), shape.strict), (MODEL, "json_schema", true));

        // No `model` at all is fine: the path names the deployment.
        let a = chat(&az, "reviewer", "m", KEY, &chat_body()).await;
        assert_eq!((a.status, a.body["model"].as_str()), (200, Some(MODEL)));
    }

    #[tokio::test]
    async fn rpm_is_spent_per_ten_second_window_and_refused_with_retry_hints() {
        let clock = ManualClock::at(T0);
        let az = azure(vec![deployment("d", Some(18), Some(1_000_000))], clock.clone()).await;
        let body = chat_body();
        let estimate = estimate_tokens(&body);
        for (i, left) in ["2", "1", "0"].into_iter().enumerate() {
            let a = chat(&az, "d", "r", KEY, &body).await;
            assert_eq!(a.status, 200);
            assert_eq!(a.header("x-ratelimit-remaining-requests").as_deref(), Some(left));
            let tokens = (1_000_000 - estimate * (i as u64 + 1)).to_string();
            assert_eq!(a.header("x-ratelimit-remaining-tokens"), Some(tokens));
            let mut names = a.rate_headers();
            names.sort();
            assert_eq!(names, vec!["x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens"]);
        }
        let refused = chat(&az, "d", "r", KEY, &body).await;
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("retry-after-ms").as_deref(), Some("8000"), "to the end of the 10 s window");
        assert_eq!(refused.header("retry-after").as_deref(), Some("8"));
        assert_eq!(refused.header("x-ratelimit-remaining-requests").as_deref(), Some("0"));
        assert_eq!(refused.body["error"]["code"], "429");
        let message = refused.body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(&format!(
            "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version {VERSION} have exceeded \
             call rate limit"
        )));
        assert!(message.contains("Please retry after 8 seconds."), "{message}");

        // The last millisecond of the window still refuses; the next window serves.
        clock.set(T0 + 7_999);
        let a = chat(&az, "d", "r", KEY, &body).await;
        assert_eq!((a.status, a.header("retry-after-ms").as_deref()), (429, Some("1")));
        clock.set(T0 + 8_000);
        let a = chat(&az, "d", "r", KEY, &body).await;
        assert_eq!((a.status, a.header("x-ratelimit-remaining-requests").as_deref()), (200, Some("2")));

        let d = &az.stats().deployments["d"];
        assert_eq!((d.ok, d.rate_limited, d.retry_after_ms.clone()), (4, 2, vec![8000, 1]));
        let window = T0 - 2_000;
        assert_eq!(
            d.requests_by_window.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            vec![(window, 3), (window + 10_000, 1)]
        );
        assert_eq!(az.provider().stats().total_calls, 4);
    }

    #[tokio::test]
    async fn tpm_counts_the_estimate_at_admission_and_resets_at_the_minute() {
        let clock = ManualClock::at(T0);
        let az = azure(vec![deployment("d", Some(6000), Some(1000))], clock.clone()).await;
        let body = chat_body();
        let estimate = estimate_tokens(&body);
        assert!(estimate > 300 && estimate < 500, "prompt and max_tokens: {estimate}");
        let first = chat(&az, "d", "t", KEY, &body).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.header("x-ratelimit-remaining-tokens"), Some((1000 - estimate).to_string()));
        // The call that reaches the limit still goes through; then the minute is spent.
        let mut served = 1;
        let refused = loop {
            let a = chat(&az, "d", "t", KEY, &body).await;
            if a.status != 200 {
                break a;
            }
            served += 1;
            assert!(served <= 10, "1000 TPM cannot serve ten calls of {estimate}");
        };
        assert_eq!(served, 1000u64.div_ceil(estimate), "every call admitted while under 1000, none after");
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("x-ratelimit-remaining-tokens").as_deref(), Some("0"));
        assert_eq!(refused.header("retry-after-ms").as_deref(), Some("58000"), "to the end of the minute");
        assert_eq!(refused.header("retry-after").as_deref(), Some("58"));
        let message = refused.body["error"]["message"].as_str().unwrap();
        assert!(message.contains("have exceeded token rate limit of your current OpenAI S0 pricing tier"), "{message}");
        assert!(message.contains("Please retry after 58 seconds."), "{message}");

        clock.set(T0 - 2_000 + MINUTE);
        let a = chat(&az, "d", "t", KEY, &body).await;
        assert_eq!((a.status, a.header("x-ratelimit-remaining-tokens")), (200, Some((1000 - estimate).to_string())));
        let d = &az.stats().deployments["d"];
        let minutes: Vec<(u64, u64)> = d.tokens_by_minute.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(minutes, vec![(T0 - 2_000, estimate * served), (T0 - 2_000 + MINUTE, estimate)]);
    }

    #[tokio::test]
    async fn filtered_prompts_are_400_and_filtered_completions_200_without_content() {
        let az = azure(vec![deployment("d", None, None)], clock::system()).await;
        let body = chat_body();
        az.filter_prompt("bad");
        az.filter_completion("worse");

        let a = chat(&az, "d", "bad", KEY, &body).await;
        assert_eq!(a.status, 400);
        let e = &a.body["error"];
        assert_eq!(
            (e["code"].as_str(), e["param"].as_str(), e["status"].as_u64()),
            (Some("content_filter"), Some("prompt"), Some(400))
        );
        assert_eq!(e["innererror"]["code"], "ResponsibleAIPolicyViolation");
        let result = &e["innererror"]["content_filter_result"];
        assert_eq!(result["violence"], json!({"filtered": true, "severity": "high"}));
        assert_eq!(result["hate"], json!({"filtered": false, "severity": "safe"}));

        let a = chat(&az, "d", "worse", KEY, &body).await;
        assert_eq!(a.status, 200);
        let choice = &a.body["choices"][0];
        assert_eq!(choice["finish_reason"], "content_filter");
        assert_eq!(choice["message"]["content"], Value::Null);
        assert_eq!(choice["content_filter_results"]["violence"]["filtered"], true);

        let fine = chat(&az, "d", "fine", KEY, &body).await;
        assert_eq!((fine.status, fine.body["choices"][0]["finish_reason"].as_str()), (200, Some("stop")));

        // The next call is refused whatever its job; the one after is not.
        az.filter_next_prompts(1);
        assert_eq!(chat(&az, "d", "fine", KEY, &body).await.status, 400);
        assert_eq!(chat(&az, "d", "fine", KEY, &body).await.status, 200);
        az.filter_next_completions(1);
        assert_eq!(chat(&az, "d", "fine", KEY, &body).await.body["choices"][0]["finish_reason"], "content_filter");
        az.clear_filters();
        assert_eq!(chat(&az, "d", "bad", KEY, &body).await.status, 200);

        let s = az.stats();
        let d = &s.deployments["d"];
        assert_eq!((d.prompt_filtered, d.completion_filtered, d.ok), (2, 2, 5));
        assert_eq!((s.paid_by_job.get("bad"), s.billed_by_job.get("bad")), (Some(&1), Some(&2)));
        assert_eq!((s.paid_by_job["worse"], s.paid_by_job["fine"], s.billed_by_job["fine"]), (1, 3, 4));
        assert_eq!(az.provider().stats().total_calls, 5, "a refused prompt never reaches the model");
    }

    #[tokio::test]
    async fn each_failure_knob_switches_one_deployment_at_run_time() {
        let az = azure(vec![deployment("a", None, None), deployment("b", None, None)], clock::system()).await;
        let body = chat_body();
        assert_eq!(chat(&az, "a", "f", KEY, &body).await.status, 200);

        az.set_failure("a", Some(Failure::Status5xx(503)));
        let a = chat(&az, "a", "f", KEY, &body).await;
        assert_eq!((a.status, a.body["error"]["code"].as_str()), (503, Some("ServiceUnavailable")));
        assert_eq!(chat(&az, "b", "f", KEY, &body).await.status, 200, "the other deployment is untouched");

        az.set_failure("a", Some(Failure::RefuseKey(401)));
        let a = chat(&az, "a", "f", KEY, &body).await;
        assert_eq!((a.status, a.body["error"]["code"].as_str()), (401, Some("401")));
        az.set_failure("a", Some(Failure::RefuseKey(403)));
        let a = chat(&az, "a", "f", Key::Bearer(SIM_BEARER_TOKEN), &body).await;
        assert_eq!((a.status, a.body["error"]["code"].as_str()), (403, Some("PermissionDenied")));

        az.set_failure("a", Some(Failure::QuotaExhausted));
        let a = chat(&az, "a", "f", KEY, &body).await;
        assert_eq!(a.status, 429);
        assert_eq!(a.header("retry-after").as_deref(), Some("86400"));
        assert_eq!(a.header("retry-after-ms").as_deref(), Some("86400000"));
        assert!(a.body["error"]["message"].as_str().unwrap().contains("Please retry after 86400 seconds."));

        az.set_failure("a", Some(Failure::Timeout(Duration::from_secs(10))));
        let impatient = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
        let url = format!("{}/openai/deployments/a/chat/completions?api-version={VERSION}", az.base_url());
        let err = impatient.post(url).header("api-key", SIM_API_KEY).json(&body).send().await.err();
        assert!(err.is_some_and(|e| e.is_timeout()), "held past the client's timeout");

        az.set_failure("a", None);
        assert_eq!(chat(&az, "a", "f", KEY, &body).await.status, 200);
        let s = az.stats();
        let a = &s.deployments["a"];
        assert_eq!((a.ok, a.server_errors, a.unauthorized, a.quota_exhausted, a.held), (2, 1, 2, 1, 1));
        assert_eq!(s.deployments["b"].ok, 1);
    }

    async fn upload(az: &SimAzure, lines: &[Value]) -> String {
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        let part = reqwest::multipart::Part::bytes(text.into_bytes()).file_name("input.jsonl");
        let form = reqwest::multipart::Form::new().text("purpose", "batch").part("file", part);
        let url = format!("{}/openai/files?api-version={VERSION}", az.base_url());
        let a = send(reqwest::Client::new().post(url).header("api-key", SIM_API_KEY).multipart(form)).await;
        assert_eq!((a.status, a.body["purpose"].as_str()), (200, Some("batch")), "{}", a.body);
        a.body["id"].as_str().unwrap().to_string()
    }

    async fn create(az: &SimAzure, file_id: &str) -> Value {
        let url = format!("{}/openai/batches?api-version={VERSION}", az.base_url());
        let body = json!({"input_file_id": file_id, "endpoint": "/chat/completions", "completion_window": "24h"});
        let a = send(reqwest::Client::new().post(url).header("api-key", SIM_API_KEY).json(&body)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        a.body
    }

    async fn get(az: &SimAzure, path: &str) -> Answer {
        let url = format!("{}{path}?api-version={VERSION}", az.base_url());
        send(reqwest::Client::new().get(url).header("api-key", SIM_API_KEY)).await
    }

    /// Polls a batch until it ends (bounded); the statuses seen, and its last state.
    async fn poll(az: &SimAzure, id: &str) -> (Vec<String>, Value) {
        let mut seen = Vec::new();
        for _ in 0..20 {
            let b = get(az, &format!("/openai/batches/{id}")).await.body;
            let status = b["status"].as_str().unwrap().to_string();
            if seen.last() != Some(&status) {
                seen.push(status.clone());
            }
            if matches!(status.as_str(), "completed" | "failed" | "cancelled") {
                return (seen, b);
            }
        }
        panic!("batch {id} did not end: {seen:?}");
    }

    fn line(custom_id: &str, deployment: &str) -> Value {
        json!({"custom_id": custom_id, "method": "POST", "url": "/chat/completions", "body": {"model": deployment,
            "messages": [{"role": "user", "content": DIFF}], "max_tokens": 300}})
    }

    #[tokio::test]
    async fn a_batch_runs_to_completed_with_an_output_line_per_custom_id() {
        let deployments = vec![AzureDeployment::global_batch("batchy", MODEL, None), deployment("sync", None, None)];
        let az = azure(deployments, ManualClock::at(T0)).await;
        let file = upload(&az, &[line("a", "batchy"), line("b", "batchy"), line("c", "batchy")]).await;
        let created = create(&az, &file).await;
        assert_eq!(created["status"], "validating");
        assert_eq!(created["created_at"], T0 / 1000);
        assert_eq!(created["expires_at"], T0 / 1000 + 86_400);
        let id = created["id"].as_str().unwrap().to_string();
        assert!(id.starts_with("batch_"));

        let (seen, done) = poll(&az, &id).await;
        assert_eq!(seen, vec!["validating", "in_progress", "finalizing", "completed"]);
        assert_eq!(done["request_counts"], json!({"total": 3, "completed": 3, "failed": 0}));
        let output_file = done["output_file_id"].as_str().expect("an output file");
        let url = format!("{}/openai/files/{output_file}/content?api-version={VERSION}", az.base_url());
        let raw =
            reqwest::Client::new().get(url).header("api-key", SIM_API_KEY).send().await.unwrap().text().await.unwrap();
        let lines: Vec<Value> = raw.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
        let ids: Vec<&str> = lines.iter().map(|l| l["custom_id"].as_str().unwrap()).collect();
        assert_eq!(ids, vec!["c", "b", "a"], "every custom id, not in the input's order");
        for l in &lines {
            assert!(l.get("id").is_none(), "Azure's lines have no line id");
            assert_eq!(l["error"], Value::Null);
            assert_eq!(l["response"]["status_code"], 200);
            assert!(l["response"]["request_id"].is_string());
            let body = &l["response"]["body"];
            assert_eq!(body["model"], MODEL);
            assert!(body["choices"][0]["message"]["content"].as_str().unwrap().contains("let b = c;"));
        }
        let errors = get(&az, &format!("/openai/files/{}", done["error_file_id"].as_str().unwrap())).await;
        assert_eq!(errors.body["bytes"], 0, "a successful job still has an empty error file");

        let list = get(&az, "/openai/batches").await.body;
        assert_eq!((list["object"].as_str(), list["first_id"].as_str()), (Some("list"), Some(id.as_str())));
        let s = az.stats();
        assert_eq!((s.batches_created, s.batch_lines_received, s.files_uploaded), (1, 3, 1));
        assert_eq!(s.paid_batch_lines.keys().collect::<Vec<_>>(), vec!["a", "b", "c"]);
        assert!(s.enqueued_tokens[&id] > 0);
    }

    #[tokio::test]
    async fn batches_fail_validation_as_the_error_table_says_and_cancel_in_two_steps() {
        // Room for one line's tokens, not two.
        let limit = crate::simbatch::request_tokens(&line("a", "batchy")["body"]) + 1;
        let deployments =
            vec![AzureDeployment::global_batch("batchy", MODEL, Some(limit)), deployment("sync", None, None)];
        let az = azure(deployments, clock::system()).await;
        let cases = [
            (vec![line("a", "sync")], "invalid_request"),
            (vec![line("a", "nowhere")], "model_not_found"),
            (vec![line("a", "batchy"), line("a", "batchy")], "duplicate_custom_id"),
            (
                vec![
                    line("a", "batchy"),
                    json!({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "batchy"}}),
                ],
                "url_mismatch",
            ),
        ];
        for (lines, code) in cases {
            let file = upload(&az, &lines).await;
            let id = create(&az, &file).await["id"].as_str().unwrap().to_string();
            let (seen, done) = poll(&az, &id).await;
            assert_eq!(seen, vec!["validating", "failed"], "{code}");
            assert_eq!(done["errors"]["object"], "list");
            let codes: Vec<&str> =
                done["errors"]["data"].as_array().unwrap().iter().map(|e| e["code"].as_str().unwrap()).collect();
            assert_eq!(codes, vec![code]);
            assert_eq!((done["output_file_id"].as_str(), done["error_file_id"].as_str()), (None, None));
        }

        // Enqueued tokens: the first batch is held in progress; the second is over the limit.
        let first = create(&az, &upload(&az, &[line("a", "batchy")]).await).await["id"].as_str().unwrap().to_string();
        assert_eq!(get(&az, &format!("/openai/batches/{first}")).await.body["status"], "validating");
        assert_eq!(get(&az, &format!("/openai/batches/{first}")).await.body["status"], "in_progress");
        let second = create(&az, &upload(&az, &[line("b", "batchy")]).await).await["id"].as_str().unwrap().to_string();
        let (_, done) = poll(&az, &second).await;
        assert_eq!(done["status"], "failed");
        let e = &done["errors"]["data"][0];
        assert_eq!(e["code"], "token_limit_exceeded");
        let message = format!(
            "The number of enqueued tokens has surpassed the configured limit of {limit} for the deployment 'batchy'. \
             Please either increase the limit or try again once the current jobs have finished."
        );
        assert_eq!(e["message"].as_str(), Some(message.as_str()));

        let url = format!("{}/openai/batches/{first}/cancel?api-version={VERSION}", az.base_url());
        let cancel = send(reqwest::Client::new().post(url.clone()).header("api-key", SIM_API_KEY)).await;
        assert_eq!((cancel.status, cancel.body["status"].as_str()), (200, Some("cancelling")));
        let (seen, done) = poll(&az, &first).await;
        assert_eq!(seen, vec!["cancelled"]);
        assert_eq!(done["output_file_id"], Value::Null, "nothing ran");
        let again = send(reqwest::Client::new().post(url).header("api-key", SIM_API_KEY)).await;
        assert_eq!(again.status, 409);
        assert!(az.stats().paid_batch_lines.is_empty());
        assert_eq!(az.provider().stats().total_calls, 0);

        // Batch endpoints want a key and an api-version too.
        let url = format!("{}/openai/batches?api-version={VERSION}", az.base_url());
        assert_eq!(send(reqwest::Client::new().get(url)).await.status, 401);
        let url = format!("{}/openai/batches", az.base_url());
        assert_eq!(send(reqwest::Client::new().get(url).header("api-key", SIM_API_KEY)).await.status, 404);
    }

    #[tokio::test]
    async fn stats_are_served_over_http() {
        let az = azure(vec![deployment("d", Some(600), None)], clock::system()).await;
        chat(&az, "d", "s", KEY, &chat_body()).await;
        let served: AzureStats =
            reqwest::get(format!("{}/stats", az.base_url())).await.unwrap().json().await.expect("stats JSON");
        assert_eq!(served, az.stats());
        assert_eq!((served.deployments["d"].ok, served.paid_by_job["s"]), (1, 1));
    }
}
