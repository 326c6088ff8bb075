//! Listing a KV bucket's keys while they are being written.
//!
//! A listing by consumer (`kv::Store::keys`, or a `LastPerSubject` consumer read up to
//! its pending count) is short when a key is rewritten while it runs: the rewrite takes
//! the key's old entry out of the count at once and adds the new one only later, and a
//! key rewritten after it was delivered comes twice. The stream's subject index has no
//! such gap: `keys` reads it.

use std::collections::BTreeSet;

use async_nats::jetstream::kv;
use futures::TryStreamExt;

use crate::store::StoreError;

/// The keys of `kv` that match `filter` (a key pattern: `status.>`,
/// `item.<sweep id>.*`), sorted, as the stream's subject index holds them now. A
/// deleted key is listed until it is purged.
pub async fn keys(kv: &kv::Store, filter: &str) -> Result<BTreeSet<String>, StoreError> {
    let subjects = format!("{}{filter}", kv.prefix);
    let mut index = kv.stream.info_with_subjects(subjects).await.map_err(StoreError::other)?;
    let mut keys = BTreeSet::new();
    while let Some((subject, _)) = index.try_next().await.map_err(StoreError::other)? {
        if let Some(key) = subject.strip_prefix(kv.prefix.as_str()) {
            keys.insert(key.to_string());
        }
    }
    Ok(keys)
}

/// Whether a KV message marks its key deleted or purged rather than holding a value.
pub fn is_removal(headers: Option<&async_nats::HeaderMap>) -> bool {
    headers.and_then(|h| h.get("KV-Operation")).is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"))
}

#[cfg(test)]
mod tests {
    use super::is_removal;

    #[test]
    fn a_delete_or_purge_marker_is_a_removal_and_a_value_is_not() {
        let marked = |op: &str| {
            let mut h = async_nats::HeaderMap::new();
            h.insert("KV-Operation", op);
            h
        };
        assert!(is_removal(Some(&marked("DEL"))));
        assert!(is_removal(Some(&marked("PURGE"))));
        assert!(!is_removal(Some(&async_nats::HeaderMap::new())));
        assert!(!is_removal(None));
    }
}
