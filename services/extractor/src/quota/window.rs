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
/// unless congestion strikes again on the way: then that level no longer holds, and the
/// window settles at the highest level that ran a window of calls since the decrease
/// (at least half). Within `probe_every` of a decrease the window stays at the level
/// that held; after it, it probes one call higher and grows by additive increase, so a
/// level lowered long ago never holds a later burst below the provider's capacity.
///
/// A 429 of a call that started while the fleet had more calls in flight than its
/// window, or right after the live replicas changed, is a race between replicas (shares
/// moving), not a level that failed: the window keeps its level (`Congestion::Race`).
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
    /// The highest level that ran a window of calls without a 429 since the last
    /// decrease.
    #[serde(default)]
    held: f64,
    /// `stable` is a ceiling presumed when slow start ended, not a level that held: the
    /// window regains toward it by additive increase, and a 429 on the way or at it
    /// settles the window at what held.
    #[serde(default)]
    presumed: bool,
}

/// What a 429 did to the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    /// It belongs to a congestion event already counted.
    SameEvent,
    /// The fleet had more calls in flight than its window when the call started: a
    /// race between replicas; the level is kept.
    Race,
    /// The level did not hold: the window went down.
    Lowered,
}

/// A 429, as the window needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimited {
    pub now_ms: u64,
    /// When the refused call started.
    pub started_ms: u64,
    /// How long the key pauses.
    pub pause: Duration,
    /// The key's configured limit on calls in flight.
    pub limit: u32,
    /// The fleet's calls in flight on the key when the refused call started (itself
    /// included), as this replica knew them; `None` when unknown.
    pub in_flight: Option<u32>,
    /// The live replicas changed just before (shares moving: one that dropped out for a
    /// moment may still run its calls).
    pub shares_moving: bool,
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
            held: 0.0,
            presumed: false,
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
        m.held = self.held.max(other.held);
        m.presumed = self.presumed && other.presumed;
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
            || self.presumed != before.presumed
    }

    /// A 429 for a call that started at `started_ms`; the scope pauses for `pause`.
    /// 429s of calls started before the last decrease, or arriving during its pause,
    /// are the same congestion event.
    pub fn on_rate_limited(&mut self, now_ms: u64, started_ms: u64, pause: Duration) {
        self.on_rate_limited_under(now_ms, started_ms, pause, u32::MAX);
    }

    /// As `on_rate_limited`, knowing the key's configured `limit`.
    pub fn on_rate_limited_under(&mut self, now_ms: u64, started_ms: u64, pause: Duration, limit: u32) {
        self.on_congestion(RateLimited { now_ms, started_ms, pause, limit, in_flight: None, shares_moving: false });
    }

    /// A 429. The first one ends slow start: halve (the calls slow start sent above the
    /// provider's capacity drain), and regain by additive increase toward a presumed
    /// ceiling — the key's configured limit when the window had reached it (a burst of
    /// another client of the account, or the fleet's own overshoot while shares move),
    /// else one call below the level refused — settling at what held on the way.
    pub fn on_congestion(&mut self, c: RateLimited) -> Congestion {
        let RateLimited { now_ms, started_ms, pause, limit, in_flight, shares_moving } = c;
        if self.in_event
            || started_ms < self.last_decrease_ms
            || started_ms < self.event_end_ms
            || now_ms < self.event_until_ms
        {
            return Congestion::SameEvent;
        }
        if shares_moving || in_flight.is_some_and(|n| n > self.fleet(limit)) {
            return Congestion::Race;
        }
        self.event_until_ms = now_ms + pause.as_millis() as u64;
        let level = self.window.floor();
        let halved = (level / 2.0).ceil().max(1.0);
        let presumed = self.presumed;
        self.presumed = false;
        if self.stable < 1.0 {
            self.window = halved;
            self.stable = if level >= f64::from(limit) { f64::from(limit) } else { (level - 1.0).max(halved) };
            self.presumed = self.stable > halved;
        } else if level > self.stable {
            // A failed probe.
            self.window = self.stable;
        } else if level < self.stable || presumed {
            // Congestion again before the level that held was regained (or at a ceiling
            // only presumed): it no longer holds. What ran a window of calls on the way
            // up still does.
            let settled = halved.max(self.held.min(level - 1.0));
            self.window = settled;
            self.stable = settled;
        } else {
            // Congestion at the level that held (a burst): halve, and regain it.
            self.window = halved;
        }
        self.slow_start = false;
        self.in_event = true;
        self.at_level = 0;
        self.held = 0.0;
        self.last_decrease_ms = now_ms;
        Congestion::Lowered
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
            if f64::from(self.at_level) >= level {
                self.held = self.held.max(level);
                if level >= self.stable {
                    self.stable = level;
                    self.presumed = false;
                }
            }
        }
    }

    fn on_success_grow(&mut self, cap: f64, now_ms: u64) {
        let quiet = now_ms.saturating_sub(self.last_decrease_ms) >= self.probe_every_ms;
        if self.slow_start {
            self.window = (self.window + 1.0).min(cap);
        } else if self.window < self.stable {
            // One call more per window of successes: each level runs a window's worth of
            // calls (and can be seen to hold) before the next.
            let grown = (self.window + 1.0 / self.window.max(1.0)).min(self.stable);
            self.window = if grown.floor() > self.window.floor() { grown.floor() } else { grown };
        } else if quiet && self.window < cap {
            if now_ms.saturating_sub(self.last_probe_ms) >= self.probe_every_ms {
                // The first success after a quiet interval probes one call higher...
                self.stable = self.stable.max(self.window.floor());
                self.window = self.window.floor() + 1.0;
                self.last_probe_ms = now_ms;
            } else {
                // ...and the window keeps growing by additive increase while it holds.
                self.window = (self.window + 1.0 / self.window.max(1.0)).min(cap);
            }
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
        // Slow start was refused at 4: the window regains toward 3 (one below) at once,
        // by additive increase, and is refused there: it settles at 2, what held.
        for t in [7_000, 7_100] {
            w.on_success(8, t);
            assert_eq!(w.allowed(8), 2, "at {t}");
        }
        w.on_success(8, 7_200);
        assert_eq!(w.allowed(8), 3);
        w.on_rate_limited(8_500, 8_000, pause);
        assert_eq!(w.allowed(8), 2);
        // No probing within the quiet interval.
        for t in [11_000, 12_000, 30_000, 60_000] {
            w.on_success(8, t);
            assert_eq!(w.allowed(8), 2, "at {t}");
        }
        // A probe after it; refused: back to the level that held, not lower.
        w.on_success(8, 70_100);
        assert_eq!(w.allowed(8), 3);
        w.on_rate_limited(71_000, 70_200, pause);
        assert_eq!(w.allowed(8), 2);
        // Congestion at the level that held halves (after a success ended the event)...
        w.on_success(8, 72_000);
        w.on_rate_limited(74_000, 73_000, pause);
        assert_eq!(w.allowed(8), 1);
        assert_eq!(w.allowed(0), 0, "no share, no calls");
        // ...and the level is regained one call per window of successes.
        w.on_success(8, 77_000);
        assert_eq!(w.allowed(8), 2);
        w.on_success(8, 80_000);
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
        // Refused at 3 in slow start, below the known limit: halved to 2, the ceiling
        // presumed at 2 is the level, which holds until a probe.
        let mut learn = Window::new(Duration::from_secs(60));
        learn.on_success(8, 0);
        learn.on_rate_limited_under(1_000, 990, Duration::from_secs(1), 8);
        assert_eq!(learn.fleet(8), 2);
        for t in 2_000..2_050 {
            learn.on_call_success(8, t, t);
        }
        assert_eq!(learn.fleet(8), 2, "holds until a probe");
    }

    #[test]
    fn a_slow_start_overshoot_below_the_limit_is_regained_at_once_up_to_what_holds() {
        // Key limit 8 (as configured), provider cap 4: slow start is refused at 6 (the
        // replicas' successes came in faster than its 429s).
        let mut w = Window::new(Duration::from_secs(60));
        let mut t = 0;
        succeed(&mut w, &mut t, 4);
        assert_eq!(w.fleet(8), 6);
        assert_eq!(w.on_congestion(congestion(1_000, 990, Some(6))), Congestion::Lowered);
        assert_eq!(w.fleet(8), 3, "halved");
        // Regained by additive increase without waiting for a probe (60 s), refused at 5:
        // the window settles at 4, what held on the way.
        t = 2_000;
        while w.fleet(8) < 5 && t < 3_000 {
            succeed(&mut w, &mut t, 1);
        }
        assert_eq!(w.fleet(8), 5, "regained past the cap within {} successes", (t - 2_000) / 10);
        assert!(t - 2_000 <= 100);
        assert_eq!(w.on_congestion(congestion(t + 5, t, Some(5))), Congestion::Lowered);
        assert_eq!(w.fleet(8), 4);
        t += 2_000;
        succeed(&mut w, &mut t, 40);
        assert_eq!(w.fleet(8), 4, "holds at the cap until the next probe");

        // Provider cap 5: the ceiling presumed (one below the level refused) holds, and
        // no further 429 comes.
        let mut w = Window::new(Duration::from_secs(60));
        let mut t = 0;
        succeed(&mut w, &mut t, 4);
        w.on_congestion(congestion(1_000, 990, Some(6)));
        t = 2_000;
        succeed(&mut w, &mut t, 40);
        assert_eq!(w.fleet(8), 5, "regained to one below the level refused, and held there");
        // A 429 at a ceiling only presumed settles at what held; one at a level that held
        // is a burst: halved, and regained.
        let mut p = Window::new(Duration::from_secs(60));
        let mut t = 0;
        succeed(&mut p, &mut t, 4);
        p.on_congestion(congestion(1_000, 990, Some(6)));
        t = 2_000;
        while p.fleet(8) < 5 {
            succeed(&mut p, &mut t, 1);
        }
        p.on_congestion(congestion(t + 5, t, Some(5)));
        assert_eq!(p.fleet(8), 4, "settled at what held, not halved");
        assert_eq!(w.on_congestion(congestion(t + 10_000, t + 9_990, Some(5))), Congestion::Lowered);
        assert_eq!(w.fleet(8), 3, "a burst at a level that held halves it");
    }

    fn congestion(now_ms: u64, started_ms: u64, in_flight: Option<u32>) -> RateLimited {
        RateLimited { now_ms, started_ms, pause: Duration::from_secs(1), limit: 8, in_flight, shares_moving: false }
    }

    /// Successes of calls started at their answer time, `n` of them from `t`, 10 ms apart.
    fn succeed(w: &mut Window, t: &mut u64, n: usize) {
        for _ in 0..n {
            *t += 10;
            w.on_call_success(8, *t, *t);
        }
    }

    #[test]
    fn an_unconfigured_cap_is_found_in_two_events_and_not_undershot() {
        // Key limit 8 (as configured), provider cap 4: slow start overshoots to 8.
        let mut w = Window::new(Duration::from_secs(60));
        let mut t = 0;
        succeed(&mut w, &mut t, 10);
        assert_eq!(w.fleet(8), 8);
        assert_eq!(w.on_congestion(congestion(1_000, 990, Some(5))), Congestion::Lowered);
        assert_eq!(w.fleet(8), 4);
        // 4 holds for a window of calls; the regain toward 8 is refused at 5: the window
        // settles at 4, what held on the way, not at half of 5.
        t = 2_000;
        while w.fleet(8) < 5 && t < 3_000 {
            succeed(&mut w, &mut t, 1);
        }
        assert_eq!(w.fleet(8), 5);
        assert_eq!(w.on_congestion(congestion(t + 5, t, Some(5))), Congestion::Lowered);
        assert_eq!(w.fleet(8), 4);
        t += 2_000;
        succeed(&mut w, &mut t, 40);
        assert_eq!(w.fleet(8), 4, "holds at the cap until the next probe");
    }

    #[test]
    fn a_429_while_the_fleet_ran_more_than_its_window_is_a_race_and_keeps_the_level() {
        let mut w = Window::new(Duration::from_secs(60));
        let mut t = 0;
        succeed(&mut w, &mut t, 2);
        assert_eq!(w.fleet(8), 4);
        // Six calls were running when the refused one started: shares summed above the
        // window while they moved.
        assert_eq!(w.on_congestion(congestion(1_000, 990, Some(6))), Congestion::Race);
        assert_eq!(w.fleet(8), 4, "the level is kept");
        // At the window, the same 429 lowers it.
        assert_eq!(w.on_congestion(congestion(1_100, 1_090, Some(4))), Congestion::Lowered);
        assert_eq!(w.fleet(8), 2);
        assert_eq!(w.on_congestion(congestion(1_110, 1_095, Some(4))), Congestion::SameEvent);
        // Right after the live replicas changed, a 429 is the shares moving: kept.
        succeed(&mut w, &mut 2_000, 4);
        let level = w.fleet(8);
        let moving = RateLimited { shares_moving: true, ..congestion(3_000, 2_990, Some(level)) };
        assert_eq!(w.on_congestion(moving), Congestion::Race);
        assert_eq!(w.fleet(8), level);
    }

    #[test]
    fn a_window_lowered_long_ago_does_not_hold_a_later_burst_below_the_cap() {
        let mut w = Window::new(Duration::from_secs(60));
        let mut t = 0;
        succeed(&mut w, &mut t, 2);
        // Other tenants' 429s took the window down to one call.
        w.on_congestion(congestion(1_000, 990, Some(4)));
        w.on_call_success(8, 2_100, 2_100);
        w.on_congestion(congestion(2_300, 2_200, Some(2)));
        assert_eq!(w.fleet(8), 1);
        // An hour later a burst comes: within a few windows of successes it runs at the
        // key's limit, not one call higher a minute.
        let mut t = 3_600_000;
        let mut successes = 0;
        while w.fleet(8) < 8 && successes < 100 {
            succeed(&mut w, &mut t, 1);
            successes += 1;
        }
        assert_eq!(w.fleet(8), 8, "after {successes} successes");
        assert!(successes <= 40, "{successes} successes to reach the limit");
    }
}
