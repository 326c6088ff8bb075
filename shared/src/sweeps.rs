//! A region's sweeps (`reviewlane_core::sweep`) on KV `SWEEPS_<R>`:
//! `sweep.<tenant>.<id>` holds a sweep's record (so a tenant's sweeps are listed by
//! key), `item.<sweep id>.<job id>` one item of its manifest. A sweep and an
//! item are each created once (KV create: exactly one creator wins, so a page added
//! twice adds nothing twice); a sweep's record changes by compare-and-set. An item's
//! entry keeps its review until it is handed to where it runs, then only its key (a
//! provider batch's item keeps it until it is final: its result is validated against
//! it). Beside them: `batch.<sweep id>.<seq>`, the sweep's provider batches
//! (`reviewlane_core::batch::ChunkRecord`); `capability`, whether this region's
//! extractor runs provider batches (and why not); `coordinator`, which of its replicas
//! drives them.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv};
use futures::StreamExt;
use reviewlane_core::batch::ChunkRecord;
use reviewlane_core::sweep::{ItemEntry, SweepError, SweepEvent, SweepRecord};
use serde::{Deserialize, Serialize};

use crate::kv_listing;
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
}

/// Longest wait for the next entry of a listing.
const LIST_WAIT: Duration = Duration::from_secs(5);

fn sweep_key(tenant: &str, sweep_id: &str) -> String {
    format!("sweep.{tenant}.{sweep_id}")
}

fn item_key(sweep_id: &str, job_id: &str) -> String {
    format!("item.{sweep_id}.{job_id}")
}

fn chunk_key(sweep_id: &str, seq: u32) -> String {
    format!("batch.{sweep_id}.{seq:06}")
}

const CAPABILITY: &str = "capability";
const COORDINATOR: &str = "coordinator";

/// Whether the region's extractor runs sweeps through its provider's batch API, as it
/// announced at start (metadata only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchCapability {
    /// `openai`, `anthropic`, `builtin`.
    pub provider: String,
    pub available: bool,
    /// Why not, when it is not: said to a caller asking for `provider_batch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_not: Option<String>,
    /// The model classes with a batch path: each runs its sweeps through the batch API
    /// of one of its deployments. Empty in an older extractor's announcement, whose
    /// one batch path took every tenant's sweeps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<String>,
    /// The region's class (`REVIEWLANE_MODEL_CLASS`): a tenant naming none uses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region_class: Option<String>,
}

impl BatchCapability {
    /// Whether a batch path runs the sweeps of a tenant whose batch reviews use `class`
    /// (`None`: the region's class).
    pub fn serves(&self, class: Option<&str>) -> bool {
        if !self.available {
            return false;
        }
        match class.or(self.region_class.as_deref()) {
            Some(class) if !self.classes.is_empty() => self.classes.iter().any(|c| c == class),
            _ => true,
        }
    }
}

impl BatchCapability {
    /// Why the sweeps of a tenant whose batch reviews use `class` (`None`: the region's)
    /// cannot run through a batch API: the reason the region's first deployment has none,
    /// for the region's class; else that no deployment of the class has one.
    pub fn why_not_for(&self, class: Option<&str>) -> String {
        let class = class.or(self.region_class.as_deref()).unwrap_or_default();
        match &self.why_not {
            Some(why) if self.region_class.as_deref().is_none_or(|r| r == class) => why.clone(),
            _ => format!(
                "no deployment of model class `{class}` has a batch API this region may use (classes that do: {})",
                if self.classes.is_empty() { "none".to_string() } else { self.classes.join(", ") }
            ),
        }
    }
}

/// The KV key of the lead of one class's provider batches: `coordinator` for the
/// region's class (the key every earlier extractor leads under), `coordinator.<class>`
/// for another (characters a key may not hold become `_`).
pub fn lead_key(class: Option<&str>) -> String {
    match class {
        None => COORDINATOR.to_string(),
        Some(c) => {
            let safe: String = c
                .chars()
                .map(|ch| if ch.is_ascii_alphanumeric() || ch == '-' || ch == '_' { ch } else { '_' })
                .collect();
            format!("{COORDINATOR}.{safe}")
        }
    }
}

/// Which replica drives the region's provider batches, until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Lead {
    owner: String,
    until_ms: u64,
}

impl Sweeps {
    pub fn new(js: jetstream::Context, kv: kv::Store) -> Sweeps {
        Sweeps { kv, js }
    }

    /// Creates the sweep unless its id exists.
    pub async fn create(&self, rec: &SweepRecord) -> Result<Made<SweepRecord>, StoreError> {
        let bytes = serde_json::to_vec(rec).expect("sweep record serializes");
        match self.kv.create(sweep_key(&rec.tenant, &rec.sweep_id), bytes.into()).await {
            Ok(_) => Ok(Made::New(rec.clone())),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                let (existing, _) = self.get(&rec.tenant, &rec.sweep_id).await?.ok_or(StoreError::NotFound)?;
                Ok(Made::Exists(existing))
            }
            Err(e) => Err(StoreError::kv_create(e)),
        }
    }

    /// The tenant's sweep, if it has one of that id.
    pub async fn get(&self, tenant: &str, sweep_id: &str) -> Result<Option<(SweepRecord, u64)>, StoreError> {
        read(&self.kv, &sweep_key(tenant, sweep_id)).await
    }

    /// Every tenant's sweeps (the coordinator's round).
    pub async fn all(&self) -> Result<Vec<SweepRecord>, StoreError> {
        let entries = self.last_of("sweep.>").await?;
        entries
            .into_iter()
            .map(|(payload, _)| serde_json::from_slice(&payload).map_err(|_| StoreError::Corrupt))
            .collect()
    }

    /// The tenant's sweeps, newest first.
    pub async fn list(&self, tenant: &str) -> Result<Vec<SweepRecord>, StoreError> {
        let entries = self.last_of(&format!("sweep.{tenant}.*")).await?;
        let mut out = entries
            .into_iter()
            .map(|(payload, _)| serde_json::from_slice(&payload).map_err(|_| StoreError::Corrupt))
            .collect::<Result<Vec<SweepRecord>, _>>()?;
        out.sort_by(|a, b| b.created_at_ms.cmp(&a.created_at_ms).then_with(|| a.sweep_id.cmp(&b.sweep_id)));
        Ok(out)
    }

    /// Applies `event` by compare-and-set (read again on a conflict); the record as it
    /// then stands. A repeated seal or cancel writes nothing.
    pub async fn apply(
        &self,
        tenant: &str,
        sweep_id: &str,
        event: SweepEvent,
        now_ms: u64,
    ) -> Result<SweepRecord, ApplyError> {
        for _ in 0..8 {
            let (rec, revision) = self.get(tenant, sweep_id).await?.ok_or(StoreError::NotFound)?;
            let Some(next) = rec.after(event, now_ms)? else { return Ok(rec) };
            let bytes = serde_json::to_vec(&next).expect("sweep record serializes");
            match self.kv.update(sweep_key(tenant, sweep_id), bytes.into(), revision).await {
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

    /// Signals that the tenant's sweep record or one of its items may have changed:
    /// core subscriptions on their KV subjects (no consumer), for a watcher that
    /// re-reads what changed.
    pub async fn signals(&self, tenant: &str, sweep_id: &str) -> Result<async_nats::Subscriber, StoreError> {
        let subject = format!("{}{}", self.kv.prefix, sweep_key(tenant, sweep_id));
        self.js.client().subscribe(subject).await.map_err(StoreError::other)
    }

    /// Signals of items added to the sweep: each subject ends in the item's job id.
    pub async fn item_signals(&self, sweep_id: &str) -> Result<async_nats::Subscriber, StoreError> {
        let subject = format!("{}item.{sweep_id}.*", self.kv.prefix);
        self.js.client().subscribe(subject).await.map_err(StoreError::other)
    }

    /// Signals that one of the sweep's provider batches may have changed.
    pub async fn chunk_signals(&self, sweep_id: &str) -> Result<async_nats::Subscriber, StoreError> {
        let subject = format!("{}batch.{sweep_id}.*", self.kv.prefix);
        self.js.client().subscribe(subject).await.map_err(StoreError::other)
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

    /// The job ids of the sweep's items, sorted (its keys from the stream's subject
    /// index: no entry is read).
    pub async fn item_ids(&self, sweep_id: &str) -> Result<Vec<String>, StoreError> {
        let prefix = item_key(sweep_id, "");
        let keys = kv_listing::keys(&self.kv, &format!("{prefix}*")).await?;
        Ok(keys.iter().filter_map(|key| key.strip_prefix(&prefix).map(str::to_string)).collect())
    }

    /// The sweep's items with what their entries hold (their reviews, until handed over).
    pub async fn items(&self, sweep_id: &str) -> Result<Vec<ItemEntry>, StoreError> {
        let entries = self.last_of(&format!("{}*", item_key(sweep_id, ""))).await?;
        let mut items = entries
            .into_iter()
            .map(|(payload, _)| serde_json::from_slice(&payload).map_err(|_| StoreError::Corrupt))
            .collect::<Result<Vec<ItemEntry>, _>>()?;
        // In the order they were added (by the time the ingress took their page, then
        // their place in it), not by when each entry was last written: stripping an
        // item's review rewrites its entry, and must not move it between pages.
        items.sort_by(|a, b| (a.added_at_ms, a.position, &a.job_id).cmp(&(b.added_at_ms, b.position, &b.job_id)));
        Ok(items)
    }

    /// Stores a chunk's record unless its key exists; as it then stands, with its
    /// revision.
    pub async fn create_chunk(&self, chunk: &ChunkRecord) -> Result<(ChunkRecord, u64), StoreError> {
        let key = chunk_key(&chunk.sweep_id, chunk.seq);
        let bytes = serde_json::to_vec(chunk).expect("chunk serializes");
        match self.kv.create(&key, bytes.into()).await {
            Ok(revision) => Ok((chunk.clone(), revision)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                read(&self.kv, &key).await?.ok_or(StoreError::NotFound)
            }
            Err(e) => Err(StoreError::kv_create(e)),
        }
    }

    /// Writes a chunk's next record from the revision read (`Conflict` if anything
    /// wrote in between); the revision written.
    pub async fn update_chunk(&self, chunk: &ChunkRecord, revision: u64) -> Result<u64, StoreError> {
        let bytes = serde_json::to_vec(chunk).expect("chunk serializes");
        self.kv
            .update(chunk_key(&chunk.sweep_id, chunk.seq), bytes.into(), revision)
            .await
            .map_err(StoreError::kv_update)
    }

    /// The sweep's provider batches, by sequence, with their revisions.
    pub async fn chunks(&self, sweep_id: &str) -> Result<Vec<(ChunkRecord, u64)>, StoreError> {
        let mut out = self
            .last_of(&format!("batch.{sweep_id}.*"))
            .await?
            .into_iter()
            .map(|(payload, revision)| {
                serde_json::from_slice(&payload).map(|c| (c, revision)).map_err(|_| StoreError::Corrupt)
            })
            .collect::<Result<Vec<(ChunkRecord, u64)>, _>>()?;
        out.sort_by_key(|(c, _)| c.seq);
        Ok(out)
    }

    /// Keeps what the region's extractor announced of its batch path.
    pub async fn announce(&self, capability: &BatchCapability) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(capability).expect("capability serializes");
        self.kv.put(CAPABILITY, bytes.into()).await.map_err(StoreError::other)?;
        Ok(())
    }

    /// What the region's extractor last announced (`None`: none has started).
    pub async fn capability(&self) -> Result<Option<BatchCapability>, StoreError> {
        Ok(read(&self.kv, CAPABILITY).await?.map(|(c, _)| c))
    }

    /// Takes or keeps the lead of the region's provider batches for `owner` until
    /// `now_ms + ttl_ms`: whether it is `owner`'s (another's lead that has not run out
    /// is left alone). A compare-and-set on the lead as read.
    pub async fn lead(&self, key: &str, owner: &str, now_ms: u64, ttl_ms: u64) -> Result<bool, StoreError> {
        let mine = Lead { owner: owner.to_string(), until_ms: now_ms.saturating_add(ttl_ms) };
        let bytes: bytes::Bytes = serde_json::to_vec(&mine).expect("lead serializes").into();
        let written = match read::<Lead>(&self.kv, key).await {
            Ok(Some((held, _))) if held.owner != owner && held.until_ms > now_ms => return Ok(false),
            Ok(Some((_, revision))) => self.kv.update(key, bytes, revision).await.map_err(StoreError::kv_update),
            Ok(None) | Err(StoreError::Corrupt) => match self.kv.entry(key).await.map_err(StoreError::kv_entry)? {
                Some(entry) => self.kv.update(key, bytes, entry.revision).await.map_err(StoreError::kv_update),
                None => self.kv.create(key, bytes).await.map_err(StoreError::kv_create),
            },
            Err(e) => return Err(e),
        };
        match written {
            Ok(_) => Ok(true),
            Err(StoreError::Conflict) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the lead up (at shutdown), if it is `owner`'s.
    pub async fn resign(&self, key: &str, owner: &str) -> Result<(), StoreError> {
        if let Some((held, revision)) = read::<Lead>(&self.kv, key).await?
            && held.owner == owner
        {
            let gone = Lead { owner: String::new(), until_ms: 0 };
            let bytes = serde_json::to_vec(&gone).expect("lead serializes");
            let _ = self.kv.update(key, bytes.into(), revision).await;
        }
        Ok(())
    }

    /// The last entry of each key that matches `filter` (a key pattern), with its
    /// revision, oldest revision first; a deleted key is left out. Every key the stream
    /// holds when the listing starts, or an error: a listing that stalls is not cut
    /// short (a seal would leave the items past the cut unrun).
    ///
    /// The keys come from the stream's subject index (`kv_listing`), and the consumer
    /// is read until each has been seen, not to its pending count; a key delivered
    /// twice (rewritten meanwhile) keeps its later entry. A key whose entry ages out
    /// before the consumer reaches it is never delivered: after a stall the keys are
    /// listed again, and the listing ends if only such keys were left.
    async fn last_of(&self, filter: &str) -> Result<Vec<(bytes::Bytes, u64)>, StoreError> {
        let mut keys = kv_listing::keys(&self.kv, filter).await?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let config = consumer::pull::OrderedConfig {
            filter_subject: format!("{}{filter}", self.kv.prefix),
            deliver_policy: consumer::DeliverPolicy::LastPerSubject,
            ..Default::default()
        };
        let consumer = self.kv.stream.create_consumer(config).await.map_err(StoreError::other)?;
        let mut messages = consumer.messages().await.map_err(StoreError::other)?;
        // By key: its entry (none: deleted) and revision.
        let mut last: HashMap<String, (Option<bytes::Bytes>, u64)> = HashMap::with_capacity(keys.len());
        let mut unseen = keys.len();
        while unseen > 0 {
            let msg = match tokio::time::timeout(LIST_WAIT, messages.next()).await {
                Ok(Some(msg)) => msg.map_err(StoreError::other)?,
                Ok(None) => return Err(StoreError::other("the listing ended early")),
                Err(_) => {
                    let now = kv_listing::keys(&self.kv, filter).await?;
                    keys.retain(|k| last.contains_key(k) || now.contains(k));
                    if keys.iter().all(|k| last.contains_key(k)) {
                        break;
                    }
                    return Err(StoreError::Timeout("the listing stalled".into()));
                }
            };
            let revision = msg.info().map_err(StoreError::other)?.stream_sequence;
            let entry = (!kv_listing::is_removal(msg.headers.as_ref())).then(|| msg.payload.clone());
            let Some(key) = msg.subject.strip_prefix(self.kv.prefix.as_str()) else { continue };
            match last.entry(key.to_string()) {
                Entry::Occupied(mut seen) => {
                    if revision > seen.get().1 {
                        seen.insert((entry, revision));
                    }
                }
                Entry::Vacant(new) => {
                    if keys.contains(new.key()) {
                        unseen -= 1;
                    }
                    new.insert((entry, revision));
                }
            }
        }
        let mut out: Vec<_> =
            last.into_values().filter_map(|(entry, revision)| entry.map(|payload| (payload, revision))).collect();
        out.sort_unstable_by_key(|e| e.1);
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

#[cfg(test)]
mod tests {
    use super::BatchCapability;

    #[test]
    fn a_sweep_runs_through_a_batch_path_of_its_tenants_class() {
        let of = |classes: &[&str], region: &str| BatchCapability {
            provider: "openai".into(),
            available: !classes.is_empty(),
            why_not: None,
            classes: classes.iter().map(|c| c.to_string()).collect(),
            region_class: Some(region.into()),
        };
        let deep = of(&["deep"], "deep");
        assert!(deep.serves(Some("deep")));
        assert!(deep.serves(None), "a tenant naming no class uses the region's");
        assert!(!deep.serves(Some("fast")));
        // Another class's batch path, the region's class having none.
        let fast_only = of(&["fast"], "deep");
        assert!(fast_only.serves(Some("fast")));
        assert!(!fast_only.serves(None));
        assert!(!of(&[], "deep").serves(None), "no batch path at all");
        assert_eq!(
            fast_only.why_not_for(Some("deep")),
            "no deployment of model class `deep` has a batch API this region may use (classes that do: fast)"
        );
        let why = "the built-in analyzer has no batch API";
        let region_without = BatchCapability { why_not: Some(why.into()), ..fast_only.clone() };
        assert_eq!(region_without.why_not_for(None), why, "the region's class: its first deployment's reason");
        assert_eq!(region_without.why_not_for(Some("deep")), why);
        // An announcement without classes (an older extractor) took every sweep.
        let older: BatchCapability =
            serde_json::from_str(r#"{"provider":"openai","available":true}"#).expect("an older announcement");
        assert!(older.serves(Some("fast")));
    }

    #[test]
    fn each_class_leads_its_batches_under_its_own_key_the_regions_under_the_old_one() {
        use super::lead_key;
        assert_eq!(lead_key(None), "coordinator");
        assert_eq!(lead_key(Some("fast")), "coordinator.fast");
        assert_eq!(lead_key(Some("gpt 4.1")), "coordinator.gpt_4_1");
    }
}
