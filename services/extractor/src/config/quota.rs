//! The quota section: the provider key's scope, its fleet window, its budgets and its
//! pauses.

use std::time::Duration;

use crate::env;
use reviewlane_core::config::Reader;

/// The provider key's shared quota: its scope, its fleet window and its pauses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaSettings {
    /// Model class of the quota scope (provider, model class, tenant, region).
    pub model_class: String,
    /// Calls in flight on the provider key (account) across the fleet: the ceiling of
    /// its shared congestion window.
    pub key_limit: u32,
    /// Names the provider key (account) this deployment calls with; deployments that
    /// share a key share its window and pause. Not the key itself.
    pub key_id: String,
    /// Replica heartbeat period in `QUOTA_<R>`.
    pub heartbeat: Duration,
    /// How long a scope's window holds before it probes one call higher.
    pub probe_every: Duration,
    /// How long an `insufficient_quota` answer keeps a scope's circuit open.
    pub circuit_open_for: Duration,
    /// Longest provider retry hint honoured; longer ones are cut to this and counted.
    pub hint_ceiling: Duration,
    /// The key's configured limits per metered dimension (requests, tokens, input and
    /// output tokens per minute, tokens per day); the others are learned from the
    /// answers' headers.
    pub budgets: Vec<(reviewlane_core::meter::Dimension, u64)>,
}

impl QuotaSettings {
    /// Defaults for a deployment calling `model_class`.
    pub fn for_model(model_class: impl Into<String>) -> Self {
        QuotaSettings {
            model_class: model_class.into(),
            key_limit: 8,
            key_id: "default".into(),
            heartbeat: Duration::from_secs(1),
            probe_every: Duration::from_secs(60),
            circuit_open_for: Duration::from_secs(600),
            hint_ceiling: Duration::from_secs(300),
            budgets: Vec::new(),
        }
    }

    pub(super) fn read(r: &mut Reader<'_>, model: &str) -> Self {
        let d = QuotaSettings::for_model(model);
        let q = QuotaSettings {
            model_class: r.or(env::MODEL_CLASS, d.model_class.clone(), "a name"),
            key_limit: r.or(env::KEY_LIMIT, d.key_limit, "a count"),
            key_id: r.or(env::KEY_ID, d.key_id.clone(), "a name"),
            heartbeat: Duration::from_millis(r.or(env::HEARTBEAT_MS, 1000, "milliseconds")),
            circuit_open_for: Duration::from_secs(r.or(env::QUOTA_CIRCUIT_SECS, 600, "whole seconds")),
            hint_ceiling: Duration::from_secs(r.or(env::HINT_CEILING_SECS, 300, "whole seconds")),
            budgets: match reviewlane_core::meter::parse_budgets(&r.raw(env::KEY_BUDGETS).unwrap_or_default()) {
                Ok(b) => b,
                Err(e) => {
                    r.error(format!("{}: {e}", env::KEY_BUDGETS));
                    Vec::new()
                }
            },
            ..d
        };
        if q.heartbeat.is_zero() {
            r.error("REVIEWLANE_HEARTBEAT_MS must be positive");
        }
        q
    }
}
