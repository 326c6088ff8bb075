//! The key's congestion window: pure AIMD arithmetic, shared by the fleet as one value.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Calls a fresh scope starts with: TCP-like initial window.
const INITIAL_WINDOW: f64 = 2.0;

/// The congestion window of one scope on one replica, like TCP's: slow start from two
/// calls (+1 per success) until the first 429; then one decrease per congestion event.
/// An event is every 429 from its first until the next success (calls started before
/// the decrease, the pause, a provider-wide burst). A failed probe falls back to the
/// last level that held; congestion at or below it halves the window, which then
/// regains that level by one call per window of successes (TCP's additive increase),
/// unless congestion strikes again on the way, which lowers the level (the provider's
/// capacity did drop). Above the level that held it probes one call higher only after
/// `probe_every` without a 429.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Window {
    window: f64,
    stable: f64,
    slow_start: bool,
    last_decrease_ms: u64,
    /// 429s until then belong to the last decrease's event (its pause).
    event_until_ms: u64,
    last_probe_ms: u64,
    probe_every_ms: u64,
    /// The last event has not seen a success yet: further 429s belong to it.
    in_event: bool,
    /// When the last event ended (its first success): 429s of calls started before
    /// then still belong to it.
    event_end_ms: u64,
    /// Successes since the window last changed level; a level that ran a window's worth
    /// of calls without a 429 has held.
    at_level: u32,
}

impl Window {
    pub fn new(probe_every: Duration) -> Self {
        Window {
            window: INITIAL_WINDOW,
            stable: 0.0,
            slow_start: true,
            last_decrease_ms: 0,
            event_until_ms: 0,
            last_probe_ms: 0,
            probe_every_ms: probe_every.as_millis() as u64,
            in_event: false,
            event_end_ms: 0,
            at_level: 0,
        }
    }

    /// Calls this replica may have in flight, given its share.
    pub fn allowed(&self, share: u32) -> u32 {
        (self.window.floor().max(1.0) as u32).min(share)
    }

    /// The fleet's calls in flight on the key: at least one, at most `limit`.
    pub fn fleet(&self, limit: u32) -> u32 {
        (self.window.floor().max(1.0) as u32).min(limit.max(1))
    }

    /// Two replicas' views of the same key's window, as one: the later congestion event
    /// wins; within the same event, the most growth (each replica grows the window by its
    /// own successes).
    pub fn merged(&self, other: &Window) -> Window {
        if self.last_decrease_ms != other.last_decrease_ms {
            return if self.last_decrease_ms > other.last_decrease_ms { *self } else { *other };
        }
        let mut m = if self.window >= other.window { *self } else { *other };
        m.stable = self.stable.max(other.stable);
        m.slow_start = self.slow_start && other.slow_start;
        m.in_event = self.in_event && other.in_event;
        m.event_end_ms = self.event_end_ms.max(other.event_end_ms);
        m.event_until_ms = self.event_until_ms.max(other.event_until_ms);
        m.last_probe_ms = self.last_probe_ms.max(other.last_probe_ms);
        m.at_level = self.at_level.max(other.at_level);
        m
    }

    /// Whether a change from `before` is worth telling the fleet: the level, the level
    /// that held, or the congestion-event state.
    pub fn differs(&self, before: &Window) -> bool {
        self.window.floor() != before.window.floor()
            || self.stable != before.stable
            || self.slow_start != before.slow_start
            || self.in_event != before.in_event
            || self.last_decrease_ms != before.last_decrease_ms
            || self.last_probe_ms != before.last_probe_ms
    }

    /// A 429 for a call that started at `started_ms`; the scope pauses for `pause`.
    /// 429s of calls started before the last decrease, or arriving during its pause,
    /// are the same congestion event.
    pub fn on_rate_limited(&mut self, now_ms: u64, started_ms: u64, pause: Duration) {
        self.on_rate_limited_under(now_ms, started_ms, pause, u32::MAX);
    }

    /// As `on_rate_limited`, knowing the key's configured `limit`: a first 429 while the
    /// window is at that limit is congestion at a level that holds (a burst of another
    /// client of the account, or the fleet's own overshoot while shares move), not a
    /// limit learned: halve, and regain the limit by additive increase.
    pub fn on_rate_limited_under(&mut self, now_ms: u64, started_ms: u64, pause: Duration, limit: u32) {
        if self.in_event
            || started_ms < self.last_decrease_ms
            || started_ms < self.event_end_ms
            || now_ms < self.event_until_ms
        {
            return;
        }
        self.event_until_ms = now_ms + pause.as_millis() as u64;
        let halved = (self.window.floor() / 2.0).ceil().max(1.0);
        if self.stable < 1.0 && self.window.floor() >= f64::from(limit) {
            self.window = halved;
            self.stable = f64::from(limit);
        } else if self.stable < 1.0 {
            self.window = halved;
            self.stable = halved;
        } else if self.window.floor() > self.stable {
            // A failed probe.
            self.window = self.stable;
        } else if self.window.floor() < self.stable {
            // Congestion again before the level that held was regained: it no longer holds.
            self.window = halved;
            self.stable = halved;
        } else {
            // Congestion at the level that held (a burst): halve, and regain it.
            self.window = halved;
        }
        self.slow_start = false;
        self.in_event = true;
        self.at_level = 0;
        self.last_decrease_ms = now_ms;
    }

    pub fn on_success(&mut self, share: u32, now_ms: u64) {
        self.on_call_success(share, now_ms, now_ms);
    }

    /// A success of a call started at `started_ms`. A call started before the last
    /// decrease proves nothing about the level after it: it neither ends the event nor
    /// grows the window (a burst starts while earlier calls are still answering 200).
    pub fn on_call_success(&mut self, share: u32, now_ms: u64, started_ms: u64) {
        if started_ms < self.last_decrease_ms {
            return;
        }
        let cap = f64::from(share.max(1));
        if self.in_event {
            self.in_event = false;
            self.event_end_ms = now_ms;
        }
        let level = self.window.floor();
        self.on_success_grow(cap, now_ms);
        if self.window.floor() != level {
            self.at_level = 0;
        } else {
            self.at_level += 1;
            if f64::from(self.at_level) >= level && level > self.stable {
                self.stable = level;
            }
        }
    }

    fn on_success_grow(&mut self, cap: f64, now_ms: u64) {
        if self.slow_start {
            self.window = (self.window + 1.0).min(cap);
        } else if self.window < self.stable {
            self.window = (self.window + 1.0 / self.window.max(1.0)).min(self.stable);
        } else if now_ms.saturating_sub(self.last_decrease_ms) >= self.probe_every_ms
            && now_ms.saturating_sub(self.last_probe_ms) >= self.probe_every_ms
            && self.window < cap
        {
            self.stable = self.window;
            self.window += 1.0;
            self.last_probe_ms = now_ms;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::share;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("r{i}")).collect()
    }

    #[test]
    fn window_storm_trajectory() {
        // Provider cap 2, calls of 3 s, this replica's share 8.
        let mut w = Window::new(Duration::from_secs(60));
        assert_eq!(w.allowed(8), 2, "slow start from two calls");
        assert_eq!(w.allowed(1), 1, "never above the share");
        w.on_success(8, 3_000);
        w.on_success(8, 3_000);
        assert_eq!(w.allowed(8), 4);
        // Two of the four calls are refused: one event, halved once, whether the second
        // call started before the decrease or just after it (during the pause).
        let pause = Duration::from_secs(2);
        w.on_rate_limited(6_010, 6_000, pause);
        w.on_rate_limited(6_011, 6_000, pause);
        w.on_rate_limited(6_030, 6_015, pause);
        assert_eq!(w.allowed(8), 2);
        // No probing within the quiet interval.
        for t in [9_000, 12_000, 30_000, 60_000] {
            w.on_success(8, t);
            assert_eq!(w.allowed(8), 2, "at {t}");
        }
        // A probe after it; refused: back to the level that held, not lower.
        w.on_success(8, 66_100);
        assert_eq!(w.allowed(8), 3);
        w.on_rate_limited(67_000, 66_200, pause);
        assert_eq!(w.allowed(8), 2);
        // Congestion at the level that held halves (after a success ended the event)...
        w.on_success(8, 68_000);
        w.on_rate_limited(70_000, 69_000, pause);
        assert_eq!(w.allowed(8), 1);
        assert_eq!(w.allowed(0), 0, "no share, no calls");
        // ...and the level is regained one call per window of successes.
        w.on_success(8, 73_000);
        assert_eq!(w.allowed(8), 2);
        w.on_success(8, 76_000);
        assert_eq!(w.allowed(8), 2, "not above the level that held without a probe");
    }

    #[test]
    fn periodic_provider_wide_bursts_do_not_ratchet_the_window_down() {
        // 100 ms calls, share 16; every 60 s the provider refuses everything for 5 s.
        let mut w = Window::new(Duration::from_secs(60));
        let mut t = 0;
        for _ in 0..40 {
            t += 100;
            w.on_success(16, t);
        }
        assert_eq!(w.allowed(16), 16);
        for _burst in 0..5 {
            t += 55_000;
            // Every call of the burst is refused, retried each second: one event.
            for k in 0..5 {
                for c in 0..16 {
                    w.on_rate_limited(t + k * 1_000 + c, t + k * 1_000, Duration::from_secs(1));
                }
            }
            // Calls started before the burst still answer 200 during it: they do not
            // end the burst, and the 429s after them are the same event.
            w.on_call_success(16, t + 80, t - 20);
            w.on_rate_limited(t + 1_200, t + 1_100, Duration::from_secs(1));
            assert_eq!(w.allowed(16), 8, "one halving per burst");
            t += 5_000;
            // The first success ends the burst; a 429 of a call started before that,
            // answered after it, still belongs to the burst.
            w.on_success(16, t);
            w.on_rate_limited(t + 50, t - 10, Duration::from_secs(1));
            assert_eq!(w.allowed(16), 8);
            // Within a couple of seconds of successes the level is back.
            for _ in 0..120 {
                t += 100 / 8;
                w.on_success(16, t);
            }
            assert_eq!(w.allowed(16), 16);
        }
    }

    #[test]
    fn a_lasting_capacity_drop_lowers_the_level() {
        // The provider goes from 16 calls to 4 for good.
        let mut w = Window::new(Duration::from_secs(60));
        for i in 0..40 {
            w.on_success(16, i * 100);
        }
        let pause = Duration::from_secs(1);
        w.on_rate_limited(10_000, 9_900, pause);
        assert_eq!(w.allowed(16), 8);
        w.on_success(16, 11_100);
        // 8 is still too many: refused again before 16 was regained.
        w.on_rate_limited(11_200, 11_150, pause);
        assert_eq!(w.allowed(16), 4);
        for i in 0..40 {
            w.on_success(16, 12_000 + i * 100);
        }
        assert_eq!(w.allowed(16), 4, "holds at the new level, probing only every interval");
    }

    #[test]
    fn halving_rounds_up() {
        // One 429 while three calls were allowed: two held, so two, not one.
        let mut w = Window::new(Duration::from_secs(60));
        w.on_success(8, 1_000);
        assert_eq!(w.allowed(8), 3);
        w.on_rate_limited(1_010, 1_005, Duration::from_secs(2));
        assert_eq!(w.allowed(8), 2);
    }

    #[test]
    fn window_grows_to_the_share_in_slow_start() {
        let mut w = Window::new(Duration::from_secs(60));
        for i in 0..20 {
            w.on_success(5, i);
        }
        assert_eq!(w.allowed(5), 5);
        assert_eq!(w.allowed(3), 3);
    }

    #[test]
    fn the_fleet_window_is_at_least_one_call_and_at_most_the_key_limit() {
        let w = Window::new(Duration::from_secs(60));
        assert_eq!(w.fleet(4), 2, "starts at two calls for the whole fleet");
        // Three replicas share the fleet's two calls: 1, 1, 0 — never 2 each.
        let live = ids(3);
        let fleet = w.fleet(4);
        assert_eq!(live.iter().map(|me| share(fleet, &live, me)).sum::<u32>(), 2);
        let mut grown = w;
        for t in 0..10 {
            grown.on_success(4, t);
        }
        assert_eq!(grown.fleet(4), 4, "slow start stops at the key's limit");
        let mut cut = grown;
        cut.on_rate_limited(100, 50, Duration::from_secs(1));
        assert_eq!(cut.fleet(4), 2);
        assert!(cut.differs(&grown));
        let mut again = cut;
        again.on_rate_limited(200, 60, Duration::from_secs(1));
        assert!(!again.differs(&cut), "a 429 of the same event changes nothing to tell");
    }

    #[test]
    fn a_first_429_at_the_known_limit_is_regained_without_waiting_for_a_probe() {
        let mut w = Window::new(Duration::from_secs(60));
        for t in 0..10 {
            w.on_success(4, t);
        }
        assert_eq!(w.fleet(4), 4);
        w.on_rate_limited_under(1_000, 990, Duration::from_secs(1), 4);
        assert_eq!(w.fleet(4), 2);
        let mut t = 2_000;
        while w.fleet(4) < 4 && t < 2_100 {
            w.on_call_success(4, t, t);
            t += 1;
        }
        assert_eq!(w.fleet(4), 4, "regained by additive increase, in {} successes", t - 2_000);
        assert!(t - 2_000 <= 8);
        // Below the known limit the first 429 teaches the level, as before.
        let mut learn = Window::new(Duration::from_secs(60));
        learn.on_success(8, 0);
        learn.on_rate_limited_under(1_000, 990, Duration::from_secs(1), 8);
        assert_eq!(learn.fleet(8), 2);
        for t in 2_000..2_050 {
            learn.on_call_success(8, t, t);
        }
        assert_eq!(learn.fleet(8), 2, "holds until a probe");
    }
}
