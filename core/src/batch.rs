//! Provider batch processing as pure rules, shared by both providers' batch APIs (OpenAI
//! `/v1/batches`, Anthropic `/v1/messages/batches`) and the coordinator that drives them:
//!
//! - `custom_id`: the id a request line carries, one per item (a job id), in the
//!   alphabet both providers accept;
//! - `chunks`: items cut into provider batches at the provider's request and byte limits;
//! - `BatchStatus` and `step`: what a batch's status means for the coordinator (poll
//!   again, collect its files, resubmit its items, reject named lines);
//! - `LineResult` and `fate`: what one result line — or its absence — means for its
//!   item, within the item's resubmission budget;
//! - `PollBackoff`: how polling slows down while a batch runs;
//! - `estimate`: when a sweep is likely done, from live counts or recent turnaround;
//! - `ChunkRecord`: one provider batch as the region keeps it, from the intent stored
//!   before anything is sent to the provider to the results applied, and `Cut`, the
//!   running cut of items into chunks within the provider's limits and the enqueued-token
//!   budget.
//!
//! Nothing here reads a clock or does I/O: the time is given.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::job::{TerminalReason, Tokens};

/// Longest `custom_id` both providers accept.
pub const CUSTOM_ID_MAX: usize = 64;

/// The request line id of an item: its job id, checked against what both providers
/// accept (`[A-Za-z0-9_-]{1,64}`). `None` when it does not fit (never for the ids this
/// service derives).
pub fn custom_id(job_id: &str) -> Option<&str> {
    let fits = !job_id.is_empty()
        && job_id.len() <= CUSTOM_ID_MAX
        && job_id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    fits.then_some(job_id)
}

/// A provider's limits on one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    pub max_requests: usize,
    /// Of the input file (OpenAI) or request body (Anthropic).
    pub max_bytes: usize,
}

impl BatchLimits {
    /// OpenAI: 50,000 requests and 200 MB per input file.
    pub const OPENAI: BatchLimits = BatchLimits { max_requests: 50_000, max_bytes: 200 * 1024 * 1024 };
    /// Azure OpenAI global batch: 100,000 requests and 200 MB per input file.
    pub const AZURE: BatchLimits = BatchLimits { max_requests: 100_000, max_bytes: 200 * 1024 * 1024 };
    /// Anthropic: 100,000 requests and 256 MB per batch.
    pub const ANTHROPIC: BatchLimits = BatchLimits { max_requests: 100_000, max_bytes: 256 * 1024 * 1024 };
}

/// Cuts items of `sizes` bytes (each its request line, in order) into consecutive
/// batches within `limits`. An item larger than `max_bytes` alone is a batch of its own
/// (the provider refuses it by line, and that line ends alone).
pub fn chunks(sizes: &[usize], limits: BatchLimits) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, size) in sizes.iter().enumerate() {
        let full = i - start == limits.max_requests.max(1) || (i > start && bytes + size > limits.max_bytes);
        if full {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// A provider batch's status, both providers' in one vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchStatus {
    /// OpenAI `validating`: the input file is being checked.
    Validating,
    /// OpenAI and Anthropic `in_progress`.
    InProgress,
    /// OpenAI `finalizing`: the results are being written (this can last long after the
    /// counts reach every request).
    Finalizing,
    /// OpenAI `cancelling`, Anthropic `canceling`.
    Cancelling,
    /// OpenAI `completed`, Anthropic `ended`: every line has its result.
    Ended,
    /// OpenAI `expired`: the completion window passed; what ran is in the files.
    Expired,
    /// OpenAI `cancelled`: what ran before the cancel is in the files.
    Cancelled,
    /// OpenAI `failed`: nothing ran.
    Failed(BatchFailure),
}

/// Why an OpenAI batch failed as a whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchFailure {
    /// `token_limit_exceeded`: the model's enqueued tokens were over the account's
    /// limit (this comes as a failed batch, not as a 429).
    TokenLimitExceeded,
    /// The input file failed validation: the 1-based lines named, if any.
    InvalidInput { lines: Vec<u32> },
}

impl BatchStatus {
    /// OpenAI's `status` and, for `failed`, its `errors.data[]` codes and lines.
    pub fn openai(status: &str, errors: &[(String, Option<u32>)]) -> Option<BatchStatus> {
        Some(match status {
            "validating" => BatchStatus::Validating,
            "in_progress" => BatchStatus::InProgress,
            "finalizing" => BatchStatus::Finalizing,
            "cancelling" => BatchStatus::Cancelling,
            "completed" => BatchStatus::Ended,
            "expired" => BatchStatus::Expired,
            "cancelled" => BatchStatus::Cancelled,
            "failed" if errors.iter().any(|(code, _)| code == "token_limit_exceeded") => {
                BatchStatus::Failed(BatchFailure::TokenLimitExceeded)
            }
            "failed" => {
                let mut lines: Vec<u32> = errors.iter().filter_map(|(_, line)| *line).collect();
                lines.sort_unstable();
                lines.dedup();
                BatchStatus::Failed(BatchFailure::InvalidInput { lines })
            }
            _ => return None,
        })
    }

    /// Anthropic's `processing_status`.
    pub fn anthropic(processing_status: &str) -> Option<BatchStatus> {
        Some(match processing_status {
            "in_progress" => BatchStatus::InProgress,
            "canceling" => BatchStatus::Cancelling,
            "ended" => BatchStatus::Ended,
            _ => return None,
        })
    }
}

/// What the coordinator does next with a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchStep {
    /// Still running: look again after the poll backoff.
    Poll,
    /// Done, wholly or partly: apply every result line, once each. An item with no line
    /// in the results is `LineResult::Missing`.
    Collect,
    /// Nothing ran: the model's enqueued tokens were over the limit (`token_limit_exceeded`);
    /// every item goes back, for a smaller batch (`Refusals`).
    TokenLimit,
    /// Nothing ran, and these input lines (1-based) were refused: their items end
    /// `upstream_rejected`, the others go back. No line named: every item ends so
    /// (the input as a whole was refused; sending it again would fail again).
    Reject { lines: Vec<u32> },
}

/// The step for a batch in `status`.
pub fn step(status: &BatchStatus) -> BatchStep {
    match status {
        BatchStatus::Validating | BatchStatus::InProgress | BatchStatus::Finalizing | BatchStatus::Cancelling => {
            BatchStep::Poll
        }
        BatchStatus::Ended | BatchStatus::Expired | BatchStatus::Cancelled => BatchStep::Collect,
        BatchStatus::Failed(BatchFailure::TokenLimitExceeded) => BatchStep::TokenLimit,
        BatchStatus::Failed(BatchFailure::InvalidInput { lines }) => BatchStep::Reject { lines: lines.clone() },
    }
}

/// What one item's result line says, or its absence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineResult {
    /// A 2xx with the model's output: validated and kept like a lane answer.
    Succeeded { output: String, usage: Option<Tokens> },
    /// The provider refused the request itself (`invalid_request_error`, a 4xx other
    /// than 408 and 429): the same request would be refused again.
    Rejected { status: Option<u16> },
    /// The account is out of money (`insufficient_quota`): not retried.
    OutOfQuota,
    /// Did not run or did not finish, and may if sent again.
    Retryable(Retryable),
    /// No line for the item in any result file.
    Missing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retryable {
    /// A 429 on the line.
    RateLimited,
    /// A 5xx, a timeout (408), an overloaded model.
    Transient,
    /// The batch's completion window passed before the line ran.
    Expired,
    /// The batch was cancelled before the line ran.
    Cancelled,
    /// An error code this service does not know: taken as not run (counted, so that a
    /// new code is seen).
    Unrecognised,
}

/// What a result line's error says when it carries no answer of the endpoint: OpenAI's
/// `error.code` of a line without a response, Anthropic's `error.type` of an `errored`
/// result. By kind: the request did not run (it may if sent again), it was refused (the
/// same request would be refused again), the account is out of money — or a code not
/// known here, taken as not run.
pub fn line_error(code: &str) -> LineResult {
    match code {
        "batch_expired" | "expired" => LineResult::Retryable(Retryable::Expired),
        "batch_cancelled" | "cancelled" | "canceled" => LineResult::Retryable(Retryable::Cancelled),
        "rate_limit_error" | "rate_limit_exceeded" | "too_many_requests" => {
            LineResult::Retryable(Retryable::RateLimited)
        }
        "request_timeout"
        | "timeout"
        | "timeout_error"
        | "api_error"
        | "overloaded_error"
        | "server_error"
        | "internal_error"
        | "service_unavailable" => LineResult::Retryable(Retryable::Transient),
        "insufficient_quota" | "billing_hard_limit_reached" | "billing_error" => LineResult::OutOfQuota,
        "invalid_request_error"
        | "invalid_request"
        | "invalid_url"
        | "invalid_method"
        | "invalid_body"
        | "invalid_json"
        | "invalid_model"
        | "model_not_found"
        | "context_length_exceeded"
        | "authentication_error"
        | "permission_error"
        | "not_found_error"
        | "request_too_large" => LineResult::Rejected { status: None },
        _ => LineResult::Retryable(Retryable::Unrecognised),
    }
}

/// What becomes of an item after its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemFate {
    /// Validate the output against the schema and the diff, then keep it (paid).
    Validate { output: String, usage: Option<Tokens> },
    /// Send it again (in a later provider batch, or through the lanes): its
    /// `resubmissions` so far, this one included.
    Resubmit { resubmissions: u32 },
    /// It ends with this reason.
    Ended(TerminalReason),
}

/// The fate of an item whose line says `line`, after `resubmitted` resubmissions of a
/// budget of `budget`. An item of a cancelled sweep that did not run ends `cancelled`;
/// one that ran and succeeded is still validated and delivered (it was paid for).
pub fn fate(line: LineResult, resubmitted: u32, budget: u32, sweep_cancelled: bool) -> ItemFate {
    let retryable = match line {
        LineResult::Succeeded { output, usage } => return ItemFate::Validate { output, usage },
        LineResult::Rejected { .. } => return ItemFate::Ended(TerminalReason::UpstreamRejected),
        LineResult::OutOfQuota => return ItemFate::Ended(TerminalReason::InsufficientQuota),
        LineResult::Retryable(r) => Some(r),
        LineResult::Missing => None,
    };
    if sweep_cancelled {
        return ItemFate::Ended(TerminalReason::Cancelled);
    }
    if resubmitted >= budget {
        // Each ends with its own reason.
        let reason = match retryable {
            Some(Retryable::RateLimited) => TerminalReason::RateLimitBudgetExhausted,
            Some(Retryable::Expired) => TerminalReason::DeadlineExceeded,
            Some(Retryable::Transient | Retryable::Cancelled | Retryable::Unrecognised) | None => {
                TerminalReason::TransientBudgetExhausted
            }
        };
        return ItemFate::Ended(reason);
    }
    ItemFate::Resubmit { resubmissions: resubmitted + 1 }
}

/// A batch's result lines matched to its items: one result per item, in the items'
/// order — whatever order the lines came in — and what did not match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciled {
    /// Each item's custom id and its line (`Missing` when it has none).
    pub items: Vec<(String, LineResult)>,
    /// Lines naming no item of the batch (dropped).
    pub unknown: usize,
    /// Further lines for an item that already had one (the first is kept).
    pub repeated: usize,
}

/// Matches `lines` (custom id, result; any order) to the batch's `items` (custom ids).
pub fn reconcile(items: &[String], lines: impl IntoIterator<Item = (String, LineResult)>) -> Reconciled {
    let mut found: std::collections::HashMap<&str, Option<LineResult>> =
        items.iter().map(|id| (id.as_str(), None)).collect();
    let (mut unknown, mut repeated) = (0, 0);
    for (id, line) in lines {
        match found.get_mut(id.as_str()) {
            None => unknown += 1,
            Some(slot @ None) => *slot = Some(line),
            Some(Some(_)) => repeated += 1,
        }
    }
    let items = items
        .iter()
        .map(|id| (id.clone(), found.get_mut(id.as_str()).and_then(Option::take).unwrap_or(LineResult::Missing)))
        .collect();
    Reconciled { items, unknown, repeated }
}

/// How often a running batch is polled: `first`, doubling to `cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollBackoff {
    pub first: Duration,
    pub cap: Duration,
}

impl Default for PollBackoff {
    /// 30 s doubling to 5 min.
    fn default() -> Self {
        PollBackoff { first: Duration::from_secs(30), cap: Duration::from_secs(300) }
    }
}

impl PollBackoff {
    /// The wait before poll `n` (0: the first after the create). A provider's hint (a
    /// 429's `retry-after`) waits at least that long.
    pub fn delay(&self, n: u32, hint: Option<Duration>) -> Duration {
        let doubled = self.first.saturating_mul(1u32 << n.min(16));
        doubled.min(self.cap).max(hint.unwrap_or_default())
    }
}

/// When the rest of a sweep is likely done, at `now_ms`: from the provider's live
/// counts when it reports them (`done` of `total` since `started_ms`, at the pace so
/// far), else from the recent turnaround of finished batches (`turnaround_ms`, for the
/// batches still running since `started_ms`). `None` before anything can be told.
pub fn estimate(done: u64, total: u64, started_ms: u64, now_ms: u64, turnaround_ms: Option<u64>) -> Option<u64> {
    if total == 0 || done >= total {
        return Some(now_ms);
    }
    let elapsed = now_ms.saturating_sub(started_ms);
    if done > 0 && elapsed > 0 {
        let rest = (elapsed as u128 * u128::from(total - done) / u128::from(done)) as u64;
        return Some(now_ms.saturating_add(rest));
    }
    turnaround_ms.map(|t| started_ms.saturating_add(t).max(now_ms))
}

/// Batches of one item refused for the enqueued-token limit, one after another, before
/// the item ends `batch_token_limit`; between them the poll backoff doubles (with the
/// default 30 s to 5 min, about 17 minutes in all).
pub const ALONE_REFUSALS_MAX: u32 = 6;

/// What the coordinator has learned of a sweep's batches refused for the model's
/// enqueued-token limit (`token_limit_exceeded`, which OpenAI answers on a batch it
/// accepted, later): the next batch is cut from the refused one's size, not from the
/// configured limit, and a batch of one refused again and again ends its item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Refusals {
    /// The next batch holds at most this many requests (`None`: the limits as set).
    pub max_requests: Option<usize>,
    /// Batches of one item refused in a row.
    pub alone: u32,
    /// No batch of the sweep is sent before this time.
    pub not_before_ms: u64,
}

/// What a refused batch comes to for its items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// They go again, in a smaller batch (a refusal is not an attempt of theirs).
    Again,
    /// A batch of one was refused more than `ALONE_REFUSALS_MAX` times: the item ends
    /// `batch_token_limit`.
    End,
}

impl Refusals {
    /// A batch of `requests` items refused at `now_ms`: the next holds half as many
    /// (down to one); a batch of one refused waits `poll`'s backoff, doubling, before the
    /// next is sent, and ends its item after `ALONE_REFUSALS_MAX` of them.
    pub fn refused(&mut self, requests: usize, now_ms: u64, poll: PollBackoff) -> Refused {
        if requests > 1 {
            self.max_requests = Some((requests / 2).max(1));
            self.alone = 0;
            self.not_before_ms = now_ms;
            return Refused::Again;
        }
        self.max_requests = Some(1);
        self.alone += 1;
        if self.alone > ALONE_REFUSALS_MAX {
            return Refused::End;
        }
        self.not_before_ms = now_ms + poll.delay(self.alone - 1, None).as_millis() as u64;
        Refused::Again
    }

    /// A batch of the sweep ran: the next may be twice as large again.
    pub fn ran(&mut self) {
        self.alone = 0;
        self.max_requests = self.max_requests.and_then(|m| m.checked_mul(2));
    }

    /// The limits the next batch is cut within.
    pub fn limits(&self, limits: BatchLimits) -> BatchLimits {
        let max_requests = self.max_requests.map_or(limits.max_requests, |m| m.min(limits.max_requests));
        BatchLimits { max_requests, ..limits }
    }
}

/// The enqueued-token budget to believe after a batch of `refused` tokens was refused
/// while the region's batches held `held` (the refused one's included): the provider's
/// limit is below what was held, so the budget becomes what was held less half the
/// refused batch — never above what was believed before (`budget`, `None`: none set).
pub fn believed_budget(budget: Option<u64>, held: u64, refused: u64) -> Option<u64> {
    let below = held.saturating_sub(refused.div_ceil(2)).max(1);
    Some(budget.map_or(below, |b| b.min(below)))
}

/// What the coordinator does with an item of a provider-batch sweep when it cuts the
/// sweep's items again (`triage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Triage {
    /// Final, or validated (the publisher's from there): nothing.
    Done,
    /// Not final, and running where it is (a batch, the lanes): the sweep is not over.
    Open,
    /// Waiting for a batch (no job yet, or sent again): cut into the next one.
    Waits,
    /// Waiting, of a cancelled sweep: never sent again, it ends `cancelled` (one with no
    /// job never runs).
    Cancel,
}

/// An item's triage from its job (`None`: not made yet), whether a chunk being leased
/// names it already, and whether its sweep is cancelled.
pub fn triage(job: Option<&crate::job::JobRecord>, in_chunk: bool, sweep_cancelled: bool) -> Triage {
    use crate::job::JobState;
    let waits = job.is_none_or(|r| r.state == JobState::RetryScheduled && r.in_provider_batch());
    match job {
        _ if waits && !in_chunk && sweep_cancelled => Triage::Cancel,
        _ if waits && !in_chunk => Triage::Waits,
        Some(r) if r.state.is_final() || r.state == JobState::Validated => Triage::Done,
        _ => Triage::Open,
    }
}

/// The id of a sweep's `seq`-th provider batch: the owner of its items' jobs
/// (`job::Owner::ProviderBatch`, so an item counts as submitted to the provider, not as
/// being called), the metadata a created OpenAI batch carries, the name of its input
/// file.
pub fn chunk_id(sweep_id: &str, seq: u32) -> String {
    format!("{}{sweep_id}-{seq:06}", crate::job::PROVIDER_BATCH_PREFIX)
}

/// Where a chunk is between the intent and its results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChunkStep {
    /// Its items are chosen and being leased to it; nothing is sent yet.
    Leasing,
    /// The intent: the leased items and the digest of their request lines, stored
    /// before the upload and the create. A batch may exist for it after a crash: it is
    /// looked for before one is created.
    Intent,
    /// OpenAI: its input file is uploaded (`file_id`); the create may have been sent.
    Uploaded,
    /// The provider's batch exists (`batch_id`): polled until it ends.
    Created,
    /// Every item's line (or its absence) is applied: the chunk is over.
    Applied,
}

/// What happens to a chunk (`ChunkRecord::after`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkEvent {
    /// Its items are leased to it (the ones still its own), its request lines digested
    /// and what finding its batch after a crash needs to know noted (`BatchApi::mark`):
    /// the intent. None leased: it is over.
    Leased { job_ids: Vec<String>, input_digest: String, newest_before: Option<String> },
    /// Its input file is uploaded.
    Uploaded { file_id: String },
    /// Its batch is created.
    Created { batch_id: String },
    /// The provider's live counts of its lines.
    Counted { succeeded: u64, failed: u64 },
    /// Its sweep was cancelled and a cancel sent to the provider.
    CancelSent,
    /// Its batch ended and every line is applied (or its items sent again).
    Ended,
}

/// An event a chunk's step does not take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("a chunk at step {0:?} does not take this event")]
    Step(ChunkStep),
}

/// One provider batch of a sweep (KV `SWEEPS_<R>`, key `batch.<sweep id>.<seq>`),
/// created once (KV create) and moved on by compare-and-set. Metadata only: ids,
/// digests, counts and times.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRecord {
    pub chunk_id: String,
    pub sweep_id: String,
    pub tenant: String,
    pub seq: u32,
    pub step: ChunkStep,
    /// Its items' job ids (their custom ids), in the order of its request lines; from
    /// the intent on, only the items leased to it.
    pub job_ids: Vec<String>,
    /// Of its request lines, in order (from the intent on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_digest: Option<String>,
    /// Enqueued tokens it holds of the model's budget until it is applied.
    #[serde(default)]
    pub tokens: u64,
    /// Anthropic: the newest batch of the account when the intent was stored (a batch
    /// listed before it that no chunk names may be this one's, created before a crash).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest_before: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    pub created_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    /// The provider's live counts while it runs (OpenAI reports them as lines finish;
    /// Anthropic only once the batch has ended): lines that succeeded, lines that failed.
    #[serde(default)]
    pub lines_succeeded: u64,
    #[serde(default)]
    pub lines_failed: u64,
    /// A cancel was sent to the provider for it.
    #[serde(default)]
    pub cancel_sent: bool,
}

impl ChunkRecord {
    pub fn new(sweep_id: &str, tenant: &str, seq: u32, job_ids: Vec<String>, now_ms: u64) -> ChunkRecord {
        ChunkRecord {
            chunk_id: chunk_id(sweep_id, seq),
            sweep_id: sweep_id.to_string(),
            tenant: tenant.to_string(),
            seq,
            step: ChunkStep::Leasing,
            job_ids,
            input_digest: None,
            tokens: 0,
            newest_before: None,
            file_id: None,
            batch_id: None,
            created_at_ms: now_ms,
            submitted_at_ms: None,
            ended_at_ms: None,
            lines_succeeded: 0,
            lines_failed: 0,
            cancel_sent: false,
        }
    }

    /// The chunk after `event` at `now_ms`: the one place its step moves. An event its
    /// step does not take is refused, naming the step.
    pub fn after(&self, event: ChunkEvent, now_ms: u64) -> Result<ChunkRecord, ChunkError> {
        use ChunkStep::*;
        let mut next = self.clone();
        match (self.step, event) {
            (Leasing, ChunkEvent::Leased { job_ids, .. }) if job_ids.is_empty() => {
                next.job_ids = job_ids;
                next.step = Applied;
                next.ended_at_ms = Some(now_ms);
            }
            (Leasing, ChunkEvent::Leased { job_ids, input_digest, newest_before }) => {
                (next.job_ids, next.input_digest, next.newest_before) = (job_ids, Some(input_digest), newest_before);
                next.step = Intent;
            }
            (Intent, ChunkEvent::Uploaded { file_id }) => {
                next.file_id = Some(file_id);
                next.step = Uploaded;
            }
            (Intent | Uploaded, ChunkEvent::Created { batch_id }) => {
                next.batch_id = Some(batch_id);
                next.step = Created;
                next.submitted_at_ms = Some(now_ms);
            }
            (Created, ChunkEvent::Counted { succeeded, failed }) => {
                (next.lines_succeeded, next.lines_failed) = (succeeded, failed);
            }
            (Created, ChunkEvent::CancelSent) => next.cancel_sent = true,
            (Created, ChunkEvent::Ended) => {
                next.step = Applied;
                next.ended_at_ms = Some(now_ms);
            }
            (step, _) => return Err(ChunkError::Step(step)),
        }
        Ok(next)
    }

    /// It holds enqueued tokens: from its cut until it is applied.
    pub fn holds_tokens(&self) -> bool {
        self.step != ChunkStep::Applied
    }

    /// How long it took from its create to its end, once ended.
    pub fn turnaround_ms(&self) -> Option<u64> {
        Some(self.ended_at_ms?.saturating_sub(self.submitted_at_ms?))
    }

    /// The job ids of the 1-based input lines `lines` (a validation failure names them).
    pub fn jobs_of_lines(&self, lines: &[u32]) -> Vec<String> {
        lines
            .iter()
            .filter_map(|l| usize::try_from(*l).ok()?.checked_sub(1).and_then(|i| self.job_ids.get(i)).cloned())
            .collect()
    }
}

/// The enqueued tokens the model's budget has left beside the chunks that hold some.
pub fn enqueued_room(chunks: &[ChunkRecord], budget: Option<u64>) -> Option<u64> {
    let held: u64 = chunks.iter().filter(|c| c.holds_tokens()).map(|c| c.tokens).sum();
    budget.map(|b| b.saturating_sub(held))
}

/// The running cut of items into one chunk: the provider's request and byte limits and
/// the enqueued tokens there is room for, a ceiling. The first line always fits the byte
/// limit (a line too large for any batch goes alone and is refused by line). A line over
/// the token room waits for a chunk to end and give its tokens back; only when no chunk
/// holds any (`alone`: nothing will ever give room back) does a first line larger than
/// the whole budget go alone, for the provider to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    pub limits: BatchLimits,
    /// `None`: no enqueued-token budget.
    pub token_room: Option<u64>,
    /// No chunk holds enqueued tokens: the room is the whole budget.
    pub alone: bool,
    pub requests: usize,
    pub bytes: usize,
    pub tokens: u64,
}

impl Cut {
    pub fn new(limits: BatchLimits, token_room: Option<u64>, alone: bool) -> Cut {
        Cut { limits, token_room, alone, requests: 0, bytes: 0, tokens: 0 }
    }

    /// Takes a line of `bytes` and `tokens` if it fits; whether it did.
    pub fn take(&mut self, bytes: usize, tokens: u64) -> bool {
        let first = self.requests == 0;
        let over_room = self.token_room.is_some_and(|room| self.tokens + tokens > room);
        let fits = self.requests < self.limits.max_requests.max(1)
            && (first || self.bytes + bytes <= self.limits.max_bytes)
            && (!over_room || (first && self.alone));
        if fits {
            self.requests += 1;
            self.bytes += bytes;
            self.tokens += tokens;
        }
        fits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_id_is_its_custom_id_in_both_providers_alphabet() {
        assert_eq!(custom_id("us_0123456789abcdef0123456789abcdef"), Some("us_0123456789abcdef0123456789abcdef"));
        assert_eq!(custom_id("a-b_C9"), Some("a-b_C9"));
        assert_eq!(custom_id(""), None);
        assert_eq!(custom_id("has.dot"), None);
        assert_eq!(custom_id("has space"), None);
        assert_eq!(custom_id(&"x".repeat(65)), None);
        assert!(custom_id(&"x".repeat(64)).is_some());
    }

    #[test]
    fn items_are_cut_at_the_request_and_byte_limits() {
        let limits = BatchLimits { max_requests: 3, max_bytes: 100 };
        assert_eq!(chunks(&[10; 7], limits), vec![0..3, 3..6, 6..7]);
        assert_eq!(chunks(&[60, 50, 40, 10], limits), vec![0..1, 1..4]);
        // A line larger than a batch is a batch of its own.
        assert_eq!(chunks(&[10, 150, 10], limits), vec![0..1, 1..2, 2..3]);
        assert!(chunks(&[], limits).is_empty());
        // Every item in exactly one batch, in order, within the limits.
        let sizes: Vec<usize> = (0..1000).map(|i| 1 + (i * 37) % 90).collect();
        let cut = chunks(&sizes, limits);
        assert_eq!(cut.first().map(|r| r.start), Some(0));
        assert!(cut.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(cut.last().map(|r| r.end), Some(1000));
        assert!(cut.iter().all(|r| r.len() <= 3 && sizes[r.clone()].iter().sum::<usize>() <= 100));
    }

    #[test]
    fn every_status_of_both_providers_has_a_step() {
        let poll = ["validating", "in_progress", "finalizing", "cancelling"];
        for s in poll {
            assert_eq!(BatchStatus::openai(s, &[]).map(|s| step(&s)), Some(BatchStep::Poll), "{s}");
        }
        // Expired and cancelled batches have partial results: applied, not thrown away.
        for s in ["completed", "expired", "cancelled"] {
            assert_eq!(BatchStatus::openai(s, &[]).map(|s| step(&s)), Some(BatchStep::Collect), "{s}");
        }
        let token_limit = [("token_limit_exceeded".to_string(), None)];
        assert_eq!(BatchStatus::openai("failed", &token_limit).map(|s| step(&s)), Some(BatchStep::TokenLimit));
        let invalid = [("invalid_request".to_string(), Some(7)), ("invalid_request".to_string(), Some(2))];
        assert_eq!(
            BatchStatus::openai("failed", &invalid).map(|s| step(&s)),
            Some(BatchStep::Reject { lines: vec![2, 7] })
        );
        assert_eq!(BatchStatus::openai("unheard_of", &[]), None);
        assert_eq!(BatchStatus::anthropic("in_progress").map(|s| step(&s)), Some(BatchStep::Poll));
        assert_eq!(BatchStatus::anthropic("canceling").map(|s| step(&s)), Some(BatchStep::Poll));
        assert_eq!(BatchStatus::anthropic("ended").map(|s| step(&s)), Some(BatchStep::Collect));
        assert_eq!(BatchStatus::anthropic("completed"), None);
    }

    #[test]
    fn a_line_is_validated_ended_or_resubmitted_within_its_budget() {
        let ok = LineResult::Succeeded { output: "{}".into(), usage: None };
        assert_eq!(fate(ok.clone(), 0, 2, false), ItemFate::Validate { output: "{}".into(), usage: None });
        // Paid for: validated and delivered even when the sweep was cancelled.
        assert!(matches!(fate(ok, 5, 2, true), ItemFate::Validate { .. }));
        assert_eq!(
            fate(LineResult::Rejected { status: Some(400) }, 0, 2, false),
            ItemFate::Ended(TerminalReason::UpstreamRejected)
        );
        for r in [Retryable::RateLimited, Retryable::Transient, Retryable::Expired, Retryable::Cancelled] {
            assert_eq!(fate(LineResult::Retryable(r), 0, 2, false), ItemFate::Resubmit { resubmissions: 1 });
            assert_eq!(fate(LineResult::Retryable(r), 1, 2, false), ItemFate::Resubmit { resubmissions: 2 });
            assert_eq!(fate(LineResult::Retryable(r), 0, 2, true), ItemFate::Ended(TerminalReason::Cancelled));
        }
        assert_eq!(fate(LineResult::Missing, 0, 1, false), ItemFate::Resubmit { resubmissions: 1 });
        // The budget spent: each ends with its own reason.
        let spent = |line| fate(line, 2, 2, false);
        assert_eq!(
            spent(LineResult::Retryable(Retryable::RateLimited)),
            ItemFate::Ended(TerminalReason::RateLimitBudgetExhausted)
        );
        assert_eq!(spent(LineResult::Retryable(Retryable::Expired)), ItemFate::Ended(TerminalReason::DeadlineExceeded));
        assert_eq!(
            spent(LineResult::Retryable(Retryable::Transient)),
            ItemFate::Ended(TerminalReason::TransientBudgetExhausted)
        );
        assert_eq!(spent(LineResult::Missing), ItemFate::Ended(TerminalReason::TransientBudgetExhausted));
    }

    #[test]
    fn lines_in_any_order_give_each_item_one_result_and_the_missing_are_named() {
        let items: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let ok = |o: &str| LineResult::Succeeded { output: o.into(), usage: None };
        let lines = vec![
            ("c".to_string(), ok("c")),
            ("zz".to_string(), ok("stranger")),
            ("a".to_string(), LineResult::Rejected { status: Some(400) }),
            ("c".to_string(), ok("again")),
        ];
        let r = reconcile(&items, lines);
        assert_eq!(
            r.items,
            vec![
                ("a".to_string(), LineResult::Rejected { status: Some(400) }),
                ("b".to_string(), LineResult::Missing),
                ("c".to_string(), ok("c")),
                ("d".to_string(), LineResult::Missing),
            ]
        );
        assert_eq!((r.unknown, r.repeated), (1, 1));
        assert_eq!(fate(LineResult::OutOfQuota, 0, 2, false), ItemFate::Ended(TerminalReason::InsufficientQuota));
    }

    #[test]
    fn a_line_error_is_classified_by_kind_not_run_refused_or_unknown() {
        let not_run = |r| LineResult::Retryable(r);
        // Did not run: sent again within the item's budget.
        assert_eq!(line_error("request_timeout"), not_run(Retryable::Transient));
        assert_eq!(line_error("server_error"), not_run(Retryable::Transient));
        assert_eq!(line_error("overloaded_error"), not_run(Retryable::Transient));
        assert_eq!(line_error("rate_limit_exceeded"), not_run(Retryable::RateLimited));
        assert_eq!(line_error("batch_expired"), not_run(Retryable::Expired));
        assert_eq!(line_error("batch_cancelled"), not_run(Retryable::Cancelled));
        // Refused: the same request would be refused again.
        assert_eq!(line_error("invalid_request_error"), LineResult::Rejected { status: None });
        assert_eq!(line_error("invalid_url"), LineResult::Rejected { status: None });
        assert_eq!(line_error("insufficient_quota"), LineResult::OutOfQuota);
        // Unknown: taken as not run.
        assert_eq!(line_error("quantum_flux"), not_run(Retryable::Unrecognised));
        assert_eq!(
            fate(line_error("quantum_flux"), 0, 2, false),
            ItemFate::Resubmit { resubmissions: 1 },
            "an unknown code is sent again within the budget"
        );
        assert_eq!(
            fate(line_error("request_timeout"), 2, 2, false),
            ItemFate::Ended(TerminalReason::TransientBudgetExhausted)
        );
    }

    #[test]
    fn a_refused_batch_is_cut_again_from_its_own_size_and_a_lone_item_ends_after_a_bounded_wait() {
        let poll = PollBackoff { first: Duration::from_secs(30), cap: Duration::from_secs(300) };
        let limits = BatchLimits::OPENAI;
        let mut r = Refusals::default();
        assert_eq!(r.limits(limits), limits);
        // 40 refused: 20, 10, 5, 2, 1 — from the refused batch's size, not the limit's.
        let mut sizes = Vec::new();
        let mut size = 40;
        while size > 1 {
            assert_eq!(r.refused(size, 0, poll), Refused::Again);
            size = r.limits(limits).max_requests;
            sizes.push(size);
        }
        assert_eq!(sizes, vec![20, 10, 5, 2, 1]);
        assert_eq!(r.not_before_ms, 0, "a smaller batch goes at once");
        // Alone and refused: it waits 30 s, 60 s, ... 5 min, then ends.
        let mut now = 0;
        let mut waited = 0;
        for _ in 0..ALONE_REFUSALS_MAX {
            assert_eq!(r.refused(1, now, poll), Refused::Again);
            waited += r.not_before_ms - now;
            now = r.not_before_ms;
        }
        assert_eq!(waited, (30 + 60 + 120 + 240 + 300 + 300) * 1_000);
        assert_eq!(r.refused(1, now, poll), Refused::End);
        // A batch that ran lets the next grow again.
        let mut r = Refusals::default();
        r.refused(40, 0, poll);
        r.ran();
        assert_eq!(r.limits(limits).max_requests, 40);
        // The budget believed comes down below what was held.
        assert_eq!(believed_budget(None, 90_000, 40_000), Some(70_000));
        assert_eq!(believed_budget(Some(60_000), 90_000, 40_000), Some(60_000));
        assert_eq!(believed_budget(Some(100_000), 20_000, 20_000), Some(10_000));
    }

    #[test]
    fn polling_doubles_to_its_cap_and_waits_out_a_hint() {
        let b = PollBackoff::default();
        let secs = |n, hint| b.delay(n, hint).as_secs();
        assert_eq!(
            [secs(0, None), secs(1, None), secs(2, None), secs(3, None), secs(4, None)],
            [30, 60, 120, 240, 300]
        );
        assert_eq!(secs(40, None), 300);
        assert_eq!(secs(0, Some(Duration::from_secs(90))), 90);
        assert_eq!(secs(4, Some(Duration::from_secs(90))), 300);
    }

    #[test]
    fn the_estimate_follows_live_counts_else_recent_turnaround() {
        // A quarter done in 10 min: three quarters more at that pace.
        assert_eq!(estimate(250, 1000, 0, 600_000, None), Some(600_000 + 1_800_000));
        // No counts (Anthropic reports none before the end): the recent turnaround.
        assert_eq!(estimate(0, 1000, 100_000, 200_000, Some(3_600_000)), Some(3_700_000));
        // Running longer than the turnaround: not before now.
        assert_eq!(estimate(0, 1000, 0, 5_000_000, Some(3_600_000)), Some(5_000_000));
        assert_eq!(estimate(0, 1000, 0, 1_000, None), None);
        assert_eq!(estimate(1000, 1000, 0, 7_000, None), Some(7_000));
        assert_eq!(estimate(0, 0, 0, 7_000, None), Some(7_000));
    }

    #[test]
    fn a_chunk_is_cut_at_the_limits_and_the_enqueued_token_room() {
        let limits = BatchLimits { max_requests: 3, max_bytes: 100 };
        let mut cut = Cut::new(limits, Some(50), false);
        assert!(cut.take(10, 20) && cut.take(10, 20));
        assert!(!cut.take(10, 20), "over the token room");
        let mut cut = Cut::new(limits, None, true);
        assert!(cut.take(10, 1) && cut.take(10, 1) && cut.take(10, 1));
        assert!(!cut.take(10, 1), "over the request limit");
        // The room is a ceiling, for the first line too: 10.5 lines' worth holds 10.
        let mut cut = Cut::new(BatchLimits { max_requests: 100, max_bytes: 1_000 }, Some(54_064), false);
        let mut took = 0;
        while cut.take(10, 5_151) {
            took += 1;
        }
        assert_eq!((took, cut.tokens), (10, 51_510));
        let mut cut = Cut::new(limits, Some(5), false);
        assert!(!cut.take(1, 6), "over the room, while a chunk holds tokens: it waits");
        // Nothing holds any: a first line over the whole budget goes alone.
        let mut cut = Cut::new(limits, Some(5), true);
        assert!(cut.take(150, 99), "the first line always fits the byte limit, and alone the budget");
        assert!(!cut.take(1, 1));
        let mut cut = Cut::new(limits, None, true);
        assert!(cut.take(60, 0) && !cut.take(50, 0), "over the byte limit");
    }

    #[test]
    fn chunks_hold_enqueued_tokens_from_their_cut_until_applied() {
        let mut a = ChunkRecord::new("us_s", "t", 1, vec!["a".into(), "b".into(), "c".into()], 0);
        a.tokens = 30;
        let mut b = a.clone();
        assert_eq!(enqueued_room(&[a.clone()], Some(100)), Some(70), "held from its cut");
        a.step = ChunkStep::Intent;
        b.step = ChunkStep::Created;
        assert_eq!(enqueued_room(&[a.clone(), b.clone()], Some(100)), Some(40));
        b.step = ChunkStep::Applied;
        assert_eq!(enqueued_room(&[a.clone(), b], Some(100)), Some(70));
        assert_eq!(enqueued_room(&[a.clone()], None), None);
        assert_eq!(a.jobs_of_lines(&[3, 1, 9, 0]), vec!["c".to_string(), "a".to_string()]);
        assert_eq!(a.chunk_id, "batch-us_s-000001");
        assert!(custom_id(&a.chunk_id).is_some(), "fits the providers' id alphabet");
        use crate::job::Owner;
        assert_eq!(Owner::from(a.chunk_id.clone()), Owner::ProviderBatch(a.chunk_id.clone()));
        assert_eq!(Owner::from("replica-1".to_string()), Owner::Replica("replica-1".into()));
        assert_eq!(Owner::from("lanes".to_string()), Owner::Lanes);
        for o in [Owner::ProviderBatch(a.chunk_id.clone()), Owner::Replica("replica-1".into()), Owner::Lanes] {
            let json = serde_json::to_string(&o).unwrap();
            assert_eq!(serde_json::from_str::<Owner>(&json).unwrap(), o, "stored as one string: {json}");
        }
        assert_eq!(serde_json::to_string(&Owner::Lanes).unwrap(), "\"lanes\"");
    }

    #[test]
    fn a_chunk_moves_from_its_lease_through_its_send_to_its_end_and_refuses_any_other_step() {
        let cut = ChunkRecord::new("us_s", "acme", 1, vec!["us_a".into(), "us_b".into()], 10);
        let leased = |ids: &[&str]| ChunkEvent::Leased {
            job_ids: ids.iter().map(|s| s.to_string()).collect(),
            input_digest: "d".into(),
            newest_before: Some("b0".into()),
        };
        // Nothing leased: over at once.
        let none = cut.after(leased(&[]), 20).unwrap();
        assert_eq!((none.step, none.ended_at_ms, none.job_ids.len()), (ChunkStep::Applied, Some(20), 0));
        // Uploaded, then created (OpenAI).
        let intent = cut.after(leased(&["us_b"]), 20).unwrap();
        assert_eq!((intent.step, intent.job_ids.clone()), (ChunkStep::Intent, vec!["us_b".to_string()]));
        assert_eq!((intent.input_digest.as_deref(), intent.newest_before.as_deref()), (Some("d"), Some("b0")));
        let uploaded = intent.after(ChunkEvent::Uploaded { file_id: "f".into() }, 22).unwrap();
        assert_eq!((uploaded.step, uploaded.file_id.as_deref()), (ChunkStep::Uploaded, Some("f")));
        let created = uploaded.after(ChunkEvent::Created { batch_id: "b1".into() }, 30).unwrap();
        assert_eq!((created.step, created.submitted_at_ms), (ChunkStep::Created, Some(30)));
        // Created from the intent (Anthropic: the requests inline).
        assert_eq!(intent.after(ChunkEvent::Created { batch_id: "b2".into() }, 30).unwrap().step, ChunkStep::Created);
        let counted = created.after(ChunkEvent::Counted { succeeded: 1, failed: 0 }, 40).unwrap();
        assert_eq!((counted.lines_succeeded, counted.lines_failed), (1, 0));
        let cancelled = counted.after(ChunkEvent::CancelSent, 41).unwrap();
        assert!(cancelled.cancel_sent);
        let ended = cancelled.after(ChunkEvent::Ended, 50).unwrap();
        assert_eq!((ended.step, ended.turnaround_ms()), (ChunkStep::Applied, Some(20)));
        // Out of order.
        assert_eq!(cut.after(ChunkEvent::Ended, 1), Err(ChunkError::Step(ChunkStep::Leasing)));
        assert_eq!(
            uploaded.after(ChunkEvent::Uploaded { file_id: "g".into() }, 1),
            Err(ChunkError::Step(ChunkStep::Uploaded))
        );
        assert_eq!(created.after(leased(&["us_a"]), 1), Err(ChunkError::Step(ChunkStep::Created)));
        assert_eq!(
            ended.after(ChunkEvent::Created { batch_id: "b3".into() }, 1),
            Err(ChunkError::Step(ChunkStep::Applied))
        );
        assert_eq!(
            intent.after(ChunkEvent::Counted { succeeded: 1, failed: 1 }, 1),
            Err(ChunkError::Step(ChunkStep::Intent))
        );
    }

    #[test]
    fn an_item_waits_for_a_batch_until_one_names_it_and_a_cancelled_sweeps_waiting_items_end() {
        use crate::job::JobState;
        let job = |state, owner: Option<&str>| {
            let mut r = crate::testing::record("us_a", state);
            r.owner = owner.map(|o| crate::job::Owner::from(o.to_string()));
            r
        };
        let again = job(JobState::RetryScheduled, Some("batch-us_s-000001"));
        let lanes = job(JobState::RetryScheduled, Some("lanes"));
        let running = job(JobState::Running, Some("batch-us_s-000001"));
        let validated = job(JobState::Validated, None);
        let published = job(JobState::Published, None);
        assert_eq!(triage(None, false, false), Triage::Waits, "no job yet");
        assert_eq!(triage(Some(&again), false, false), Triage::Waits, "sent again");
        assert_eq!(triage(Some(&again), true, false), Triage::Open, "a chunk being leased names it");
        assert_eq!(triage(Some(&lanes), false, false), Triage::Open, "handed to the lanes");
        assert_eq!(triage(Some(&running), false, false), Triage::Open, "in a batch");
        assert_eq!(
            (triage(Some(&validated), false, false), triage(Some(&published), false, false)),
            (Triage::Done, Triage::Done)
        );
        assert_eq!(triage(None, false, true), Triage::Cancel);
        assert_eq!(triage(Some(&again), false, true), Triage::Cancel);
        assert_eq!(triage(Some(&again), true, true), Triage::Open, "its chunk ends it");
        assert_eq!(triage(Some(&running), false, true), Triage::Open, "what runs finishes");
    }
}
