//! The scheduling section: this process's call slots, its lease, and the lanes' shares.

use std::time::Duration;

use crate::env;
use reviewlane_core::config::Reader;

/// How this process takes work: its call slots, its lease, and the lanes' shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulingSettings {
    /// Provider calls in flight in this process.
    pub concurrency: usize,
    /// The consumer's ack wait; extended by progress acks during a call.
    pub lease: Duration,
    /// One provider call.
    pub provider_timeout: Duration,
    /// Batch stops pulling while interactive work has waited longer than this.
    pub interactive_wait_limit: Duration,
    /// Call slots batch keeps whenever it has work, backlog or not: its aging bound.
    pub batch_min_slots: usize,
    /// Slots batch leaves free for interactive work (`None`: concurrency / 8).
    pub interactive_reserve_slots: Option<usize>,
}

impl Default for SchedulingSettings {
    fn default() -> Self {
        SchedulingSettings {
            concurrency: 8,
            lease: Duration::from_secs(30),
            provider_timeout: Duration::from_secs(120),
            interactive_wait_limit: Duration::from_secs(5),
            batch_min_slots: 1,
            interactive_reserve_slots: None,
        }
    }
}

impl SchedulingSettings {
    pub(super) fn read(r: &mut Reader<'_>) -> Self {
        let d = SchedulingSettings::default();
        let s = SchedulingSettings {
            concurrency: r.or(env::CONCURRENCY, d.concurrency, "a positive count"),
            lease: Duration::from_secs(r.or(env::LEASE_SECS, 30, "whole seconds")),
            provider_timeout: Duration::from_secs(r.or(env::PROVIDER_TIMEOUT_SECS, 120, "whole seconds")),
            interactive_wait_limit: Duration::from_secs(r.or(env::INTERACTIVE_WAIT_LIMIT_SECS, 5, "whole seconds")),
            batch_min_slots: r.or(env::BATCH_MIN_SLOTS, d.batch_min_slots, "a count"),
            interactive_reserve_slots: r
                .raw(env::INTERACTIVE_RESERVE_SLOTS)
                .map(|_| r.or(env::INTERACTIVE_RESERVE_SLOTS, 0, "a count")),
        };
        if s.concurrency == 0 {
            r.error("REVIEWLANE_CONCURRENCY must be positive");
        }
        if s.lease.is_zero() {
            r.error("REVIEWLANE_LEASE_SECS must be positive");
        }
        s
    }
}
