//! The retry section: what a job may retry on each budget, how it backs off, and how a
//! store write after a paid answer is retried.

use std::time::Duration;

use crate::env;
use reviewlane_core::config::Reader;
use reviewlane_shared::store::StoreRetry;

use crate::upstream::Backoff;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    pub congestion: u32,
    pub transient: u32,
    pub schema: u32,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets { congestion: 5, transient: 3, schema: 2 }
    }
}

impl Budgets {
    /// Retries a job may spend on `budget`.
    pub fn of(&self, budget: reviewlane_core::job::Budget) -> u32 {
        use reviewlane_core::job::Budget;
        match budget {
            Budget::Congestion => self.congestion,
            Budget::Transient => self.transient,
            Budget::Schema => self.schema,
        }
    }
}

/// What a job may retry, how it backs off, and how a store write after a paid answer
/// is retried.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RetrySettings {
    pub budgets: Budgets,
    /// Backoff without a provider hint, interactive lane.
    pub backoff: Backoff,
    /// Backoff without a provider hint, batch lane.
    pub batch_backoff: Backoff,
    pub store: StoreRetry,
}

impl RetrySettings {
    pub(super) fn read(r: &mut Reader<'_>) -> Self {
        let d = Budgets::default();
        let budgets = Budgets {
            congestion: r.or(env::BUDGET_CONGESTION, d.congestion, "a count"),
            transient: r.or(env::BUDGET_TRANSIENT, d.transient, "a count"),
            schema: r.or(env::BUDGET_SCHEMA, d.schema, "a count"),
        };
        let backoff = Backoff {
            base: Duration::from_millis(r.or(env::BACKOFF_BASE_MS, 1000, "milliseconds")),
            cap: Duration::from_secs(r.or(env::BACKOFF_CAP_SECS, 60, "whole seconds")),
            ..Backoff::default()
        };
        RetrySettings { budgets, backoff, batch_backoff: backoff, store: StoreRetry::from_reader(r) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_retry_doubles_up_to_its_cap() {
        let r = StoreRetry { tries: 5, base: Duration::from_millis(100), cap: Duration::from_millis(500) };
        let delays: Vec<_> = (1..=5).map(|n| r.delay(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
    }
}
