//! The ledger of one replica's key: what it knows of the fleet (the window, the live
//! replicas, pauses) and of its own calls, and the pure decisions made from it — room,
//! fairness and tenant caps — each judged at the time it is given.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use super::share::{fair_share, share};
use super::window::Window;

pub(super) struct Ledger {
    /// This replica's id.
    pub me: String,
    /// Calls in flight on the key across the fleet, at most.
    pub key_limit: u32,
    /// Per tenant: fleet-wide cap within the key (`scope_limit`), and weight.
    pub limits: Arc<HashMap<String, u32>>,
    pub weights: Arc<HashMap<String, u32>>,
    pub paused_until_ms: u64,
    /// The key is out of routing until then, for `circuit_cause`.
    pub circuit_until_ms: u64,
    pub circuit_cause: super::CircuitCause,
    /// The key's fleet window, as last read or written.
    pub window: Window,
    /// Live replicas, sorted (this one included).
    pub live: Vec<String>,
    /// Calls the other live replicas reported running at their last heartbeat.
    pub others_in_flight: u32,
    /// When the live replicas last changed.
    pub live_changed_ms: u64,
    /// Replicas the last read of the heartbeats missed (kept live until a second miss).
    pub missing: std::collections::BTreeSet<String>,
    /// Until this time the replica only heartbeats: the others must see it before it
    /// takes a share.
    pub warm_until_ms: u64,
    /// Calls running on this replica, by scope token.
    pub in_flight: HashMap<String, u32>,
    /// Messages waiting for a call on this replica, by scope token.
    pub waiting: HashMap<String, u32>,
}

/// The tenant of a scope token (`<provider>.<class>.<tenant>`).
fn tenant_of(token: &str) -> &str {
    token.rsplit('.').next().unwrap_or(token)
}

impl Ledger {
    pub fn new(
        me: String,
        key_limit: u32,
        limits: HashMap<String, u32>,
        weights: HashMap<String, u32>,
        window: Window,
    ) -> Self {
        Ledger {
            live: vec![me.clone()],
            me,
            key_limit: key_limit.max(1),
            limits: Arc::new(limits),
            weights: Arc::new(weights),
            paused_until_ms: 0,
            circuit_until_ms: 0,
            circuit_cause: super::CircuitCause::default(),
            window,
            others_in_flight: 0,
            live_changed_ms: 0,
            missing: Default::default(),
            warm_until_ms: 0,
            in_flight: HashMap::new(),
            waiting: HashMap::new(),
        }
    }

    /// How long the key is still paused at `now_ms`, if it is.
    pub fn paused_for(&self, now_ms: u64) -> Option<Duration> {
        (self.paused_until_ms > now_ms).then(|| Duration::from_millis(self.paused_until_ms - now_ms))
    }

    pub fn circuit_open(&self, now_ms: u64) -> bool {
        self.circuit_until_ms > now_ms
    }

    pub fn warmed_up(&self, now_ms: u64) -> bool {
        now_ms >= self.warm_until_ms
    }

    /// This replica's share of the key's fleet window (0 while warming up), and never
    /// more than the others leave free by their last heartbeats: while shares move (a
    /// replica joined or left), calls the others still run count against the window.
    pub fn key_allowance(&self, now_ms: u64) -> u32 {
        if !self.warmed_up(now_ms) {
            return 0;
        }
        let fleet = self.window.fleet(self.key_limit);
        share(fleet, &self.live, &self.me).min(fleet.saturating_sub(self.others_in_flight))
    }

    /// This replica's part of the tenant's fleet-wide cap, if it has one.
    pub fn tenant_cap(&self, tenant: &str) -> Option<u32> {
        self.limits.get(tenant).map(|limit| share(*limit, &self.live, &self.me))
    }

    fn weight(&self, tenant: &str) -> u32 {
        self.weights.get(tenant).copied().unwrap_or(1)
    }

    /// The scope's fair share of `allowance`: by weight among the tenants that want
    /// calls (running or waiting), within its tenant's cap.
    pub fn fair(&self, token: &str, allowance: u32) -> u32 {
        let active: u32 = self
            .in_flight
            .iter()
            .chain(self.waiting.iter())
            .filter(|(_, n)| **n > 0)
            .map(|(t, _)| t.as_str())
            .chain(std::iter::once(token))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(|t| self.weight(tenant_of(t)))
            .sum();
        let tenant = tenant_of(token);
        fair_share(allowance, self.weight(tenant), active, self.tenant_cap(tenant))
    }

    /// Calls this replica may run for a tenant's scope at most: its share of the key's
    /// window, within the tenant's cap.
    pub fn allowance(&self, tenant: &str, now_ms: u64) -> u32 {
        let a = self.key_allowance(now_ms);
        self.tenant_cap(tenant).map_or(a, |c| a.min(c))
    }

    /// Whether a call of the scope `token` may start at `now_ms`: the key is not paused,
    /// this replica is under its share of the key's window and the tenant under its cap,
    /// and the tenant is under its fair share or no other tenant below its own waits.
    pub fn room(&self, token: &str, now_ms: u64) -> bool {
        if self.paused_for(now_ms).is_some() {
            return false;
        }
        let allowance = self.key_allowance(now_ms);
        let running: u32 = self.in_flight.values().sum();
        if running >= allowance {
            return false;
        }
        let mine = self.in_flight.get(token).copied().unwrap_or(0);
        if self.tenant_cap(tenant_of(token)).is_some_and(|c| mine >= c) {
            return false;
        }
        if mine < self.fair(token, allowance) {
            return true;
        }
        // Above its share: only while no other tenant below its own share is waiting.
        !self.waiting.iter().any(|(other, n)| {
            *n > 0 && other != token && self.in_flight.get(other).copied().unwrap_or(0) < self.fair(other, allowance)
        })
    }

    /// Starts a call of `token` if there is room.
    pub fn start(&mut self, token: &str, now_ms: u64) -> bool {
        if !self.room(token, now_ms) {
            return false;
        }
        *self.in_flight.entry(token.to_string()).or_default() += 1;
        true
    }

    /// Counts a running call (or a waiting message) of `token` up or down.
    pub fn count(&mut self, token: &str, by: i32, waiting: bool) {
        let map = if waiting { &mut self.waiting } else { &mut self.in_flight };
        let n = map.entry(token.to_string()).or_default();
        *n = n.saturating_add_signed(by);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "openai.gpt.alpha";
    const B: &str = "openai.gpt.beta";

    /// A warmed-up replica alone on a key limited to `limit`, its window grown to it.
    fn ledger(limit: u32, caps: &[(&str, u32)], weights: &[(&str, u32)]) -> Ledger {
        let mut w = Window::new(Duration::from_secs(60));
        for t in 0..limit {
            w.on_success(limit, u64::from(t));
        }
        let caps = caps.iter().map(|(t, c)| (t.to_string(), *c)).collect();
        let weights = weights.iter().map(|(t, c)| (t.to_string(), *c)).collect();
        Ledger::new("r0".into(), limit, caps, weights, w)
    }

    #[test]
    fn a_replica_takes_no_share_while_it_warms_up_and_none_the_others_hold() {
        let mut l = ledger(4, &[], &[]);
        l.warm_until_ms = 1_000;
        assert_eq!((l.key_allowance(999), l.key_allowance(1_000)), (0, 4));
        assert!(!l.room(A, 999) && l.room(A, 1_000));
        // Another live replica: half each; calls it still runs count against the window.
        l.live = vec!["r0".into(), "r1".into()];
        assert_eq!(l.key_allowance(1_000), 2);
        l.others_in_flight = 3;
        assert_eq!(l.key_allowance(1_000), 1);
    }

    #[test]
    fn a_pause_or_a_full_share_leaves_no_room() {
        let mut l = ledger(2, &[], &[]);
        l.paused_until_ms = 5_000;
        assert_eq!(l.paused_for(4_000), Some(Duration::from_secs(1)));
        assert!(!l.room(A, 4_999) && l.room(A, 5_000));
        assert!(l.start(A, 5_000) && l.start(A, 5_000));
        assert!(!l.start(A, 5_000), "the share of two is taken");
        l.count(A, -1, false);
        assert!(l.room(A, 5_000));
        l.circuit_until_ms = 9_000;
        assert!(l.circuit_open(8_999) && !l.circuit_open(9_000));
    }

    #[test]
    fn tenants_take_turns_by_weight_within_their_caps() {
        // Weights 3:1 on four calls; beta waits.
        let mut l = ledger(4, &[], &[("alpha", 3)]);
        l.count(B, 1, true);
        for _ in 0..3 {
            assert!(l.start(A, 0));
        }
        assert_eq!(l.fair(A, 4), 3);
        assert!(!l.room(A, 0), "alpha at its share while beta, below its own, waits");
        assert!(l.start(B, 0), "beta's turn");
        // Alone, a tenant may go above its share: nobody below theirs waits.
        let mut alone = ledger(4, &[], &[]);
        alone.count(B, 1, false);
        assert!(alone.room(A, 0));
        // A cap holds whatever the share.
        let mut capped = ledger(4, &[("alpha", 1)], &[]);
        assert_eq!(capped.allowance("alpha", 0), 1);
        assert!(capped.start(A, 0) && !capped.start(A, 0));
    }
}
