//! The result cache beside the steps: read while the lease is taken, written when an
//! answer is kept. A hit is a validated result of the same review (tenant, diff,
//! schema, depth, provider, model, prompt version), reused without a call.

use reviewlane_core::findings::Validated;
use reviewlane_shared::result_cache::{CacheEntry, CacheKey};

use super::{Job, Worker};

impl Worker {
    /// What makes this review the same as another for the result cache.
    fn cache_key<'a>(&self, job: &'a Job<'_>) -> CacheKey<'a> {
        let review = job.review;
        CacheKey {
            tenant: &review.tenant,
            input_digest: &review.input_digest,
            schema_version: &review.schema_version,
            review_depth: review.review_depth.as_str(),
            provider: &job.scope.provider,
            model_class: &job.scope.model_class,
            prompt_version: crate::provider::PROMPT_VERSION,
        }
    }

    /// Reads the result cache (`None`: the cache is off). Only a read: what it found
    /// counts once `cached` uses it.
    pub(super) async fn cache_lookup(&self, job: &Job<'_>) -> Option<Option<CacheEntry>> {
        let cache = self.stores.cache.as_ref()?;
        Some(cache.get(&self.cache_key(job)).await)
    }

    /// The result of a cache read, counted as a hit or a miss.
    pub(super) fn cached(&self, job: &Job<'_>, lookup: Option<Option<CacheEntry>>) -> Option<Validated> {
        let hit = lookup?;
        self.metrics.cache(hit.is_some());
        let hit = hit?;
        // The call the hit saves, in the tokens it cost when it was made.
        if let Some(t) = hit.tokens {
            self.metrics.tokens_saved(&job.review.tenant, &job.scope.model_class, t);
        }
        Some(hit.validated)
    }

    /// Writes the result to the cache (best effort).
    pub(super) async fn store_in_cache(
        &self,
        job: &Job<'_>,
        v: &Validated,
        tokens: Option<reviewlane_core::job::Tokens>,
    ) {
        if let Some(cache) = &self.stores.cache {
            cache.put(&self.cache_key(job), &CacheEntry { validated: v.clone(), tokens }).await;
        }
    }
}
