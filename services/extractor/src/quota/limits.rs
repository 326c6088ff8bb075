//! The key's metered limits, per dimension (pure): each is configured, learned from the
//! answers' headers (`x-ratelimit-limit-*`, `anthropic-ratelimit-*-limit`), or both —
//! then the lower wins, so a learned limit is never above a configured one.
//!
//! A learned limit is evidence with an age. The latest report wins at once (a higher
//! limit raises it: a larger tier); one that answers have stopped reporting for
//! [`LAPSE`] lapses, and its bucket stops pacing (the key moved to another tier or
//! endpoint, and nobody enforces it any more). A configured limit never lapses.
//!
//! What remained of each dimension at the last answer is kept too: a 429 without a hint
//! that follows a reading of none left is the one the answers predicted.

use std::collections::BTreeMap;
use std::time::Duration;

use reviewlane_core::meter::{Dimension, Reading};

use super::bucket::capacity;

/// How long answers may go without reporting a learned limit before it lapses.
pub const LAPSE: Duration = Duration::from_secs(600);

/// A limit an answer reported, and when the last one did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Learned {
    limit: u64,
    reported_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    configured: BTreeMap<Dimension, u64>,
    learned: BTreeMap<Dimension, Learned>,
    /// What the last answer reporting it said remained, per dimension; taken by the
    /// 429 it predicts (`predicted`) when it was none.
    remaining: BTreeMap<Dimension, u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits::configured([])
    }
}

/// What an answer changed of the key's limits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Learnt {
    /// A limit was learned, raised or lowered.
    pub changed: bool,
    /// Dimensions left without a limit by a learned one lapsing: they no longer pace.
    pub lapsed: Vec<Dimension>,
}

impl Limits {
    pub fn configured(budgets: impl IntoIterator<Item = (Dimension, u64)>) -> Limits {
        Limits { configured: budgets.into_iter().collect(), learned: BTreeMap::new(), remaining: BTreeMap::new() }
    }

    /// Every dimension with a limit now, and that limit.
    pub fn active(&self) -> Vec<(Dimension, u64)> {
        Dimension::ALL.into_iter().filter_map(|d| Some((d, self.of(d)?))).collect()
    }

    /// The limit of `dim` now, if it has one.
    pub fn of(&self, dim: Dimension) -> Option<u64> {
        capacity(self.configured.get(&dim).copied(), self.learned.get(&dim).map(|l| l.limit))
    }

    /// Learns from an answer at `now_ms`: the limits it reported (the latest report wins),
    /// what remained, and which learned limits lapse because answers stopped reporting
    /// them.
    pub fn learn<'a>(
        &mut self,
        readings: impl IntoIterator<Item = (&'a Dimension, &'a Reading)>,
        now_ms: u64,
    ) -> Learnt {
        let mut out = Learnt::default();
        let mut reported = Vec::new();
        for (dim, reading) in readings {
            if let Some(remaining) = reading.remaining {
                self.remaining.insert(*dim, remaining);
            }
            let Some(limit) = reading.limit.filter(|l| *l > 0) else { continue };
            reported.push(*dim);
            let before = self.learned.insert(*dim, Learned { limit, reported_ms: now_ms });
            out.changed |= before.map(|l| l.limit) != Some(limit);
        }
        let lapse = LAPSE.as_millis() as u64;
        let before: Vec<Dimension> = self.learned.keys().copied().collect();
        self.learned.retain(|dim, l| reported.contains(dim) || now_ms.saturating_sub(l.reported_ms) < lapse);
        out.changed |= self.learned.len() != before.len();
        out.lapsed = before.into_iter().filter(|d| self.of(*d).is_none()).collect();
        for dim in &out.lapsed {
            self.remaining.remove(dim);
        }
        out
    }

    /// Adopts a limit another replica learned (from the fleet's bucket) at `now_ms`,
    /// unless this one already knows one for the dimension.
    pub fn adopt(&mut self, dim: Dimension, limit: u64, now_ms: u64) {
        if limit > 0 && !self.configured.contains_key(&dim) {
            self.learned.entry(dim).or_insert(Learned { limit, reported_ms: now_ms });
        }
    }

    /// The dimension a 429 without a hint was refused for, when the answers predicted
    /// it: the last reading of a limited dimension said none remained. Each such reading
    /// predicts one 429; the next needs a new reading.
    pub fn predicted(&mut self) -> Option<Dimension> {
        let dim = self.remaining.iter().find(|(d, left)| **left == 0 && self.of(**d).is_some()).map(|(d, _)| *d)?;
        self.remaining.remove(&dim);
        Some(dim)
    }

    pub fn is_empty(&self) -> bool {
        self.active().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_000_000;

    fn reading(limit: u64) -> Reading {
        Reading { limit: Some(limit), ..Default::default() }
    }

    #[test]
    fn a_learned_limit_is_raised_at_once_and_lapses_when_answers_stop_reporting_it() {
        let mut l = Limits::configured([(Dimension::Tokens, 40_000)]);
        let taught = BTreeMap::from([(Dimension::Requests, reading(20)), (Dimension::Tokens, reading(48_000))]);
        l.learn(&taught, T0);
        assert_eq!(l.active(), vec![(Dimension::Requests, 20), (Dimension::Tokens, 40_000)]);
        // A larger tier: the higher limit holds from the answer that reports it.
        assert!(l.learn(&BTreeMap::from([(Dimension::Requests, reading(500))]), T0 + 1_000).changed);
        assert_eq!(l.of(Dimension::Requests), Some(500));
        // Answers stop reporting it: it holds for the lapse, then stops pacing.
        let silent = BTreeMap::new();
        let lapse = LAPSE.as_millis() as u64;
        // (The learned tokens limit lapses here; the configured one stays.)
        assert_eq!(l.learn(&silent, T0 + lapse).lapsed, vec![], "reported {} ms ago", lapse - 1_000);
        assert_eq!(l.of(Dimension::Requests), Some(500));
        assert_eq!(l.of(Dimension::Tokens), Some(40_000));
        let learnt = l.learn(&silent, T0 + 1_000 + lapse);
        assert_eq!(learnt, Learnt { changed: true, lapsed: vec![Dimension::Requests] });
        assert_eq!(l.of(Dimension::Requests), None);
        // A configured limit never lapses, even when the headers stop confirming it.
        assert_eq!(l.learn(&silent, T0 + 100 * lapse).lapsed, vec![]);
        assert_eq!(l.active(), vec![(Dimension::Tokens, 40_000)]);
        // Reported again: learned again.
        l.learn(&BTreeMap::from([(Dimension::Requests, reading(20))]), T0 + 200 * lapse);
        assert_eq!(l.of(Dimension::Requests), Some(20));
    }

    #[test]
    fn a_429_is_predicted_once_by_a_reading_of_none_left_on_a_limited_dimension() {
        let none_left = |limit| Reading { limit, remaining: Some(0), reset: None };
        let mut l = Limits::default();
        assert_eq!(l.predicted(), None);
        l.learn(&BTreeMap::from([(Dimension::Requests, none_left(Some(20)))]), T0);
        assert_eq!(l.predicted(), Some(Dimension::Requests));
        assert_eq!(l.predicted(), None, "one reading predicts one 429");
        // Some left: a 429 was not predicted.
        let some_left = Reading { limit: Some(20), remaining: Some(3), reset: None };
        l.learn(&BTreeMap::from([(Dimension::Requests, some_left)]), T0);
        assert_eq!(l.predicted(), None);
        // A dimension without a limit predicts nothing (no bucket to wait on).
        let mut unlimited = Limits::default();
        unlimited.learn(&BTreeMap::from([(Dimension::Tokens, none_left(None))]), T0);
        assert_eq!(unlimited.predicted(), None);
    }

    #[test]
    fn unconfigured_limits_are_learned_and_never_raised_above_a_configured_one() {
        let mut l = Limits::configured([(Dimension::Requests, 20)]);
        assert_eq!(l.active(), vec![(Dimension::Requests, 20)]);
        let answer = BTreeMap::from([(Dimension::Requests, reading(500)), (Dimension::Tokens, reading(48_000))]);
        assert!(l.learn(&answer, T0).changed);
        assert_eq!(l.active(), vec![(Dimension::Requests, 20), (Dimension::Tokens, 48_000)]);
        assert!(!l.learn(&answer, T0).changed, "the same limits again change nothing");
        // The provider lowers the account's tier: its lower limit wins.
        l.learn(&BTreeMap::from([(Dimension::Requests, reading(10))]), T0);
        assert_eq!(l.of(Dimension::Requests), Some(10));
        // A reading without a limit teaches nothing.
        let mut none = Limits::default();
        let left = BTreeMap::from([(Dimension::Tokens, Reading { remaining: Some(5), ..Default::default() })]);
        assert!(!none.learn(&left, T0).changed);
        assert!(none.is_empty());
        // A limit another replica learned is adopted, but never over a configured one.
        none.adopt(Dimension::InputTokens, 40_000, T0);
        let mut cfg = Limits::configured([(Dimension::InputTokens, 30_000)]);
        cfg.adopt(Dimension::InputTokens, 40_000, T0);
        assert_eq!(none.of(Dimension::InputTokens), Some(40_000));
        assert_eq!(cfg.of(Dimension::InputTokens), Some(30_000));
    }
}
