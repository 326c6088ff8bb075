//! Anthropic's Message Batches API: a batch created on `/v1/messages/batches` with its
//! requests inline (`{custom_id, params}`: `AnthropicProvider::batch_request`), polled
//! by `processing_status`, cancelled, listed (newest first: a coordinator that crashed
//! finds a batch it may have created by its creation time and, once ended, by the
//! custom ids of its results), and its results streamed from `results_url` line by
//! line (`lines::anthropic`). Only `succeeded` lines are billed. Answers are classified
//! as the OpenAI client's are (`BatchApiError`).

use std::time::Duration;

use reviewlane_core::batch::{BatchStatus, LineResult};
use reviewlane_shared::Region;
use secrecy::{ExposeSecret, SecretString};

use super::BatchApiError;
use crate::provider::anthropic::ANTHROPIC_VERSION;

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
}

impl AnthropicBatches {
    /// The Message Batches API under `base_url` (the Messages API's, e.g.
    /// `https://api.anthropic.com`), in `region`.
    pub fn new(
        base_url: &str,
        api_key: Option<SecretString>,
        region: Region,
        timeout: Duration,
        hint_ceiling: Duration,
    ) -> Self {
        AnthropicBatches {
            http: crate::provider::http_client(timeout),
            base: format!("{}/v1/messages/batches", base_url.trim_end_matches('/')),
            api_key,
            region,
            hint_ceiling,
        }
    }

    /// The region whose data this endpoint may carry.
    pub fn region(&self) -> Region {
        self.region
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

    pub async fn get(&self, batch_id: &str) -> Result<MessageBatch, BatchApiError> {
        self.batch(self.http.get(format!("{}/{batch_id}", self.base))).await
    }

    pub async fn cancel(&self, batch_id: &str) -> Result<MessageBatch, BatchApiError> {
        self.batch(self.http.post(format!("{}/{batch_id}/cancel", self.base))).await
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

    /// Every result line of an ended batch (none before it has a `results_url`), in
    /// the order read. Unreadable lines name no item and are left out.
    pub async fn lines(&self, batch: &MessageBatch) -> Result<Vec<(String, LineResult)>, BatchApiError> {
        let Some(url) = &batch.results_url else { return Ok(Vec::new()) };
        let body = self.send(self.http.get(url)).await?;
        Ok(body.split(|b| *b == b'\n').filter(|l| !l.is_empty()).filter_map(super::lines::anthropic).collect())
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
