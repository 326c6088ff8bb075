//! Provider batch processing: the room where a sweep's items go through a provider's
//! own batch API (OpenAI `/v1/batches`, Anthropic `/v1/messages/batches`) rather than
//! one call each. The rules of it are pure and live in `reviewlane_core::batch` (ids,
//! cutting batches, what each status and each line means, polling, the estimate);
//! each adapter builds its own request lines (`OpenAiProvider::batch_line`,
//! `AnthropicProvider::batch_request`: the synchronous call's body under the item's
//! custom id); here are the batch clients (`openai`, `anthropic`) and what reads their
//! result files (`lines`, one result line into its item and what it says).

pub mod anthropic;
pub mod lines;
pub mod openai;

use std::time::{Duration, SystemTime};

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
