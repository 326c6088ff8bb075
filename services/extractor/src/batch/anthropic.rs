//! Anthropic's Message Batches API: a batch created on `/v1/messages/batches` with its
//! requests inline (`{custom_id, params}`: `AnthropicProvider::batch_request`), polled
//! by `processing_status`, cancelled, listed (newest first: a coordinator that crashed
//! finds a batch it may have created by its creation time and, once ended, by the
//! custom ids of its results), and its results streamed from `results_url` line by
//! line (`lines::anthropic`). Only `succeeded` lines are billed. Answers are classified
//! as the OpenAI client's are (`BatchApiError`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use reviewlane_core::batch::{self, BatchLimits, BatchStatus, ChunkRecord, LineResult};
use reviewlane_shared::Region;
use secrecy::{ExposeSecret, SecretString};

use super::{BatchApi, BatchApiError, FIND_PAGES, Found, Polled, Sent};
use crate::provider::ProviderRequest;
use crate::provider::anthropic::{ANTHROPIC_VERSION, AnthropicProvider};

/// A message batch as the API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageBatch {
    pub id: String,
    pub status: BatchStatus,
    /// Requests still processing, and those ended each way (Anthropic reports these
    /// only as they end; nothing per line before).
    pub processing: u64,
    pub succeeded: u64,
    pub errored: u64,
    pub canceled: u64,
    pub expired: u64,
    /// Set once the batch has ended.
    pub results_url: Option<String>,
    /// RFC 3339, as sent.
    pub created_at: String,
}

impl MessageBatch {
    /// Reads a `message_batch` object; `None` when it is not one.
    pub fn from_json(v: &serde_json::Value) -> Option<MessageBatch> {
        let counts = &v["request_counts"];
        let n = |k: &str| counts[k].as_u64().unwrap_or(0);
        Some(MessageBatch {
            id: v["id"].as_str()?.to_string(),
            status: BatchStatus::anthropic(v["processing_status"].as_str()?)?,
            processing: n("processing"),
            succeeded: n("succeeded"),
            errored: n("errored"),
            canceled: n("canceled"),
            expired: n("expired"),
            results_url: v["results_url"].as_str().filter(|u| !u.is_empty()).map(str::to_string),
            created_at: v["created_at"].as_str().unwrap_or_default().to_string(),
        })
    }
}

pub struct AnthropicBatches {
    http: reqwest::Client,
    base: String,
    api_key: Option<SecretString>,
    region: Region,
    hint_ceiling: Duration,
    /// Builds the requests.
    adapter: Arc<AnthropicProvider>,
}

impl AnthropicBatches {
    /// The Message Batches API under `base_url` (the Messages API's, e.g.
    /// `https://api.anthropic.com`), in `region`, its requests built by `adapter`.
    pub fn new(
        base_url: &str,
        api_key: Option<SecretString>,
        region: Region,
        (timeout, hint_ceiling): (Duration, Duration),
        adapter: Arc<AnthropicProvider>,
    ) -> Self {
        AnthropicBatches {
            http: crate::provider::http_client(timeout),
            base: format!("{}/v1/messages/batches", base_url.trim_end_matches('/')),
            api_key,
            region,
            hint_ceiling,
            adapter,
        }
    }

    /// Sends with the version and the key, and classifies; the body of a 2xx.
    async fn send(&self, rb: reqwest::RequestBuilder) -> Result<bytes::Bytes, BatchApiError> {
        let mut rb = rb.header("anthropic-version", ANTHROPIC_VERSION);
        if let Some(key) = &self.api_key {
            rb = rb.header("x-api-key", key.expose_secret());
        }
        super::send(rb, self.hint_ceiling).await
    }

    async fn batch(&self, rb: reqwest::RequestBuilder) -> Result<MessageBatch, BatchApiError> {
        let v: serde_json::Value =
            serde_json::from_slice(&self.send(rb).await?).map_err(|_| BatchApiError::Unreadable)?;
        MessageBatch::from_json(&v).ok_or(BatchApiError::Unreadable)
    }

    /// Creates a batch of `requests` (each `{custom_id, params}`).
    pub async fn create(&self, requests: &[serde_json::Value]) -> Result<MessageBatch, BatchApiError> {
        self.batch(self.http.post(&self.base).json(&serde_json::json!({ "requests": requests }))).await
    }

    pub async fn retrieve(&self, batch_id: &str) -> Result<MessageBatch, BatchApiError> {
        self.batch(self.http.get(format!("{}/{batch_id}", self.base))).await
    }

    /// A page of batches, newest first, after `after_id`; and whether more follow.
    pub async fn list(&self, after_id: Option<&str>, limit: u32) -> Result<(Vec<MessageBatch>, bool), BatchApiError> {
        let mut query = vec![("limit", limit.to_string())];
        if let Some(a) = after_id {
            query.push(("after_id", a.to_string()));
        }
        let body = self.send(self.http.get(&self.base).query(&query)).await?;
        let v: serde_json::Value = serde_json::from_slice(&body).map_err(|_| BatchApiError::Unreadable)?;
        let page = v["data"].as_array().into_iter().flatten().filter_map(MessageBatch::from_json).collect();
        Ok((page, v["has_more"].as_bool().unwrap_or(false)))
    }

    pub async fn cancel_batch(&self, batch_id: &str) -> Result<MessageBatch, BatchApiError> {
        self.batch(self.http.post(format!("{}/{batch_id}/cancel", self.base))).await
    }

    /// Every result line of an ended batch (none before it has a `results_url`), in
    /// the order read.
    pub async fn lines(&self, batch: &MessageBatch) -> Result<Vec<(String, LineResult)>, BatchApiError> {
        match &batch.results_url {
            Some(url) => self.read_results(url).await,
            None => Ok(Vec::new()),
        }
    }

    /// The result lines at `url`, in the order read. Unreadable lines name no item and
    /// are left out.
    async fn read_results(&self, url: &str) -> Result<Vec<(String, LineResult)>, BatchApiError> {
        let body = self.send(self.http.get(url)).await?;
        Ok(body.split(|b| *b == b'\n').filter(|l| !l.is_empty()).filter_map(super::lines::anthropic).collect())
    }

    /// The batches listed before `newest_before` (newer than it), as many pages as are
    /// looked through, with `requests` requests, that neither a chunk names (`known`)
    /// nor were shown another's (`not_ours`).
    async fn candidates(
        &self,
        newest_before: Option<&String>,
        requests: u64,
        skip: impl Fn(&str) -> bool,
    ) -> Result<Vec<MessageBatch>, BatchApiError> {
        let mut candidates = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..FIND_PAGES {
            let (page, more) = self.list(after.as_deref(), 100).await?;
            for b in &page {
                if Some(&b.id) == newest_before {
                    return Ok(candidates);
                }
                let size = b.processing + b.succeeded + b.errored + b.canceled + b.expired;
                if size == requests && !skip(&b.id) {
                    candidates.push(b.clone());
                }
            }
            match page.last() {
                Some(last) if more => after = Some(last.id.clone()),
                _ => break,
            }
        }
        Ok(candidates)
    }
}

#[async_trait::async_trait]
impl BatchApi for AnthropicBatches {
    fn provider(&self) -> &'static str {
        "anthropic"
    }

    fn region(&self) -> Region {
        self.region
    }

    fn limits(&self) -> BatchLimits {
        BatchLimits::ANTHROPIC
    }

    fn line(&self, custom_id: &str, req: &ProviderRequest<'_>) -> serde_json::Value {
        self.adapter.batch_request(custom_id, req)
    }

    /// The newest batch of the workspace now: a batch newer than it may be the chunk's
    /// after a crash.
    async fn mark(&self) -> Result<Option<String>, BatchApiError> {
        Ok(self.list(None, 1).await?.0.first().map(|b| b.id.clone()))
    }

    /// Creates the batch with the requests inline.
    async fn send(&self, _chunk: &ChunkRecord, lines: &[serde_json::Value]) -> Result<Sent, BatchApiError> {
        Ok(Sent::Created { batch_id: self.create(lines).await?.id })
    }

    /// No metadata names a message batch. Among the batches newer than the mark with as
    /// many requests as the chunk, the one whose results — once it has ended — carry
    /// exactly the chunk's custom ids (its items' job ids, which no other application
    /// uses). A candidate still running cannot be told yet: `Found::Unproven`, and the
    /// chunk waits (no second create) until it ends. An ended candidate's results are
    /// read once, for their custom ids.
    async fn find(
        &self,
        chunk: &ChunkRecord,
        known: &HashSet<String>,
        not_ours: &mut HashSet<String>,
    ) -> Result<Found, BatchApiError> {
        let requests = chunk.job_ids.len() as u64;
        let skip = |id: &str| known.contains(id) || not_ours.contains(id);
        let candidates = self.candidates(chunk.newest_before.as_ref(), requests, skip).await?;
        let mine: HashSet<&str> = chunk.job_ids.iter().map(String::as_str).collect();
        let mut unproven = false;
        for b in candidates {
            if batch::step(&b.status) == batch::BatchStep::Poll {
                unproven = true;
                continue;
            }
            let mut ids = HashSet::new();
            if let Some(url) = &b.results_url {
                ids.extend(self.read_results(url).await?.into_iter().map(|(id, _)| id));
            }
            if ids.len() == mine.len() && ids.iter().all(|id| mine.contains(id.as_str())) {
                return Ok(Found::Ours(b.id));
            }
            not_ours.insert(b.id);
        }
        Ok(if unproven { Found::Unproven } else { Found::None })
    }

    async fn get(&self, batch_id: &str) -> Result<Polled, BatchApiError> {
        let b = self.retrieve(batch_id).await?;
        Ok(Polled {
            status: b.status,
            succeeded: b.succeeded,
            failed: b.errored + b.canceled + b.expired,
            results: b.results_url.into_iter().collect(),
        })
    }

    async fn cancel(&self, batch_id: &str) -> Result<(), BatchApiError> {
        self.cancel_batch(batch_id).await.map(drop)
    }

    async fn results(&self, polled: &Polled) -> Result<Vec<(String, LineResult)>, BatchApiError> {
        let mut out = Vec::new();
        for url in &polled.results {
            out.extend(self.read_results(url).await?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_batch_is_read_with_its_counts_and_results_url_once_ended() {
        let running = serde_json::json!({
            "id": "msgbatch_1", "type": "message_batch", "processing_status": "in_progress",
            "request_counts": {"processing": 3, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0},
            "results_url": null, "created_at": "2026-12-04T00:00:00Z",
        });
        let b = MessageBatch::from_json(&running).unwrap();
        assert_eq!((b.status, b.processing, b.results_url), (BatchStatus::InProgress, 3, None));
        let ended = serde_json::json!({
            "id": "msgbatch_1", "processing_status": "ended",
            "request_counts": {"processing": 0, "succeeded": 2, "errored": 1, "canceled": 0, "expired": 0},
            "results_url": "https://api.anthropic.com/v1/messages/batches/msgbatch_1/results",
        });
        let b = MessageBatch::from_json(&ended).unwrap();
        assert_eq!((b.status, b.succeeded, b.errored), (BatchStatus::Ended, 2, 1));
        assert!(b.results_url.is_some());
        assert_eq!(MessageBatch::from_json(&serde_json::json!({"id": "x", "processing_status": "odd"})), None);
    }
}
