//! A region's sweeps (`reviewlane_core::sweep`) on KV `SWEEPS_<R>`: `sweep.<id>` holds a
//! sweep's record, `item.<sweep id>.<job id>` one item of its manifest. A sweep and an
//! item are each created once (KV create: exactly one creator wins, so a page added
//! twice adds nothing twice); a sweep's record changes by compare-and-set. An item's
//! entry keeps its review until it is handed to where it runs, then only its key.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv};
use futures::StreamExt;
use reviewlane_core::region::Region;
use reviewlane_core::sweep::{ItemEntry, SweepError, SweepEvent, SweepRecord};

use crate::layout;
use crate::store::StoreError;

/// How a create came out.
#[derive(Debug)]
pub enum Made<T> {
    New(T),
    /// Already there: as it is.
    Exists(T),
}

#[derive(Clone)]
pub struct Sweeps {
    kv: kv::Store,
    js: jetstream::Context,
    region: Region,
}

/// Longest wait for the next entry of a listing.
const LIST_WAIT: Duration = Duration::from_secs(5);

fn sweep_key(sweep_id: &str) -> String {
    format!("sweep.{sweep_id}")
}

fn item_key(sweep_id: &str, job_id: &str) -> String {
    format!("item.{sweep_id}.{job_id}")
}

impl Sweeps {
    pub fn new(js: jetstream::Context, kv: kv::Store, region: Region) -> Sweeps {
        Sweeps { kv, js, region }
    }

    /// Creates the sweep unless its id exists.
    pub async fn create(&self, rec: &SweepRecord) -> Result<Made<SweepRecord>, StoreError> {
        let bytes = serde_json::to_vec(rec).expect("sweep record serializes");
        match self.kv.create(sweep_key(&rec.sweep_id), bytes.into()).await {
            Ok(_) => Ok(Made::New(rec.clone())),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                let (existing, _) = self.get(&rec.sweep_id).await?.ok_or(StoreError::NotFound)?;
                Ok(Made::Exists(existing))
            }
            Err(e) => Err(StoreError::kv_create(e)),
        }
    }

    pub async fn get(&self, sweep_id: &str) -> Result<Option<(SweepRecord, u64)>, StoreError> {
        read(&self.kv, &sweep_key(sweep_id)).await
    }

    /// Applies `event` by compare-and-set (read again on a conflict); the record as it
    /// then stands. A repeated seal or cancel writes nothing.
    pub async fn apply(&self, sweep_id: &str, event: SweepEvent, now_ms: u64) -> Result<SweepRecord, ApplyError> {
        for _ in 0..8 {
            let (rec, revision) = self.get(sweep_id).await?.ok_or(StoreError::NotFound)?;
            let Some(next) = rec.after(event, now_ms)? else { return Ok(rec) };
            let bytes = serde_json::to_vec(&next).expect("sweep record serializes");
            match self.kv.update(sweep_key(sweep_id), bytes.into(), revision).await {
                Ok(_) => return Ok(next),
                Err(e) => match StoreError::kv_update(e) {
                    StoreError::Conflict => continue,
                    other => return Err(other.into()),
                },
            }
        }
        Err(StoreError::Conflict.into())
    }

    /// Adds an item unless its job id is in the manifest already.
    pub async fn add_item(&self, sweep_id: &str, item: &ItemEntry) -> Result<Made<ItemEntry>, StoreError> {
        let key = item_key(sweep_id, &item.job_id);
        let bytes = serde_json::to_vec(item).expect("item serializes");
        match self.kv.create(&key, bytes.into()).await {
            Ok(_) => Ok(Made::New(item.clone())),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                let (existing, _) = read(&self.kv, &key).await?.ok_or(StoreError::NotFound)?;
                Ok(Made::Exists(existing))
            }
            Err(e) => Err(StoreError::kv_create(e)),
        }
    }

    /// One item of the manifest, if the sweep has it.
    pub async fn item(&self, sweep_id: &str, job_id: &str) -> Result<Option<ItemEntry>, StoreError> {
        Ok(read(&self.kv, &item_key(sweep_id, job_id)).await?.map(|(item, _)| item))
    }

    /// Keeps only the item's key and digest: its review was handed over.
    pub async fn strip_item(&self, sweep_id: &str, item: &ItemEntry) -> Result<(), StoreError> {
        let stripped = ItemEntry { review: None, ..item.clone() };
        let bytes = serde_json::to_vec(&stripped).expect("item serializes");
        self.kv.put(item_key(sweep_id, &item.job_id), bytes.into()).await.map_err(StoreError::other)?;
        Ok(())
    }

    /// The job ids of the sweep's items, in the order they were added (headers only:
    /// no review is read), at most `limit`.
    pub async fn item_ids(&self, sweep_id: &str, limit: usize) -> Result<Vec<String>, StoreError> {
        let prefix = format!("$KV.{}.item.{sweep_id}.", layout::sweeps_bucket(self.region));
        let entries = self.list(sweep_id, true, limit).await?;
        Ok(entries.into_iter().filter_map(|(subject, _)| subject.strip_prefix(&prefix).map(str::to_string)).collect())
    }

    /// The sweep's items with what their entries hold (their reviews, until handed over).
    pub async fn items(&self, sweep_id: &str, limit: usize) -> Result<Vec<ItemEntry>, StoreError> {
        let entries = self.list(sweep_id, false, limit).await?;
        entries
            .into_iter()
            .map(|(_, payload)| serde_json::from_slice(&payload).map_err(|_| StoreError::Corrupt))
            .collect()
    }

    /// The last entry of each item key of the sweep: (subject, payload).
    async fn list(
        &self,
        sweep_id: &str,
        headers_only: bool,
        limit: usize,
    ) -> Result<Vec<(String, bytes::Bytes)>, StoreError> {
        let bucket = layout::sweeps_bucket(self.region);
        let stream = self.js.get_stream(format!("KV_{bucket}")).await.map_err(StoreError::other)?;
        let config = consumer::pull::OrderedConfig {
            filter_subject: format!("$KV.{bucket}.item.{sweep_id}.*"),
            deliver_policy: consumer::DeliverPolicy::LastPerSubject,
            headers_only,
            ..Default::default()
        };
        let mut consumer = stream.create_consumer(config).await.map_err(StoreError::other)?;
        let pending = consumer.info().await.map_err(StoreError::other)?.num_pending as usize;
        let mut messages = consumer.messages().await.map_err(StoreError::other)?;
        let mut out = Vec::with_capacity(pending.min(limit));
        while out.len() < pending.min(limit) {
            let Ok(Some(msg)) = tokio::time::timeout(LIST_WAIT, messages.next()).await else { break };
            let msg = msg.map_err(StoreError::other)?;
            out.push((msg.subject.to_string(), msg.payload.clone()));
        }
        Ok(out)
    }
}

/// A sweep event refused, or the store failing.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Refused(#[from] SweepError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

async fn read<T: serde::de::DeserializeOwned>(kv: &kv::Store, key: &str) -> Result<Option<(T, u64)>, StoreError> {
    let Some(entry) = kv.entry(key).await.map_err(StoreError::kv_entry)? else {
        return Ok(None);
    };
    if entry.operation != kv::Operation::Put {
        return Ok(None);
    }
    let value = serde_json::from_slice(&entry.value).map_err(|_| StoreError::Corrupt)?;
    Ok(Some((value, entry.revision)))
}
