//! The region's result cache (KV `CACHE_<R>`, bounded by age): validated results by
//! what makes two reviews the same one — tenant, diff digest, schema, depth, provider,
//! model and prompt version — so an identical review is answered without a call. Per
//! tenant, so no tenant can learn what another submitted. Reads and writes are best
//! effort: a miss costs a call, never a result.

use async_nats::jetstream::kv;

use reviewlane_core::findings::Validated;
use reviewlane_core::job::Tokens;

/// A cached value: the validated result, and the tokens the call that made it cost
/// (absent in entries written before they were recorded).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CacheEntry {
    #[serde(flatten)]
    pub validated: Validated,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Tokens>,
}

/// What makes two reviews the same for the cache.
#[derive(Clone, Copy)]
pub struct CacheKey<'a> {
    pub tenant: &'a str,
    pub input_digest: &'a str,
    pub schema_version: &'a str,
    pub review_depth: &'a str,
    pub provider: &'a str,
    pub model_class: &'a str,
    pub prompt_version: &'a str,
}

impl CacheKey<'_> {
    /// The KV key: a digest of every part (no content, no tenant name in clear).
    pub fn digest(&self) -> String {
        reviewlane_core::job_id::sha256_hex(&[
            self.tenant.as_bytes(),
            self.input_digest.as_bytes(),
            self.schema_version.as_bytes(),
            self.review_depth.as_bytes(),
            self.provider.as_bytes(),
            self.model_class.as_bytes(),
            self.prompt_version.as_bytes(),
        ])
    }
}

#[derive(Clone)]
pub struct ResultCache {
    kv: kv::Store,
}

impl ResultCache {
    pub fn new(kv: kv::Store) -> Self {
        ResultCache { kv }
    }

    /// The cached result for `key`, if there is one (a failed read is a miss).
    pub async fn get(&self, key: &CacheKey<'_>) -> Option<CacheEntry> {
        match self.kv.get(key.digest()).await {
            Ok(Some(v)) => serde_json::from_slice::<CacheEntry>(&v).ok(),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, "result cache read failed");
                None
            }
        }
    }

    /// Caches `entry` for `key` (a failed write costs a later identical review a call).
    pub async fn put(&self, key: &CacheKey<'_>, entry: &CacheEntry) {
        let value = serde_json::to_vec(entry).expect("validated findings serialize");
        if let Err(e) = self.kv.put(key.digest(), value.into()).await {
            tracing::warn!(error = %e, "result cache write failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_of_the_key_makes_another_entry() {
        let base = CacheKey {
            tenant: "acme",
            input_digest: "d",
            schema_version: "findings.v2",
            review_depth: "full",
            provider: "openai",
            model_class: "gpt",
            prompt_version: "prompt.v2",
        };
        let d = base.digest();
        assert_eq!(d, CacheKey { ..base }.digest());
        let base = CacheKey { ..base };
        for other in [
            CacheKey { tenant: "beta", ..base },
            CacheKey { input_digest: "e", ..base },
            CacheKey { schema_version: "findings.v1", ..base },
            CacheKey { review_depth: "changed_hunks", ..base },
            CacheKey { provider: "anthropic", ..base },
            CacheKey { model_class: "claude", ..base },
            CacheKey { prompt_version: "prompt.v3", ..base },
        ] {
            assert_ne!(other.digest(), d);
        }
        assert!(!d.contains("acme"));
    }
}
