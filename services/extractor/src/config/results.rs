//! The results section: what is kept of an answer, where, for how long it is reused,
//! and when the reconciler looks for stranded jobs.

use std::time::Duration;

use crate::env;
use reviewlane_core::config::Reader;

use super::provider::{Price, parse_prices};

/// What is kept of an answer, where, and for how long it is reused.
#[derive(Debug, Clone)]
pub struct ResultSettings {
    /// Reuse validated results of identical reviews (`CACHE_<R>`).
    pub cache: bool,
    /// Results larger than this go to the object store (`None`: the server's limit).
    pub inline_max: Option<usize>,
    /// Raw item kept with a quarantined finding; longer ones are cut.
    pub quarantine_raw_max: usize,
    /// Provider response body read at most; a longer answer is invalid output.
    pub max_response_bytes: usize,
    /// Prices per model class (`REVIEWLANE_MODEL_PRICES`), for the estimated cost of
    /// each job.
    pub prices: std::collections::HashMap<String, Price>,
    /// The reconciler: how often it runs and whom it considers stranded.
    pub reconcile: ReconcileConfig,
}

impl Default for ResultSettings {
    fn default() -> Self {
        ResultSettings {
            cache: true,
            inline_max: None,
            quarantine_raw_max: 4096,
            max_response_bytes: 4 * 1024 * 1024,
            prices: Default::default(),
            reconcile: ReconcileConfig::default(),
        }
    }
}

impl ResultSettings {
    pub(super) fn read(r: &mut Reader<'_>) -> Self {
        let cache = match r.raw(env::RESULT_CACHE).as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(_) => {
                r.error("REVIEWLANE_RESULT_CACHE must be `on` or `off`");
                true
            }
        };
        let prices = match r.raw(env::MODEL_PRICES).map(|t| parse_prices(&t)) {
            None => Default::default(),
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                r.error(format!(
                    "REVIEWLANE_MODEL_PRICES: {e} (expected `model=in/out,...`, dollars per million tokens)"
                ));
                Default::default()
            }
        };
        let reconcile = ReconcileConfig {
            grace: Duration::from_secs(r.or(env::RECONCILE_GRACE_SECS, 120, "whole seconds")),
            ..ReconcileConfig::default()
        };
        ResultSettings { cache, prices, reconcile, ..ResultSettings::default() }
    }
}

/// When the reconciler runs and whom it considers stranded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcileConfig {
    pub every: Duration,
    pub grace: Duration,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        ReconcileConfig { every: Duration::from_secs(30), grace: Duration::from_secs(120) }
    }
}
