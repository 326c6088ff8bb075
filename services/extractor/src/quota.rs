//! Quota scopes — `(provider, model class, tenant, region)` — and what every replica of
//! a region shares about them through KV `QUOTA_<R>`:
//!
//! - `pause.<provider>.<class>.<tenant>` = `{"until_ms": …}`: written on a 429 with a
//!   compare-and-set that keeps the later time; every replica follows the key's subject
//!   and makes no call to the scope before then.
//! - `circuit.<provider>.<class>.<tenant>` = `{"until_ms": …}`: opened by a 429
//!   `insufficient_quota`; until then the scope's jobs end at once with that reason.
//! - `replica.<id>` = `{"at_ms": …}`: heartbeats. Each replica takes its share of a
//!   scope's limit among the live replicas (rank-ordered, so the shares sum to the
//!   limit), and within it an AIMD window that halves on a 429 and grows on success.
//!
//! The share and window arithmetic are pure, with unit tests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use reviewlane_shared::clock::SharedClock;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// A quota scope within this region.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub provider: String,
    pub model_class: String,
    pub tenant: String,
}

impl Scope {
    /// KV key token: `<provider>.<class>.<tenant>`, each part reduced to `[A-Za-z0-9_-]`.
    pub fn token(&self) -> String {
        let clean = |s: &str| {
            s.chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
                .collect::<String>()
        };
        format!("{}.{}.{}", clean(&self.provider), clean(&self.model_class), clean(&self.tenant))
    }
}

/// This replica's part of `limit` when `live` (sorted ids, including `me`) share it:
/// an even split, the remainder to the lowest ranks, so the parts sum to `limit`.
pub fn share(limit: u32, live: &[String], me: &str) -> u32 {
    let n = live.len().max(1) as u32;
    let rank = live.iter().position(|id| id == me).unwrap_or(live.len()) as u32;
    if rank >= n {
        return 0;
    }
    limit / n + u32::from(rank < limit % n)
}

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
#[derive(Debug, Clone, Copy, PartialEq)]
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

    /// A 429 for a call that started at `started_ms`; the scope pauses for `pause`.
    /// 429s of calls started before the last decrease, or arriving during its pause,
    /// are the same congestion event.
    pub fn on_rate_limited(&mut self, now_ms: u64, started_ms: u64, pause: Duration) {
        if self.in_event
            || started_ms < self.last_decrease_ms
            || started_ms < self.event_end_ms
            || now_ms < self.event_until_ms
        {
            return;
        }
        self.event_until_ms = now_ms + pause.as_millis() as u64;
        let halved = (self.window.floor() / 2.0).ceil().max(1.0);
        if self.stable < 1.0 {
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

#[derive(Debug, Serialize, Deserialize)]
struct Pause {
    until_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Heartbeat {
    at_ms: u64,
}

struct State {
    paused_until_ms: HashMap<String, u64>,
    /// Open circuits (provider account out of quota): jobs end without a call.
    circuit_until_ms: HashMap<String, u64>,
    live: Vec<String>,
    /// Until this time the replica only heartbeats: others must see it before it takes
    /// a share (only when others exist at start).
    warm_until_ms: u64,
    windows: HashMap<String, Window>,
    in_flight: HashMap<String, u32>,
}

/// Shared quota state of this replica. Cheap to clone.
#[derive(Clone)]
pub struct Quota {
    kv: kv::Store,
    client: async_nats::Client,
    me: String,
    default_limit: u32,
    limits: Arc<HashMap<String, u32>>,
    heartbeat: Duration,
    probe_every: Duration,
    state: Arc<Mutex<State>>,
    /// Woken whenever a pause, a share or an in-flight count changes.
    pub changed: Arc<Notify>,
    /// Pause times, heartbeats and windows are judged on this clock.
    clock: SharedClock,
}

/// A running call in a scope; ends it when dropped.
pub struct ScopeGuard {
    quota: Quota,
    token: String,
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        let mut st = self.quota.state.lock().expect("quota lock");
        if let Some(n) = st.in_flight.get_mut(&self.token) {
            *n = n.saturating_sub(1);
        }
        drop(st);
        self.quota.changed.notify_waiters();
    }
}

const PAUSE_PREFIX: &str = "pause.";
const CIRCUIT_PREFIX: &str = "circuit.";
const REPLICA_PREFIX: &str = "replica.";

impl Quota {
    /// `limits`: scope limit by tenant (summed over replicas), else `default_limit`.
    pub fn new(
        kv: kv::Store,
        client: async_nats::Client,
        default_limit: u32,
        limits: HashMap<String, u32>,
        heartbeat: Duration,
        probe_every: Duration,
        clock: SharedClock,
    ) -> Quota {
        let me = format!("{:016x}", rand::random::<u64>());
        Quota {
            kv,
            client,
            me: me.clone(),
            default_limit,
            limits: Arc::new(limits),
            heartbeat,
            probe_every,
            state: Arc::new(Mutex::new(State {
                paused_until_ms: HashMap::new(),
                circuit_until_ms: HashMap::new(),
                live: vec![me],
                warm_until_ms: 0,
                windows: HashMap::new(),
                in_flight: HashMap::new(),
            })),
            changed: Arc::new(Notify::new()),
            clock,
        }
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// This replica's id (its heartbeat key, and the owner it writes into leases).
    pub fn replica_id(&self) -> &str {
        &self.me
    }

    fn limit(&self, scope: &Scope) -> u32 {
        self.limits.get(&scope.tenant).copied().unwrap_or(self.default_limit)
    }

    /// Announces this replica, loads pauses, and keeps both current until `stop`.
    pub async fn start(&self, stop: CancellationToken) -> Result<(), async_nats::Error> {
        // Follow pauses first, then read what is there: nothing falls in between.
        let mut pauses = self.client.subscribe(format!("{}{PAUSE_PREFIX}>", self.kv.prefix)).await?;
        let mut circuits = self.client.subscribe(format!("{}{CIRCUIT_PREFIX}>", self.kv.prefix)).await?;
        self.beat().await?;
        let others = self.refresh_live().await?;
        if others > 0 {
            self.state.lock().expect("quota lock").warm_until_ms =
                self.now_ms() + 2 * self.heartbeat.as_millis() as u64;
        }
        let mut keys = self.kv.keys().await?;
        while let Some(Ok(key)) = keys.next().await {
            if let Some(token) = key.strip_prefix(PAUSE_PREFIX)
                && let Ok(Some(v)) = self.kv.get(&key).await
            {
                self.note_pause(token, &v);
            }
            if let Some(token) = key.strip_prefix(CIRCUIT_PREFIX)
                && let Ok(Some(v)) = self.kv.get(&key).await
            {
                self.note_circuit(token, &v);
            }
        }
        let q = self.clone();
        let prefix_len = self.kv.prefix.len() + PAUSE_PREFIX.len();
        let circuit_prefix_len = self.kv.prefix.len() + CIRCUIT_PREFIX.len();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(q.heartbeat);
            loop {
                tokio::select! {
                    m = pauses.next() => match m {
                        Some(m) => if let Some(token) = m.subject.get(prefix_len..) { q.note_pause(token, &m.payload) },
                        None => return,
                    },
                    m = circuits.next() => match m {
                        Some(m) => if let Some(token) = m.subject.get(circuit_prefix_len..) { q.note_circuit(token, &m.payload) },
                        None => return,
                    },
                    _ = tick.tick() => {
                        if let Err(e) = q.beat().await { tracing::warn!(error = %e, "heartbeat failed"); }
                        if let Err(e) = q.refresh_live().await { tracing::warn!(error = %e, "reading replicas failed"); }
                    }
                    _ = stop.cancelled() => {
                        let _ = q.kv.delete(format!("{REPLICA_PREFIX}{}", q.me)).await;
                        return;
                    }
                }
            }
        });
        Ok(())
    }

    fn note_pause(&self, token: &str, value: &[u8]) {
        let Ok(p) = serde_json::from_slice::<Pause>(value) else { return };
        let mut st = self.state.lock().expect("quota lock");
        let e = st.paused_until_ms.entry(token.to_string()).or_default();
        *e = (*e).max(p.until_ms);
        drop(st);
        self.changed.notify_waiters();
    }

    fn note_circuit(&self, token: &str, value: &[u8]) {
        let Ok(p) = serde_json::from_slice::<Pause>(value) else { return };
        let mut st = self.state.lock().expect("quota lock");
        let e = st.circuit_until_ms.entry(token.to_string()).or_default();
        *e = (*e).max(p.until_ms);
    }

    /// Whether the scope's circuit is open (its provider account is out of quota).
    pub fn circuit_open(&self, scope: &Scope) -> bool {
        let st = self.state.lock().expect("quota lock");
        st.circuit_until_ms.get(&scope.token()).is_some_and(|&until| until > self.now_ms())
    }

    /// Opens the scope's circuit for `open_for` on every replica: until then its jobs end
    /// `insufficient_quota` without a call. After it, one call probes the account again.
    pub async fn open_circuit(&self, scope: &Scope, open_for: Duration) -> Result<(), async_nats::Error> {
        let token = scope.token();
        let value = serde_json::to_vec(&Pause { until_ms: self.now_ms() + open_for.as_millis() as u64 })?;
        self.kv.put(format!("{CIRCUIT_PREFIX}{token}"), value.clone().into()).await?;
        self.note_circuit(&token, &value);
        Ok(())
    }

    async fn beat(&self) -> Result<(), async_nats::Error> {
        let v = serde_json::to_vec(&Heartbeat { at_ms: self.now_ms() })?;
        self.kv.put(format!("{REPLICA_PREFIX}{}", self.me), v.into()).await?;
        Ok(())
    }

    /// Re-reads the live replicas; returns how many others there are.
    async fn refresh_live(&self) -> Result<usize, async_nats::Error> {
        let stale_after = 3 * self.heartbeat.as_millis() as u64;
        let now = self.now_ms();
        let mut live = Vec::new();
        let mut keys = self.kv.keys().await?;
        while let Some(Ok(key)) = keys.next().await {
            let Some(id) = key.strip_prefix(REPLICA_PREFIX) else { continue };
            let Ok(Some(v)) = self.kv.get(&key).await else { continue };
            match serde_json::from_slice::<Heartbeat>(&v) {
                Ok(h) if now.saturating_sub(h.at_ms) <= stale_after => live.push(id.to_string()),
                // Long dead: tidy up.
                Ok(h) if now.saturating_sub(h.at_ms) > 20 * stale_after => {
                    let _ = self.kv.delete(&key).await;
                }
                _ => {}
            }
        }
        if !live.contains(&self.me) {
            live.push(self.me.clone());
        }
        live.sort();
        let others = live.len() - 1;
        let mut st = self.state.lock().expect("quota lock");
        if st.live != live {
            st.live = live;
            drop(st);
            self.changed.notify_waiters();
        }
        Ok(others)
    }

    /// How long the scope is still paused, if it is.
    pub fn paused_for(&self, scope: &Scope) -> Option<Duration> {
        let until = *self.state.lock().expect("quota lock").paused_until_ms.get(&scope.token())?;
        let now = self.now_ms();
        (until > now).then(|| Duration::from_millis(until - now))
    }

    /// Calls this replica may run in `scope` now (0 while warming up or without a share).
    pub fn allowance(&self, scope: &Scope) -> u32 {
        let limit = self.limit(scope);
        let mut st = self.state.lock().expect("quota lock");
        if self.now_ms() < st.warm_until_ms {
            return 0;
        }
        let my_share = share(limit, &st.live, &self.me);
        let probe_every = self.probe_every;
        st.windows.entry(scope.token()).or_insert_with(|| Window::new(probe_every)).allowed(my_share)
    }

    /// Calls running in `scope` on this replica.
    pub fn in_flight(&self, scope: &Scope) -> u32 {
        self.state.lock().expect("quota lock").in_flight.get(&scope.token()).copied().unwrap_or(0)
    }

    /// Whether a call in `scope` could start now (not paused, under the allowance).
    pub fn has_room(&self, scope: &Scope) -> bool {
        if self.paused_for(scope).is_some() {
            return false;
        }
        let allowed = self.allowance(scope);
        let st = self.state.lock().expect("quota lock");
        st.in_flight.get(&scope.token()).copied().unwrap_or(0) < allowed
    }

    /// Starts a call in `scope` if the scope is not paused and this replica is under
    /// its allowance; `None` otherwise.
    pub fn try_start(&self, scope: &Scope) -> Option<ScopeGuard> {
        if self.paused_for(scope).is_some() {
            return None;
        }
        let token = scope.token();
        let limit = self.limit(scope);
        let mut st = self.state.lock().expect("quota lock");
        if self.now_ms() < st.warm_until_ms {
            return None;
        }
        let my_share = share(limit, &st.live, &self.me);
        let probe_every = self.probe_every;
        let allowed = st.windows.entry(token.clone()).or_insert_with(|| Window::new(probe_every)).allowed(my_share);
        let n = st.in_flight.entry(token.clone()).or_default();
        if *n >= allowed {
            return None;
        }
        *n += 1;
        Some(ScopeGuard { quota: self.clone(), token })
    }

    /// Records a 429 for a call started at `started_ms`: pauses the scope for every
    /// replica (keeping a later pause), and narrows this replica's window.
    pub async fn rate_limited(&self, scope: &Scope, pause: Duration, started_ms: u64) -> Result<(), async_nats::Error> {
        let probe_every = self.probe_every;
        self.state
            .lock()
            .expect("quota lock")
            .windows
            .entry(scope.token())
            .or_insert_with(|| Window::new(probe_every))
            .on_rate_limited(self.now_ms(), started_ms, pause);
        self.pause(scope, pause).await
    }

    /// Pauses the scope for `pause` from now, unless a later pause is already recorded.
    pub async fn pause(&self, scope: &Scope, pause: Duration) -> Result<(), async_nats::Error> {
        let token = scope.token();
        let until_ms = self.now_ms() + pause.as_millis() as u64;
        let key = format!("{PAUSE_PREFIX}{token}");
        let value: bytes::Bytes = serde_json::to_vec(&Pause { until_ms })?.into();
        for _ in 0..8 {
            match self.kv.entry(&key).await? {
                Some(e) if e.operation == kv::Operation::Put => {
                    if serde_json::from_slice::<Pause>(&e.value).is_ok_and(|p| p.until_ms >= until_ms) {
                        break;
                    }
                    match self.kv.update(&key, value.clone(), e.revision).await {
                        Ok(_) => break,
                        Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                        Err(err) => return Err(err.into()),
                    }
                }
                _ => match self.kv.create(&key, value.clone()).await {
                    Ok(_) => break,
                    Err(err) if err.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                    Err(err) => return Err(err.into()),
                },
            }
        }
        self.note_pause(&token, &value);
        Ok(())
    }

    /// A call of `scope` started at `started_ms` succeeded.
    pub fn succeeded(&self, scope: &Scope, started_ms: u64) {
        let limit = self.limit(scope);
        let mut st = self.state.lock().expect("quota lock");
        let my_share = share(limit, &st.live, &self.me);
        let probe_every = self.probe_every;
        st.windows.entry(scope.token()).or_insert_with(|| Window::new(probe_every)).on_call_success(
            my_share,
            self.now_ms(),
            started_ms,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("r{i}")).collect()
    }

    #[test]
    fn shares_sum_to_the_limit() {
        for limit in 0..10u32 {
            for n in 1..6 {
                let live = ids(n);
                let total: u32 = live.iter().map(|me| share(limit, &live, me)).sum();
                assert_eq!(total, limit, "limit {limit} over {n}");
            }
        }
        let live = ids(3);
        assert_eq!([share(2, &live, "r0"), share(2, &live, "r1"), share(2, &live, "r2")], [1, 1, 0]);
        assert_eq!(share(8, &ids(1), "r0"), 8);
        // Not (yet) among the live: no share.
        assert_eq!(share(8, &live, "zz"), 0);
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
    fn scope_tokens_are_subject_safe() {
        let s = Scope { provider: "openai".into(), model_class: "gpt-4.1 mini".into(), tenant: "acme".into() };
        assert_eq!(s.token(), "openai.gpt-4_1_mini.acme");
    }
}
