//! What the region's store refused: counted by kind for dashboards and alerts
//! (`reviewlane_store_refusals_total{region, kind}`, every kind at zero from the start),
//! and a full store remembered for readiness — a service whose store said "out of
//! space" within [`FULL_HOLD`] is not ready: the writes it exists to make fail. (The
//! ingress serves both regions: it is unready only while every region's store is full,
//! and answers the full one's callers `UNAVAILABLE`.)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::store::StoreError;
use reviewlane_core::clock::SharedClock;
use reviewlane_core::region::Region;

/// How long after a "full" answer a service stays unready (no later write tells it
/// otherwise sooner: a full store answers every write the same).
pub const FULL_HOLD: Duration = Duration::from_secs(15);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub region: String,
    /// `full`, `unavailable`, `timeout`, `refused`, `too_large`.
    pub kind: String,
}

#[derive(Clone)]
pub struct StoreHealth {
    refusals: Family<RefusalLabels, Counter>,
    /// Per region: when a write was last refused as full (ms on `clock`; 0: never).
    full_at_ms: Arc<Vec<(Region, AtomicU64)>>,
    clock: SharedClock,
}

impl StoreHealth {
    /// Registers the counter, every kind of every region at zero.
    pub fn register(registry: &mut Registry, regions: &[Region], clock: SharedClock) -> StoreHealth {
        let full_at_ms = Arc::new(regions.iter().map(|r| (*r, AtomicU64::new(0))).collect());
        let h = StoreHealth { refusals: Family::default(), full_at_ms, clock };
        registry.register(
            "reviewlane_store_refusals",
            "Writes the region's store refused, by kind (full: out of space)",
            h.refusals.clone(),
        );
        for region in regions {
            for kind in StoreError::REFUSALS {
                let _ = h.refusals.get_or_create(&RefusalLabels { region: region.as_str().into(), kind: kind.into() });
            }
        }
        h
    }

    /// Counts a refused write (kinds that are not refusals — a lost compare-and-set,
    /// an absence — are not counted).
    pub fn refused(&self, region: Region, e: &StoreError) {
        self.refused_kind(region, e.kind());
    }

    pub fn refused_kind(&self, region: Region, kind: &str) {
        if !StoreError::REFUSALS.contains(&kind) {
            return;
        }
        self.refusals.get_or_create(&RefusalLabels { region: region.as_str().into(), kind: kind.into() }).inc();
        if kind == "full"
            && let Some((_, at)) = self.full_at_ms.iter().find(|(r, _)| *r == region)
        {
            at.store(self.clock.now_ms().max(1), Ordering::Relaxed);
        }
    }

    /// Whether `region`'s store has not said "full" within [`FULL_HOLD`].
    pub fn region_ready(&self, region: Region) -> bool {
        let now = self.clock.now_ms();
        self.full_at_ms.iter().filter(|(r, _)| *r == region).all(|(_, at)| {
            let at = at.load(Ordering::Relaxed);
            at == 0 || now >= at + FULL_HOLD.as_millis() as u64
        })
    }

    /// Whether every region's store takes writes (a service of one region).
    pub fn ready(&self) -> bool {
        self.full_at_ms.iter().all(|(r, _)| self.region_ready(*r))
    }

    /// Whether some region's store takes writes (the ingress, which serves both).
    pub fn any_ready(&self) -> bool {
        self.full_at_ms.iter().any(|(r, _)| self.region_ready(*r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reviewlane_core::clock::ManualClock;

    #[test]
    fn a_full_store_makes_the_service_unready_for_a_while_and_every_refusal_counts() {
        let clock = ManualClock::at(1_000);
        let mut registry = Registry::default();
        let h = StoreHealth::register(&mut registry, &[Region::Us], clock.clone());
        let page = || {
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
            out
        };
        assert!(page().contains(r#"reviewlane_store_refusals_total{region="us",kind="full"} 0"#), "{}", page());
        assert!(h.ready());
        h.refused(Region::Us, &StoreError::Conflict);
        h.refused(Region::Us, &StoreError::Timeout(async_nats::Error::from("t")));
        assert!(h.ready(), "an outage or a lost race is not a full store");
        h.refused(Region::Us, &StoreError::Full(async_nats::Error::from("full")));
        assert!(!h.ready());
        clock.advance(FULL_HOLD - Duration::from_millis(1));
        assert!(!h.ready());
        clock.advance(Duration::from_millis(1));
        assert!(h.ready());
        let text = page();
        assert!(text.contains(r#"reviewlane_store_refusals_total{region="us",kind="full"} 1"#), "{text}");
        assert!(text.contains(r#"reviewlane_store_refusals_total{region="us",kind="timeout"} 1"#), "{text}");
        assert!(!text.contains(r#"kind="conflict""#));
    }

    #[test]
    fn the_ingress_stays_ready_while_one_region_takes_writes() {
        let clock = ManualClock::at(1_000);
        let h = StoreHealth::register(&mut Registry::default(), &[Region::Us, Region::Eu], clock.clone());
        h.refused(Region::Eu, &StoreError::Full(async_nats::Error::from("full")));
        assert!(!h.region_ready(Region::Eu) && h.region_ready(Region::Us));
        assert!(h.any_ready() && !h.ready());
        h.refused(Region::Us, &StoreError::Full(async_nats::Error::from("full")));
        assert!(!h.any_ready());
    }
}
