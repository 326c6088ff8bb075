//! The job index: a tenant's reviews in a region, newest first, without reading every
//! job record.
//!
//! Each job has one entry on `INDEX_<R>`, subject `index.<r>.<tenant>.<hour>` (hours
//! since the Unix epoch of its creation), `Nats-Msg-Id` = job id. An entry holds what
//! listing filters on that never changes — job id, creation time, lane, and a digest of
//! the repository (no content) — so a page reads: the tenant's hours that have entries
//! (one stream-info request), the entries of the newest hours down to the page's size,
//! and the records of the entries that pass (for their state, which changes). The page
//! token is the position of the last entry returned, with a digest of the filter it was
//! made for.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use base64::Engine as _;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use crate::job_store::JobStore;
use crate::layout;
use crate::store::StoreError;
use reviewlane_core::job::{JobRecord, JobState};
use reviewlane_core::region::{Lane, Region};

const HOUR_MS: u64 = 3_600_000;
/// Entries looked at for one page at most: a page may come back short (with a token)
/// rather than one request reading without bound.
pub const MAX_SCANNED: usize = 5_000;

/// One job's index entry. No content: the repository only as a digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub job_id: String,
    pub created_at_ms: u64,
    pub lane: Lane,
    /// `repository_digest(tenant, repository)`; empty when the review named none.
    #[serde(default)]
    pub repository: String,
}

/// Digest of a repository name as the index keeps it (per tenant, so equal names of two
/// tenants do not match across them).
pub fn repository_digest(tenant: &str, repository: &str) -> String {
    if repository.is_empty() {
        return String::new();
    }
    let mut d = reviewlane_core::job_id::sha256_hex(&[b"repository", tenant.as_bytes(), repository.as_bytes()]);
    d.truncate(32);
    d
}

/// What a listing asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    /// Any of these states (empty: all).
    pub states: Vec<JobState>,
    pub lane: Option<Lane>,
    /// `repository_digest` of the repository (none: all).
    pub repository: Option<String>,
    /// Created at or after / before (milliseconds since the epoch).
    pub created_after_ms: Option<u64>,
    pub created_before_ms: Option<u64>,
}

impl Query {
    /// Whether an entry passes the filters the index can decide.
    pub fn admits(&self, e: &Entry) -> bool {
        self.lane.is_none_or(|l| l == e.lane)
            && self.repository.as_ref().is_none_or(|r| *r == e.repository)
            && self.created_after_ms.is_none_or(|t| e.created_at_ms >= t)
            && self.created_before_ms.is_none_or(|t| e.created_at_ms < t)
    }

    /// Digest of the filter, carried in page tokens: a token is good only for the query
    /// it was made for.
    pub fn digest(&self) -> String {
        let states: Vec<&str> = self.states.iter().map(|s| s.as_str()).collect();
        let text = format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}",
            states,
            self.lane.map(|l| l.as_str()),
            self.repository,
            self.created_after_ms,
            self.created_before_ms
        );
        let mut d = reviewlane_core::job_id::sha256_hex(&[text.as_bytes()]);
        d.truncate(16);
        d
    }
}

/// Where the next page starts: after the entry at `seq` of hour `hour` (exclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub hour: u64,
    pub seq: u64,
}

#[derive(Serialize, Deserialize)]
struct Token {
    h: u64,
    s: u64,
    f: String,
}

/// Why a page token is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("page_token is not one this service issued")]
    Malformed,
    #[error("page_token was issued for other filters; list again without it")]
    OtherQuery,
}

impl Cursor {
    /// An opaque page token for `query`.
    pub fn token(&self, query: &Query) -> String {
        let t = Token { h: self.hour, s: self.seq, f: query.digest() };
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(serde_json::to_vec(&t).expect("token serializes"))
    }

    /// The cursor of a token made for `query` (`""`: the first page).
    pub fn from_token(token: &str, query: &Query) -> Result<Option<Cursor>, TokenError> {
        if token.is_empty() {
            return Ok(None);
        }
        let bytes =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token).map_err(|_| TokenError::Malformed)?;
        let t: Token = serde_json::from_slice(&bytes).map_err(|_| TokenError::Malformed)?;
        if t.f != query.digest() {
            return Err(TokenError::OtherQuery);
        }
        Ok(Some(Cursor { hour: t.h, seq: t.s }))
    }
}

/// One page: the records, and where the next page starts (none: this was the last).
pub struct Page {
    pub records: Vec<JobRecord>,
    pub next: Option<Cursor>,
}

#[derive(Clone)]
pub struct JobIndex {
    js: jetstream::Context,
    region: Region,
}

impl JobIndex {
    pub fn new(js: jetstream::Context, region: Region) -> Self {
        JobIndex { js, region }
    }

    /// Adds a job's entry (idempotent within the stream's duplicate window; a later
    /// repeat is dropped when listing).
    pub async fn add(&self, rec: &JobRecord, repository: &str) -> Result<(), StoreError> {
        let entry = Entry {
            job_id: rec.job_id.clone(),
            created_at_ms: rec.created_at_ms,
            lane: rec.lane,
            repository: repository_digest(&rec.tenant, repository),
        };
        let subject = layout::index_subject(self.region, &rec.tenant, rec.created_at_ms / HOUR_MS);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, rec.job_id.as_str());
        let body = serde_json::to_vec(&entry).expect("index entry serializes");
        self.js
            .publish_with_headers(subject, headers, body.into())
            .await
            .map_err(StoreError::publish)?
            .await
            .map_err(StoreError::publish)?;
        Ok(())
    }

    async fn stream(&self) -> Result<stream::Stream, StoreError> {
        self.js.get_stream(layout::index_stream(self.region)).await.map_err(StoreError::other)
    }

    /// The hours of `tenant` that have entries, newest first, with their entry counts.
    async fn hours(&self, tenant: &str) -> Result<Vec<(u64, usize)>, StoreError> {
        let prefix = format!("index.{}.{}.", self.region.as_str(), tenant);
        let stream = self.stream().await?;
        let mut info = stream.info_with_subjects(format!("{prefix}*")).await.map_err(StoreError::other)?;
        let mut hours = Vec::new();
        while let Some((subject, count)) = info.try_next().await.map_err(StoreError::other)? {
            if let Some(h) = subject.strip_prefix(&prefix).and_then(|h| h.parse::<u64>().ok()) {
                hours.push((h, count));
            }
        }
        hours.sort_unstable_by_key(|h| std::cmp::Reverse(h.0));
        Ok(hours)
    }

    /// The entries of one hour with their stream sequences, newest first.
    async fn hour_entries(&self, tenant: &str, hour: u64, count: usize) -> Result<Vec<(u64, Entry)>, StoreError> {
        let stream = self.stream().await?;
        let config = consumer::pull::OrderedConfig {
            filter_subject: layout::index_subject(self.region, tenant, hour),
            ..Default::default()
        };
        let consumer = stream.create_consumer(config).await.map_err(StoreError::other)?;
        let mut messages = consumer.messages().await.map_err(StoreError::other)?;
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            let next = tokio::time::timeout(Duration::from_secs(5), messages.next()).await;
            let Ok(Some(msg)) = next else { break };
            let msg = msg.map_err(StoreError::other)?;
            let seq = msg.info().map(|i| i.stream_sequence).map_err(StoreError::other)?;
            if let Ok(e) = serde_json::from_slice::<Entry>(&msg.payload) {
                out.push((seq, e));
            }
        }
        out.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        Ok(out)
    }

    /// Up to `limit` of `tenant`'s records that pass `query`, newest first, after
    /// `cursor`.
    pub async fn page(
        &self,
        jobs: &JobStore,
        tenant: &str,
        query: &Query,
        cursor: Option<Cursor>,
        limit: usize,
    ) -> Result<Page, StoreError> {
        let after_hour = query.created_after_ms.map(|t| t / HOUR_MS);
        let before_hour = query.created_before_ms.map(|t| t.saturating_sub(1) / HOUR_MS);
        let mut records = Vec::new();
        let mut seen = HashSet::new();
        let mut scanned = 0;
        for (hour, count) in self.hours(tenant).await? {
            if cursor.is_some_and(|c| hour > c.hour)
                || before_hour.is_some_and(|b| hour > b)
                || after_hour.is_some_and(|a| hour < a)
            {
                continue;
            }
            for (seq, entry) in self.hour_entries(tenant, hour, count).await? {
                if cursor.is_some_and(|c| hour == c.hour && seq >= c.seq) {
                    continue;
                }
                scanned += 1;
                if query.admits(&entry) && seen.insert(entry.job_id.clone()) {
                    let rec = jobs.get(&entry.job_id).await?.map(|(r, _)| r);
                    // A record gone (retention) is left out; so is another tenant's.
                    if let Some(rec) = rec.filter(|r| r.tenant == tenant)
                        && (query.states.is_empty() || query.states.contains(&rec.state))
                    {
                        records.push(rec);
                    }
                }
                if records.len() == limit || scanned >= MAX_SCANNED {
                    return Ok(Page { records, next: Some(Cursor { hour, seq }) });
                }
            }
        }
        Ok(Page { records, next: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_only_for_their_query() {
        let q = Query { lane: Some(Lane::Batch), ..Default::default() };
        let c = Cursor { hour: 493_000, seq: 42 };
        let t = c.token(&q);
        assert_eq!(Cursor::from_token(&t, &q), Ok(Some(c)));
        assert_eq!(Cursor::from_token("", &q), Ok(None));
        let other = Query { lane: Some(Lane::Interactive), ..Default::default() };
        assert_eq!(Cursor::from_token(&t, &other), Err(TokenError::OtherQuery));
        assert_eq!(Cursor::from_token("not a token", &q), Err(TokenError::Malformed));
    }

    #[test]
    fn the_index_filters_by_lane_repository_and_time() {
        let e = Entry {
            job_id: "us_1".into(),
            created_at_ms: 1_000,
            lane: Lane::Batch,
            repository: repository_digest("acme", "acme/app"),
        };
        assert!(Query::default().admits(&e));
        assert!(!Query { lane: Some(Lane::Interactive), ..Default::default() }.admits(&e));
        let repo = |r: &str| Query { repository: Some(repository_digest("acme", r)), ..Default::default() };
        assert!(repo("acme/app").admits(&e));
        assert!(!repo("acme/other").admits(&e));
        assert_ne!(repository_digest("acme", "x"), repository_digest("beta", "x"));
        assert!(
            Query { created_after_ms: Some(1_000), created_before_ms: Some(1_001), ..Default::default() }.admits(&e)
        );
        assert!(!Query { created_before_ms: Some(1_000), ..Default::default() }.admits(&e));
    }
}
