//! Every environment variable the extractor reads: its own names here, the ones it shares
//! with the other services in `reviewlane_core::env`. `all()` is the whole set; a test
//! holds the table for the extractor in `docs/configuration.md` to it, and another that the config reads
//! nothing else.

use std::collections::BTreeSet;

use reviewlane_core::env as common;

pub const PROVIDER: &str = "REVIEWLANE_PROVIDER";
pub const OPENAI_BASE_URL: &str = "REVIEWLANE_OPENAI_BASE_URL";
pub const OPENAI_MODEL: &str = "REVIEWLANE_OPENAI_MODEL";
pub const PROVIDER_REGION: &str = "REVIEWLANE_PROVIDER_REGION";
pub const OPENAI_API_KEY: &str = "REVIEWLANE_OPENAI_API_KEY";
pub const OPENAI_API_KEY_FILE: &str = "REVIEWLANE_OPENAI_API_KEY_FILE";
pub const OPENAI_SCHEMA_DIALECT: &str = "REVIEWLANE_OPENAI_SCHEMA_DIALECT";
pub const ANTHROPIC_BASE_URL: &str = "REVIEWLANE_ANTHROPIC_BASE_URL";
pub const ANTHROPIC_MODEL: &str = "REVIEWLANE_ANTHROPIC_MODEL";
pub const ANTHROPIC_API_KEY: &str = "REVIEWLANE_ANTHROPIC_API_KEY";
pub const ANTHROPIC_API_KEY_FILE: &str = "REVIEWLANE_ANTHROPIC_API_KEY_FILE";
pub const ANTHROPIC_MAX_TOKENS: &str = "REVIEWLANE_ANTHROPIC_MAX_TOKENS";
pub const AZURE_ENDPOINT: &str = "REVIEWLANE_AZURE_ENDPOINT";
pub const AZURE_DEPLOYMENT: &str = "REVIEWLANE_AZURE_DEPLOYMENT";
pub const AZURE_MODEL: &str = "REVIEWLANE_AZURE_MODEL";
pub const AZURE_API_VERSION: &str = "REVIEWLANE_AZURE_API_VERSION";
pub const AZURE_API_KEY: &str = "REVIEWLANE_AZURE_API_KEY";
pub const AZURE_API_KEY_FILE: &str = "REVIEWLANE_AZURE_API_KEY_FILE";
pub const AZURE_TOKEN_FILE: &str = "REVIEWLANE_AZURE_TOKEN_FILE";
pub const AZURE_BATCH_DEPLOYMENT: &str = "REVIEWLANE_AZURE_BATCH_DEPLOYMENT";
pub const DEPLOYMENTS_FILE: &str = "REVIEWLANE_DEPLOYMENTS_FILE";
pub const MODEL_CLASS: &str = "REVIEWLANE_MODEL_CLASS";
pub const KEY_LIMIT: &str = "REVIEWLANE_KEY_LIMIT";
pub const KEY_ID: &str = "REVIEWLANE_KEY_ID";
pub const KEY_BUDGETS: &str = "REVIEWLANE_KEY_BUDGETS";
pub const HEARTBEAT_MS: &str = "REVIEWLANE_HEARTBEAT_MS";
pub const QUOTA_CIRCUIT_SECS: &str = "REVIEWLANE_QUOTA_CIRCUIT_SECS";
pub const INTERACTIVE_WAIT_LIMIT_SECS: &str = "REVIEWLANE_INTERACTIVE_WAIT_LIMIT_SECS";
pub const BATCH_MIN_SLOTS: &str = "REVIEWLANE_BATCH_MIN_SLOTS";
pub const INTERACTIVE_RESERVE_SLOTS: &str = "REVIEWLANE_INTERACTIVE_RESERVE_SLOTS";
pub const CONCURRENCY: &str = "REVIEWLANE_CONCURRENCY";
pub const LEASE_SECS: &str = "REVIEWLANE_LEASE_SECS";
pub const PROVIDER_TIMEOUT_SECS: &str = "REVIEWLANE_PROVIDER_TIMEOUT_SECS";
pub const BUDGET_CONGESTION: &str = "REVIEWLANE_BUDGET_CONGESTION";
pub const BUDGET_TRANSIENT: &str = "REVIEWLANE_BUDGET_TRANSIENT";
pub const BUDGET_SCHEMA: &str = "REVIEWLANE_BUDGET_SCHEMA";
pub const BACKOFF_BASE_MS: &str = "REVIEWLANE_BACKOFF_BASE_MS";
pub const BACKOFF_CAP_SECS: &str = "REVIEWLANE_BACKOFF_CAP_SECS";
pub const HINT_CEILING_SECS: &str = "REVIEWLANE_HINT_CEILING_SECS";
pub const RESULT_CACHE: &str = "REVIEWLANE_RESULT_CACHE";
pub const MODEL_PRICES: &str = "REVIEWLANE_MODEL_PRICES";
pub const RECONCILE_GRACE_SECS: &str = "REVIEWLANE_RECONCILE_GRACE_SECS";
pub const CONTEXT_TOKENS: &str = "REVIEWLANE_CONTEXT_TOKENS";
pub const PART_FILL_PERCENT: &str = "REVIEWLANE_PART_FILL_PERCENT";
pub const BYTES_PER_TOKEN: &str = "REVIEWLANE_BYTES_PER_TOKEN";
pub const TOKENIZER: &str = "REVIEWLANE_TOKENIZER";
pub const MAX_PARTS: &str = "REVIEWLANE_MAX_PARTS";
pub const FINDINGS_CAP: &str = "REVIEWLANE_FINDINGS_CAP";
pub const PROVIDER_BATCH: &str = "REVIEWLANE_PROVIDER_BATCH";

/// Names the extractor read before and no longer does, with where they went.
pub const RETIRED: common::Retired = &[
    ("REVIEWLANE_KEY_RPM", "the key's requests per minute are `rpm=` in REVIEWLANE_KEY_BUDGETS"),
    ("REVIEWLANE_KEY_TPM", "the key's tokens per minute are `tpm=` in REVIEWLANE_KEY_BUDGETS"),
    ("REVIEWLANE_PROBE_EVERY_SECS", "a window probes after 60 s without a 429"),
    ("REVIEWLANE_RECONCILE_EVERY_SECS", "the reconciler runs every 30 s"),
    ("REVIEWLANE_BATCH_BACKOFF_BASE_MS", "the batch lane backs off as REVIEWLANE_BACKOFF_BASE_MS says"),
    ("REVIEWLANE_BATCH_BACKOFF_CAP_SECS", "the batch lane backs off as REVIEWLANE_BACKOFF_CAP_SECS says"),
    ("REVIEWLANE_RESULT_INLINE_MAX_BYTES", "results over the lane streams' message limit go to the object store"),
    ("REVIEWLANE_QUARANTINE_RAW_MAX_BYTES", "4096 bytes of a quarantined item are kept"),
    ("REVIEWLANE_PROVIDER_MAX_RESPONSE_BYTES", "4 MiB of a provider answer are read"),
    ("REVIEWLANE_PART_OVERLAP_LINES", "3 unchanged lines repeat before a cut"),
];

/// The names only the extractor reads.
pub const OWN: &[&str] = &[
    PROVIDER,
    OPENAI_BASE_URL,
    OPENAI_MODEL,
    PROVIDER_REGION,
    OPENAI_API_KEY,
    OPENAI_API_KEY_FILE,
    OPENAI_SCHEMA_DIALECT,
    ANTHROPIC_BASE_URL,
    ANTHROPIC_MODEL,
    ANTHROPIC_API_KEY,
    ANTHROPIC_API_KEY_FILE,
    ANTHROPIC_MAX_TOKENS,
    AZURE_ENDPOINT,
    AZURE_DEPLOYMENT,
    AZURE_MODEL,
    AZURE_API_VERSION,
    AZURE_API_KEY,
    AZURE_API_KEY_FILE,
    AZURE_TOKEN_FILE,
    AZURE_BATCH_DEPLOYMENT,
    DEPLOYMENTS_FILE,
    MODEL_CLASS,
    KEY_LIMIT,
    KEY_ID,
    KEY_BUDGETS,
    HEARTBEAT_MS,
    QUOTA_CIRCUIT_SECS,
    INTERACTIVE_WAIT_LIMIT_SECS,
    BATCH_MIN_SLOTS,
    INTERACTIVE_RESERVE_SLOTS,
    CONCURRENCY,
    LEASE_SECS,
    PROVIDER_TIMEOUT_SECS,
    BUDGET_CONGESTION,
    BUDGET_TRANSIENT,
    BUDGET_SCHEMA,
    BACKOFF_BASE_MS,
    BACKOFF_CAP_SECS,
    HINT_CEILING_SECS,
    RESULT_CACHE,
    MODEL_PRICES,
    RECONCILE_GRACE_SECS,
    CONTEXT_TOKENS,
    PART_FILL_PERCENT,
    BYTES_PER_TOKEN,
    TOKENIZER,
    MAX_PARTS,
    FINDINGS_CAP,
    PROVIDER_BATCH,
];

/// Every name the extractor reads.
pub fn all() -> BTreeSet<String> {
    common::region_service(OWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_doc_lists_exactly_what_extractor_reads() {
        let doc = include_str!("../../../docs/configuration.md");
        let mismatch = reviewlane_core::env_check::doc_mismatch(doc, &["Every service", "Extractor"], &all());
        assert!(mismatch.is_none(), "{}", mismatch.unwrap_or_default());
    }

    #[test]
    fn the_config_reads_only_names_listed_here() {
        // Each provider reads its own settings.
        for provider in ["builtin", "openai", "anthropic", "azure"] {
            let asked = reviewlane_core::env_check::Recording::with(&[(PROVIDER, provider)]);
            let _ = crate::config::ExtractorConfig::from_env(&asked);
            assert!(asked.names().contains(PROVIDER), "the recording saw the config's reads");
            let stray = reviewlane_core::env_check::stray(&asked, all(), RETIRED);
            assert!(stray.is_empty(), "{provider}: read but not in env.rs: {stray:?}");
        }
    }
}
