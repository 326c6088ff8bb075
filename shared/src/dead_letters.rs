//! The region's dead letters, written and read: references on `DEADLETTER_<R>` (one
//! subject per job: `deadletter.<r>.<tenant>.<job id>`) and the content they point to
//! on `DEADLETTER_CONTENT_<R>`, kept for a shorter time.

use std::time::Duration;

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_nats::jetstream::{self, consumer};
use base64::Engine as _;
use futures::StreamExt;

use crate::layout;
use crate::store::StoreError;
use reviewlane_core::messages::{DeadLetter, ReviewMessage};
use reviewlane_core::region::Region;

#[derive(Clone)]
pub struct DeadLetters {
    js: jetstream::Context,
    region: Region,
}

/// A page of references and the token of the next one.
pub struct Page {
    pub dead_letters: Vec<DeadLetter>,
    pub next: Option<String>,
}

/// A page token: the stream sequence the next page starts at.
pub fn token(seq: u64) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("dl:{seq}"))
}

/// The sequence a token names (`""`: the first page); `None` for a token this service
/// did not issue.
pub fn from_token(t: &str) -> Option<u64> {
    if t.is_empty() {
        return Some(1);
    }
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(t).ok()?;
    String::from_utf8(raw).ok()?.strip_prefix("dl:")?.parse().ok()
}

impl DeadLetters {
    pub fn new(js: jetstream::Context, region: Region) -> Self {
        DeadLetters { js, region }
    }

    /// Moves a failed review off its lane into the dead letters (same region, same
    /// access policy as the diff): the content (`payload`, the lane message as it was)
    /// on `DEADLETTER_CONTENT_<R>`, then the reference pointing to it on
    /// `DEADLETTER_<R>`. Both deduplicated by job id. A cancelled job is not a failure:
    /// nothing of it is kept (the ingress dropped its content at the cancel).
    pub async fn publish(
        &self,
        review: &ReviewMessage,
        payload: bytes::Bytes,
        reason: reviewlane_core::job::TerminalReason,
        attempts: reviewlane_core::job::Attempts,
        dead_at_ms: u64,
    ) -> Result<(), StoreError> {
        if reason == reviewlane_core::job::TerminalReason::Cancelled {
            return Ok(());
        }
        let headers = || {
            let mut h = async_nats::HeaderMap::new();
            h.insert(async_nats::header::NATS_MESSAGE_ID, review.job_id.as_str());
            h.insert("Reviewlane-Reason", reason.as_str());
            h
        };
        let content_subject = layout::deadletter_content_subject(review.region, &review.tenant, &review.job_id);
        self.publish_acked(content_subject.clone(), headers(), payload).await?;
        let reference = DeadLetter {
            job_id: review.job_id.clone(),
            tenant: review.tenant.clone(),
            region: review.region,
            lane: review.lane,
            reason: reason.as_str().to_string(),
            attempts,
            schema_version: review.schema_version.clone(),
            input_digest: review.input_digest.clone(),
            request_digest: review.request_digest.clone(),
            submitted_at_ms: review.submitted_at_ms,
            dead_at_ms,
            content_subject,
        };
        let subject = layout::deadletter_subject(review.region, &review.tenant, &review.job_id);
        let body = serde_json::to_vec(&reference).expect("dead letter serializes");
        self.publish_acked(subject, headers(), body.into()).await
    }

    async fn publish_acked(
        &self,
        subject: String,
        headers: async_nats::HeaderMap,
        body: bytes::Bytes,
    ) -> Result<(), StoreError> {
        self.js
            .publish_with_headers(subject, headers, body)
            .await
            .map_err(StoreError::publish)?
            .await
            .map_err(StoreError::publish)?;
        Ok(())
    }

    async fn last(&self, stream: String, subject: &str) -> Result<Option<bytes::Bytes>, StoreError> {
        let s = self.js.get_stream_no_info(stream).await.map_err(StoreError::other)?;
        match s.get_last_raw_message_by_subject(subject).await {
            Ok(m) => Ok(Some(m.payload)),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(StoreError::other(e)),
        }
    }

    /// The reference of one job's dead letter.
    pub async fn get(&self, tenant: &str, job_id: &str) -> Result<Option<DeadLetter>, StoreError> {
        let subject = layout::deadletter_subject(self.region, tenant, job_id);
        match self.last(layout::deadletter_stream(self.region), &subject).await? {
            Some(p) => serde_json::from_slice(&p).map(Some).map_err(|_| StoreError::Corrupt),
            None => Ok(None),
        }
    }

    /// The review a dead letter points to, while its retention lasts.
    pub async fn content(&self, d: &DeadLetter) -> Result<Option<ReviewMessage>, StoreError> {
        match self.last(layout::deadletter_content_stream(self.region), &d.content_subject).await? {
            Some(p) => serde_json::from_slice(&p).map(Some).map_err(|_| StoreError::Corrupt),
            None => Ok(None),
        }
    }

    /// Up to `limit` references from `start_seq` on, oldest first: one tenant's, or
    /// (`None`) every tenant's of the region.
    pub async fn page(&self, tenant: Option<&str>, start_seq: u64, limit: usize) -> Result<Page, StoreError> {
        let filter = match tenant {
            Some(t) => format!("deadletter.{}.{t}.*", self.region.as_str()),
            None => format!("deadletter.{}.>", self.region.as_str()),
        };
        let stream = self.js.get_stream(layout::deadletter_stream(self.region)).await.map_err(StoreError::other)?;
        let config = consumer::pull::OrderedConfig {
            filter_subject: filter,
            deliver_policy: consumer::DeliverPolicy::ByStartSequence { start_sequence: start_seq.max(1) },
            ..Default::default()
        };
        let mut consumer = stream.create_consumer(config).await.map_err(StoreError::other)?;
        let pending = consumer.info().await.map_err(StoreError::other)?.num_pending as usize;
        let mut messages = consumer.messages().await.map_err(StoreError::other)?;
        let mut out = Vec::new();
        let mut next = None;
        let mut read = 0;
        while read < pending.min(limit) {
            let Ok(Some(msg)) = tokio::time::timeout(Duration::from_secs(5), messages.next()).await else { break };
            let msg = msg.map_err(StoreError::other)?;
            read += 1;
            let info = msg.info().map_err(StoreError::other)?;
            if let Ok(d) = serde_json::from_slice::<DeadLetter>(&msg.payload) {
                out.push(d);
            }
            if read == limit && info.pending > 0 {
                next = Some(token(info.stream_sequence + 1));
            }
        }
        Ok(Page { dead_letters: out, next })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_a_sequence() {
        assert_eq!(from_token(&token(42)), Some(42));
        assert_eq!(from_token(""), Some(1));
        assert_eq!(from_token("bm9wZQ"), None);
        assert_eq!(from_token("%%%"), None);
    }
}
