//! Provider batch processing: the room where a sweep's items go through a provider's
//! own batch API (OpenAI `/v1/batches`, Anthropic `/v1/messages/batches`) rather than
//! one call each. The rules of it are pure and live in `reviewlane_core::batch` (ids,
//! cutting batches, what each status and each line means, polling, the estimate);
//! each adapter builds its own request lines (`OpenAiProvider::batch_line`,
//! `AnthropicProvider::batch_request`: the synchronous call's body under the item's
//! custom id). Here is `BatchApi`, the one face the sweep coordinator sees of a
//! provider's batch API, its two implementations (`openai`, `anthropic`), and what
//! reads their result files (`lines`, one result line into its item and what it says).
//! A third batch provider is a file here, its adapter's line builder and its config.

pub mod anthropic;
pub mod lines;
pub mod openai;

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use reviewlane_core::batch::{BatchLimits, BatchStatus, ChunkRecord, LineResult};

use crate::provider::ProviderRequest;

/// A provider's batch API as the sweep coordinator uses it: the request line of an
/// item, sending a chunk, finding a batch a crash may have created before its id was
/// recorded, polling, cancelling and reading the result lines. Every method answers
/// as the provider answered (`BatchApiError`); none retries.
#[async_trait::async_trait]
pub trait BatchApi: Send + Sync {
    /// `openai`, `anthropic`: in spans.
    fn provider(&self) -> &'static str;
    /// The region whose data its endpoint may carry.
    fn region(&self) -> reviewlane_shared::Region;
    /// The provider's own limits on one batch.
    fn limits(&self) -> BatchLimits;
    /// An item's request line: the synchronous call's body under its custom id.
    fn line(&self, custom_id: &str, req: &ProviderRequest<'_>) -> serde_json::Value;
    /// What `find` needs to know of the account's batches before the chunk is sent,
    /// stored with the intent (`ChunkRecord::newest_before`); `None` when it needs
    /// nothing.
    async fn mark(&self) -> Result<Option<String>, BatchApiError> {
        Ok(None)
    }
    /// One step of sending the chunk, from its record as it stands: an API that takes
    /// an input file uploads it first (`Sent::Uploaded`, recorded before the create),
    /// then creates the batch from it; one that takes the requests inline creates the
    /// batch at once. Neither create is idempotent.
    async fn send(&self, chunk: &ChunkRecord, lines: &[serde_json::Value]) -> Result<Sent, BatchApiError>;
    /// A batch the chunk may have created before a crash kept its id, adopted only on
    /// proof that it is the chunk's; `known` are the batches recorded by chunks,
    /// `not_ours` those already shown another's (a candidate shown not the chunk's
    /// joins it). A batch not proven the chunk's is never polled, applied or cancelled.
    async fn find(
        &self,
        chunk: &ChunkRecord,
        known: &HashSet<String>,
        not_ours: &mut HashSet<String>,
    ) -> Result<Found, BatchApiError>;
    async fn get(&self, batch_id: &str) -> Result<Polled, BatchApiError>;
    async fn cancel(&self, batch_id: &str) -> Result<(), BatchApiError>;
    /// Every result line of an ended batch: (custom id, what it says), in any order.
    /// Unreadable lines name no item and are left out.
    async fn results(&self, polled: &Polled) -> Result<Vec<(String, LineResult)>, BatchApiError>;
}

/// What one step of sending a chunk did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// Its input file is uploaded; the batch is created from it next.
    Uploaded {
        file_id: String,
    },
    Created {
        batch_id: String,
    },
}

/// What looking for a batch a crash may have left unrecorded found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// This batch is the chunk's.
    Ours(String),
    /// A batch that may be the chunk's is still running: it cannot be told yet.
    Unproven,
    /// None: the chunk's batch was never created.
    None,
}

/// A batch as polled, in any provider's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Polled {
    pub status: BatchStatus,
    /// Lines that succeeded and lines that failed so far (OpenAI reports them while the
    /// batch runs; Anthropic once it has ended).
    pub succeeded: u64,
    pub failed: u64,
    /// Where its result lines are read once it has ended (OpenAI: its output and error
    /// files; Anthropic: its `results_url`).
    pub results: Vec<String>,
}

/// Pages of the account's batches looked through for one a crash may have created.
pub(crate) const FIND_PAGES: u32 = 5;

/// Why a request to the batch endpoints did not go through.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchApiError {
    /// 429: try again after the provider's hint (else the poll backoff).
    #[error("rate limited")]
    RateLimited { retry_after: Option<Duration> },
    /// 408, 5xx, a timeout or a reset connection.
    #[error("transient failure ({0})")]
    Transient(&'static str),
    /// Any other 4xx: the same request would be refused again.
    #[error("refused with {status}")]
    Refused { status: u16 },
    /// A 2xx that is not what the endpoint returns.
    #[error("unreadable answer")]
    Unreadable,
}

/// Sends a prepared request to a batch endpoint and classifies the answer as any
/// provider answer is: a 429 with its hint (cut to `hint_ceiling`), a 408, 5xx, timeout
/// or reset transient, any other 4xx refused; the body of a 2xx.
pub(crate) async fn send(rb: reqwest::RequestBuilder, hint_ceiling: Duration) -> Result<bytes::Bytes, BatchApiError> {
    let answer = match rb.send().await {
        Ok(a) => a,
        Err(e) if e.is_timeout() => return Err(BatchApiError::Transient("timeout")),
        Err(_) => return Err(BatchApiError::Transient("connection")),
    };
    let status = answer.status().as_u16();
    let headers = answer.headers().clone();
    let body = answer.bytes().await.map_err(|_| BatchApiError::Transient("connection"))?;
    match status {
        200..=299 => Ok(body),
        429 => {
            let hint = reviewlane_core::retry_hint::retry_hint(&headers, SystemTime::now(), hint_ceiling);
            Err(BatchApiError::RateLimited { retry_after: hint.map(|h| h.delay) })
        }
        408 | 500..=599 => Err(BatchApiError::Transient("5xx")),
        status => Err(BatchApiError::Refused { status }),
    }
}
