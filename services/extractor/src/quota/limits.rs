//! The key's metered limits, per dimension (pure): each is configured, learned from the
//! answers' headers (`x-ratelimit-limit-*`, `anthropic-ratelimit-*-limit`), or both —
//! then the lower wins, so a learned limit is never above a configured one.

use std::collections::BTreeMap;

use reviewlane_core::meter::{Dimension, Reading};

use super::bucket::capacity;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    configured: BTreeMap<Dimension, u64>,
    learned: BTreeMap<Dimension, u64>,
}

impl Limits {
    pub fn configured(budgets: impl IntoIterator<Item = (Dimension, u64)>) -> Limits {
        Limits { configured: budgets.into_iter().collect(), learned: BTreeMap::new() }
    }

    /// Every dimension with a limit now, and that limit.
    pub fn active(&self) -> Vec<(Dimension, u64)> {
        Dimension::ALL
            .into_iter()
            .filter_map(|d| Some((d, capacity(self.configured.get(&d).copied(), self.learned.get(&d).copied())?)))
            .collect()
    }

    /// The limit of `dim` now, if it has one.
    pub fn of(&self, dim: Dimension) -> Option<u64> {
        capacity(self.configured.get(&dim).copied(), self.learned.get(&dim).copied())
    }

    /// Learns the limits an answer reported; whether any changed.
    pub fn learn<'a>(&mut self, readings: impl IntoIterator<Item = (&'a Dimension, &'a Reading)>) -> bool {
        let mut changed = false;
        for (dim, reading) in readings {
            let Some(limit) = reading.limit.filter(|l| *l > 0) else { continue };
            changed |= self.learned.insert(*dim, limit) != Some(limit);
        }
        changed
    }

    /// Adopts a limit another replica learned (from the fleet's bucket), unless this one
    /// already knows one for the dimension.
    pub fn adopt(&mut self, dim: Dimension, limit: u64) {
        if limit > 0 && !self.configured.contains_key(&dim) {
            self.learned.entry(dim).or_insert(limit);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.active().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(limit: u64) -> Reading {
        Reading { limit: Some(limit), ..Default::default() }
    }

    #[test]
    fn unconfigured_limits_are_learned_and_never_raised_above_a_configured_one() {
        let mut l = Limits::configured([(Dimension::Requests, 20)]);
        assert_eq!(l.active(), vec![(Dimension::Requests, 20)]);
        let answer = BTreeMap::from([(Dimension::Requests, reading(500)), (Dimension::Tokens, reading(48_000))]);
        assert!(l.learn(&answer));
        assert_eq!(l.active(), vec![(Dimension::Requests, 20), (Dimension::Tokens, 48_000)]);
        assert!(!l.learn(&answer), "the same limits again change nothing");
        // The provider lowers the account's tier: its lower limit wins.
        l.learn(&BTreeMap::from([(Dimension::Requests, reading(10))]));
        assert_eq!(l.of(Dimension::Requests), Some(10));
        // A reading without a limit teaches nothing.
        let mut none = Limits::default();
        assert!(
            !none.learn(&BTreeMap::from([(Dimension::Tokens, Reading { remaining: Some(5), ..Default::default() })]))
        );
        assert!(none.is_empty());
        // A limit another replica learned is adopted, but never over a configured one.
        none.adopt(Dimension::InputTokens, 40_000);
        let mut cfg = Limits::configured([(Dimension::InputTokens, 30_000)]);
        cfg.adopt(Dimension::InputTokens, 40_000);
        assert_eq!(none.of(Dimension::InputTokens), Some(40_000));
        assert_eq!(cfg.of(Dimension::InputTokens), Some(30_000));
    }
}
