//! One metered dimension of a provider key (requests, tokens, input or output tokens
//! per minute, tokens per day) as a token bucket, the way the providers meter: a full
//! bucket holds the limit and refills at the limit per period. Pure: the time is given,
//! in milliseconds.
//!
//! Two ways of refilling, learned from the answers:
//! - continuous (OpenAI, Anthropic: their readings say when the dimension is full again);
//! - all at once at the end of a fixed window, when the readings give the limit and what
//!   remains but never a reset (a gateway such as LiteLLM's proxy counts per minute and
//!   starts again from zero). Until the window's end is seen, the bucket assumes the
//!   latest end possible: the window that held an answer ends at most a period after it.
//!   A reading that shows much more left than the bucket holds is a window that started
//!   earlier than assumed: it is taken, and its end moved accordingly.
//!
//! A call reserves its cost before it starts, only when the whole cost fits; otherwise
//! it is told exactly how long until it does, and nothing is taken. When the answer
//! says what was used, the reservation is corrected. The provider's own readings
//! (`reviewlane_core::meter`) only ever lower the level: a provider that reports less
//! than the bucket holds wins, so a second deployment on the same account, or traffic
//! outside reviewlane, is absorbed within one answer.

use std::time::Duration;

use reviewlane_core::meter::Reading;
use serde::{Deserialize, Serialize};

/// The providers' metering window.
pub const WINDOW_MS: u64 = 60_000;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    /// The limit per period: what a full bucket holds.
    pub capacity: u64,
    /// The period it refills over (a minute; a day for tokens per day).
    #[serde(default = "minute")]
    pub period_ms: u64,
    /// What it held at `at_ms`. Below zero when answers used more than was reserved.
    pub level: f64,
    pub at_ms: u64,
    /// A fixed window's end: the bucket is full again at this time (and every period
    /// after), not before. `None`: it refills continuously.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refills_at_ms: Option<u64>,
}

fn minute() -> u64 {
    WINDOW_MS
}

/// Why a reservation was not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The cost fits after this long (nothing was taken).
    Wait(Duration),
    /// The cost is more than the bucket ever holds: the call can never run.
    TooLarge { capacity: u64 },
}

/// The limit to meter by: the configured one, or the one the provider reported, never
/// above a configured value.
pub fn capacity(configured: Option<u64>, reported: Option<u64>) -> Option<u64> {
    match (configured, reported) {
        (Some(c), Some(r)) => Some(c.min(r)),
        (c, r) => c.or(r),
    }
    .filter(|c| *c > 0)
}

impl Bucket {
    /// A full bucket of `capacity` a minute at `now_ms`.
    pub fn full(capacity: u64, now_ms: u64) -> Bucket {
        Bucket::full_over(capacity, WINDOW_MS, now_ms)
    }

    /// A full bucket of `capacity` per `period_ms` at `now_ms`.
    pub fn full_over(capacity: u64, period_ms: u64, now_ms: u64) -> Bucket {
        Bucket { capacity, period_ms: period_ms.max(1), level: capacity as f64, at_ms: now_ms, refills_at_ms: None }
    }

    fn per_ms(&self) -> f64 {
        self.capacity as f64 / self.period_ms.max(1) as f64
    }

    /// What the bucket holds at `now_ms` (a time before the last change counts as it).
    pub fn level_at(&self, now_ms: u64) -> f64 {
        match self.refills_at_ms {
            Some(end) if now_ms >= end => self.capacity as f64,
            Some(_) => self.level.min(self.capacity as f64),
            None => {
                let elapsed = now_ms.saturating_sub(self.at_ms) as f64;
                (self.level + elapsed * self.per_ms()).min(self.capacity as f64)
            }
        }
    }

    /// Whether it refills all at once at the end of a fixed window.
    pub fn refills_by_window(&self) -> bool {
        self.refills_at_ms.is_some()
    }

    fn catch_up(&mut self, now_ms: u64) {
        self.level = self.level_at(now_ms);
        self.at_ms = self.at_ms.max(now_ms);
        if let Some(end) = self.refills_at_ms.filter(|end| now_ms >= *end) {
            // The next window's end, the first after now.
            let periods = (now_ms - end) / self.period_ms + 1;
            self.refills_at_ms = Some(end + periods * self.period_ms);
        }
    }

    /// How long until `short` more is there.
    fn wait_for(&self, short: f64, now_ms: u64) -> Duration {
        let ms = match self.refills_at_ms {
            Some(end) => end.saturating_sub(now_ms),
            None => (short / self.per_ms()).ceil() as u64,
        };
        Duration::from_millis(ms.max(1))
    }

    /// Takes `cost` at `now_ms` if all of it is there; otherwise says how long until it
    /// is, taking nothing.
    pub fn reserve(&mut self, cost: u64, now_ms: u64) -> Result<(), Refused> {
        if cost > self.capacity {
            return Err(Refused::TooLarge { capacity: self.capacity });
        }
        let level = self.level_at(now_ms);
        let short = cost as f64 - level;
        if short > 0.0 {
            return Err(Refused::Wait(self.wait_for(short, now_ms)));
        }
        self.catch_up(now_ms);
        self.level -= cost as f64;
        Ok(())
    }

    /// Corrects a reservation of `reserved` to what the answer `used`: the difference
    /// is given back, or taken (the level may go below zero: later calls wait it out).
    pub fn correct(&mut self, reserved: u64, used: u64, now_ms: u64) {
        self.catch_up(now_ms);
        self.level = (self.level + reserved as f64 - used as f64).min(self.capacity as f64);
    }

    /// Takes back `units` handed back at `now_ms` (what a slice left; negative: what it
    /// owed), up to the capacity.
    pub fn give(&mut self, units: f64, now_ms: u64) {
        self.catch_up(now_ms);
        self.level = (self.level + units).min(self.capacity as f64);
    }

    /// Follows what the provider reported at `now_ms`. What remains is at most what it
    /// says; a reset says the bucket is full only then, so it holds at most what our
    /// refill would bring to full by that time. Either only lowers the level.
    ///
    /// A reading that gives the limit and what remains but no reset is a fixed window
    /// (see the module's header): from then on the bucket refills at the window's end.
    /// The one reading that raises the level is one of a fixed window showing far more
    /// left than the bucket holds: the window started again earlier than assumed.
    pub fn follow(&mut self, reading: &Reading, now_ms: u64) {
        self.catch_up(now_ms);
        let latest_end = now_ms + self.period_ms;
        match (reading.reset, reading.limit, reading.remaining) {
            (Some(_), _, _) => self.refills_at_ms = None,
            (None, Some(_), Some(_)) if self.refills_at_ms.is_none() => self.refills_at_ms = Some(latest_end),
            // Much more left than the bucket holds: the window started again earlier than
            // assumed. (A little more is calls reserved that the provider has not counted
            // yet.)
            (None, _, Some(remaining))
                if self.refills_at_ms.is_some() && remaining as f64 > self.level + self.capacity as f64 / 2.0 =>
            {
                self.level = (remaining as f64).min(self.capacity as f64);
                self.refills_at_ms = Some(latest_end);
                return;
            }
            _ => {}
        }
        if let Some(remaining) = reading.remaining {
            self.level = self.level.min(remaining as f64);
        }
        if let Some(reset) = reading.reset {
            let by_reset = self.capacity as f64 - reset.as_millis() as f64 * self.per_ms();
            self.level = self.level.min(by_reset.max(0.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_000_000;

    #[test]
    fn a_full_bucket_refills_continuously_at_its_limit_per_minute() {
        let mut b = Bucket::full(48_000, T0);
        assert_eq!(b.reserve(48_000, T0), Ok(()));
        // 800 tokens a second: after 1.5 s, 1,200 are back.
        assert!((b.level_at(T0 + 1_500) - 1_200.0).abs() < 1e-6);
        // Never above what a full bucket holds.
        assert_eq!(b.level_at(T0 + 10 * WINDOW_MS), 48_000.0);
    }

    #[test]
    fn a_cost_that_does_not_fit_waits_exactly_until_it_does_and_takes_nothing() {
        let mut b = Bucket::full(48_000, T0);
        b.reserve(45_000, T0).unwrap();
        // 3,000 left; 4,300 more needs 1,300 at 0.8 a millisecond: 1,625 ms.
        assert_eq!(b.reserve(4_300, T0), Err(Refused::Wait(Duration::from_millis(1_625))));
        assert_eq!(b.level_at(T0), 3_000.0, "a refused reservation takes nothing");
        assert_eq!(b.reserve(4_300, T0 + 1_624).map_err(|_| ()), Err(()));
        assert_eq!(b.reserve(4_300, T0 + 1_625), Ok(()));
    }

    #[test]
    fn a_daily_bucket_refills_over_a_day() {
        let mut b = Bucket::full_over(1_440_000, 86_400_000, T0);
        b.reserve(1_440_000, T0).unwrap();
        // 1,000 tokens a minute.
        assert!((b.level_at(T0 + WINDOW_MS) - 1_000.0).abs() < 1e-6);
        assert_eq!(b.reserve(2_000, T0 + WINDOW_MS), Err(Refused::Wait(Duration::from_secs(60))));
    }

    #[test]
    fn a_cost_above_the_whole_bucket_can_never_run() {
        let mut b = Bucket::full(20, T0);
        assert_eq!(b.reserve(21, T0 + WINDOW_MS), Err(Refused::TooLarge { capacity: 20 }));
        assert_eq!(b.reserve(20, T0), Ok(()));
    }

    #[test]
    fn usage_corrects_the_reservation_both_ways() {
        let mut b = Bucket::full(10_000, T0);
        b.reserve(6_000, T0).unwrap();
        // The answer used less than reserved (max_tokens counted at start): refunded.
        b.correct(6_000, 4_000, T0);
        assert_eq!(b.level_at(T0), 6_000.0);
        // One used more than reserved: the bucket goes into debt, and later calls wait.
        b.reserve(6_000, T0).unwrap();
        b.correct(6_000, 9_000, T0);
        assert_eq!(b.level_at(T0), -3_000.0);
        assert!(matches!(b.reserve(1, T0), Err(Refused::Wait(_))));
    }

    #[test]
    fn the_providers_reading_only_ever_lowers_the_level() {
        let mut b = Bucket::full(48_000, T0);
        // Another deployment on the same account used most of the minute.
        b.follow(&Reading { remaining: Some(5_000), ..Default::default() }, T0);
        assert_eq!(b.level_at(T0), 5_000.0);
        // A reading of more than the bucket holds changes nothing.
        b.follow(&Reading { remaining: Some(40_000), ..Default::default() }, T0);
        assert_eq!(b.level_at(T0), 5_000.0);
        // Full again only in 30 s: at most what half a minute's refill leaves missing.
        let mut c = Bucket::full(48_000, T0);
        c.follow(&Reading { reset: Some(Duration::from_secs(30)), ..Default::default() }, T0);
        assert_eq!(c.level_at(T0), 24_000.0);
        assert_eq!(c.level_at(T0 + 30_000), 48_000.0, "full at the reset");
    }

    #[test]
    fn readings_without_a_reset_make_a_fixed_window_that_refills_all_at_once_at_its_latest_end() {
        // A gateway's answers: 20 requests a minute, 12 left, no reset.
        let reading = |remaining| Reading { limit: Some(20), remaining: Some(remaining), reset: None };
        let mut b = Bucket::full(20, T0);
        b.follow(&reading(12), T0);
        assert!(b.refills_by_window());
        assert_eq!(b.level_at(T0), 12.0);
        // No continuous refill: 30 s later, still 12; once spent, the wait is the window's
        // latest end (a minute after the answer), not 3 s a request.
        assert_eq!(b.level_at(T0 + 30_000), 12.0);
        for _ in 0..12 {
            b.reserve(1, T0 + 30_000).unwrap();
        }
        assert_eq!(b.reserve(1, T0 + 30_000), Err(Refused::Wait(Duration::from_secs(30))));
        // At the end: full at once, and the next end a period later.
        assert_eq!(b.reserve(20, T0 + WINDOW_MS), Ok(()));
        assert_eq!(b.reserve(1, T0 + WINDOW_MS + 1), Err(Refused::Wait(Duration::from_millis(WINDOW_MS - 1))));
        // Long idle: the end moves to the first after now.
        assert_eq!(b.level_at(T0 + 10 * WINDOW_MS + 5), 20.0);
        b.reserve(20, T0 + 10 * WINDOW_MS + 5).unwrap();
        assert_eq!(b.reserve(1, T0 + 10 * WINDOW_MS + 5), Err(Refused::Wait(Duration::from_millis(WINDOW_MS - 5))));
    }

    #[test]
    fn a_fixed_window_seen_starting_earlier_is_taken_and_a_reset_header_means_continuous() {
        let reading = |remaining| Reading { limit: Some(20), remaining: Some(remaining), reset: None };
        let mut b = Bucket::full(20, T0);
        b.follow(&reading(0), T0);
        assert_eq!(b.reserve(1, T0 + 10_000), Err(Refused::Wait(Duration::from_secs(50))));
        // 20 s later an answer (another replica's call) says 19 left: the window started
        // again earlier than assumed. Its end is at most a minute after this answer.
        b.follow(&reading(19), T0 + 20_000);
        assert_eq!(b.level_at(T0 + 20_000), 19.0);
        assert_eq!(b.refills_at_ms, Some(T0 + 20_000 + WINDOW_MS));
        // A little more than the bucket holds is calls not counted yet: no new window.
        b.reserve(5, T0 + 20_000).unwrap();
        b.follow(&reading(16), T0 + 21_000);
        assert_eq!(b.level_at(T0 + 21_000), 14.0);
        assert_eq!(b.refills_at_ms, Some(T0 + 20_000 + WINDOW_MS));
        // A reading with a reset: the provider refills continuously.
        b.follow(&Reading { limit: Some(20), remaining: Some(14), reset: Some(Duration::from_secs(18)) }, T0 + 21_000);
        assert!(!b.refills_by_window());
        assert!((b.level_at(T0 + 24_000) - 15.0).abs() < 1e-6, "one request back every 3 s");
    }

    #[test]
    fn the_limit_is_the_configured_one_or_the_reported_one_never_above_the_configured() {
        assert_eq!(capacity(Some(20), None), Some(20));
        assert_eq!(capacity(None, Some(48_000)), Some(48_000));
        assert_eq!(capacity(Some(40_000), Some(48_000)), Some(40_000), "never raised above the configured value");
        assert_eq!(capacity(Some(40_000), Some(30_000)), Some(30_000), "the provider's lower limit wins");
        assert_eq!(capacity(None, None), None);
        assert_eq!(capacity(None, Some(0)), None);
    }
}
