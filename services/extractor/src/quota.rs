//! Provider keys and quota scopes, and what every replica of a region shares about them
//! through KV `QUOTA_<R>`.
//!
//! A provider key is one account with one limit; the quota scopes — `(provider, model
//! class, tenant, region)` — are its children. The fleet's calls on a key stay within
//! one congestion window for the whole fleet, whatever the number of replicas and
//! tenants:
//!
//! - `window.<key>`: the key's congestion window (AIMD, see `Window`), shared: a 429
//!   halves it once for the fleet, growth is written back when its level changes, and
//!   every replica follows the entry. A new replica starts from the last-learned window.
//! - `replica.<id>` = `{"at_ms": …}`: heartbeats. Each replica may run its share of the
//!   window among the live replicas (rank-ordered, so the shares sum to the window, and
//!   the minimum of one call holds for the fleet, not per replica). A replica whose
//!   heartbeat expires drops out of the ranks at once: the survivors take its share on
//!   their next heartbeat. A starting replica heartbeats for two periods before it takes
//!   a share, so the others see it first and the shares never sum above the window.
//! - `pause.<key>` = `{"until_ms": …}`: a 429 pauses the key, once, for every replica
//!   (compare-and-set keeps the later time).
//! - `circuit.<key>` = `{"until_ms": …}`: a 429 `insufficient_quota` (the account is out
//!   of money); until then the key's jobs end at once with that reason.
//!
//! Within a replica's share, tenants take calls by weight (`fair_share`): a tenant below
//! its weighted share is served before one above it, and a tenant alone takes it all.
//! A tenant's `scope_limit` caps it across the fleet.
//!
//! The share, fair-share and window arithmetic are pure, with unit tests.

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

/// A tenant's part of this replica's `allowance` on the key: its `weight` against the
/// total weight of the tenants that want calls (running or waiting), rounded up, at
/// least one while there is any allowance, and at most `cap`.
pub fn fair_share(allowance: u32, weight: u32, active_weight: u32, cap: Option<u32>) -> u32 {
    let total = u64::from(active_weight.max(weight).max(1));
    let fair = (u64::from(allowance) * u64::from(weight.max(1))).div_ceil(total) as u32;
    let fair = fair.max(u32::from(allowance > 0)).min(allowance);
    cap.map_or(fair, |c| fair.min(c))
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

#[derive(Debug, Serialize, Deserialize)]
struct Pause {
    until_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Heartbeat {
    at_ms: u64,
    /// Calls this replica had running on the key when it beat.
    #[serde(default)]
    in_flight: u32,
}

struct State {
    paused_until_ms: u64,
    /// The account is out of quota until then: jobs end without a call.
    circuit_until_ms: u64,
    /// The key's fleet window, as last read or written.
    window: Window,
    live: Vec<String>,
    /// Calls the other live replicas reported running at their last heartbeat.
    others_in_flight: u32,
    /// Until this time the replica only heartbeats: the others must see it before it
    /// takes a share.
    warm_until_ms: u64,
    /// Calls running on this replica, by scope token.
    in_flight: HashMap<String, u32>,
    /// Messages waiting for a call on this replica, by scope token.
    waiting: HashMap<String, u32>,
}

/// Shared quota state of this replica for its provider key. Cheap to clone.
#[derive(Clone)]
pub struct Quota {
    kv: kv::Store,
    client: async_nats::Client,
    me: String,
    /// The provider key (account) token: `<provider>.<key id>`.
    key: String,
    /// Calls in flight on the key across the fleet, at most.
    key_limit: u32,
    /// Per tenant: fleet-wide cap within the key (`scope_limit`), and weight.
    limits: Arc<HashMap<String, u32>>,
    weights: Arc<HashMap<String, u32>>,
    heartbeat: Duration,
    probe_every: Duration,
    state: Arc<Mutex<State>>,
    /// Woken whenever a pause, a share, the window or an in-flight count changes.
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
        self.quota.count(&self.token, -1, false);
    }
}

/// A message of a scope waiting for a call; its tenant counts as wanting calls.
pub struct Waiting {
    quota: Quota,
    token: String,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.quota.count(&self.token, -1, true);
    }
}

const PAUSE_PREFIX: &str = "pause.";
const CIRCUIT_PREFIX: &str = "circuit.";
const WINDOW_PREFIX: &str = "window.";
const REPLICA_PREFIX: &str = "replica.";

/// What `Quota::new` needs to know about the key and its tenants.
#[derive(Debug, Clone)]
pub struct KeyConfig {
    /// `<provider>.<key id>` (each part reduced to `[A-Za-z0-9_-]`).
    pub key: String,
    /// Calls in flight on the key across the fleet.
    pub limit: u32,
    /// Per tenant, a fleet-wide cap within the key.
    pub tenant_limits: HashMap<String, u32>,
    /// Per tenant, its weight (default 1).
    pub weights: HashMap<String, u32>,
}

impl KeyConfig {
    pub fn token(provider: &str, key_id: &str) -> String {
        format!("{}.{}", clean(provider), clean(key_id))
    }
}

fn clean(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

impl Quota {
    pub fn new(
        kv: kv::Store,
        client: async_nats::Client,
        key: KeyConfig,
        heartbeat: Duration,
        probe_every: Duration,
        clock: SharedClock,
    ) -> Quota {
        let me = format!("{:016x}", rand::random::<u64>());
        Quota {
            kv,
            client,
            me: me.clone(),
            key: key.key,
            key_limit: key.limit.max(1),
            limits: Arc::new(key.tenant_limits),
            weights: Arc::new(key.weights),
            heartbeat,
            probe_every,
            state: Arc::new(Mutex::new(State {
                paused_until_ms: 0,
                circuit_until_ms: 0,
                window: Window::new(probe_every),
                live: vec![me],
                others_in_flight: 0,
                warm_until_ms: 0,
                in_flight: HashMap::new(),
                waiting: HashMap::new(),
            })),
            changed: Arc::new(Notify::new()),
            clock,
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// This replica's id (its heartbeat key, and the owner it writes into leases).
    pub fn replica_id(&self) -> &str {
        &self.me
    }

    fn count(&self, token: &str, by: i32, waiting: bool) {
        let mut st = self.state.lock().expect("quota lock");
        let map = if waiting { &mut st.waiting } else { &mut st.in_flight };
        let n = map.entry(token.to_string()).or_default();
        *n = n.saturating_add_signed(by);
        drop(st);
        self.changed.notify_waiters();
    }

    /// Announces this replica, loads the key's pause, circuit and window, and keeps them
    /// current until `stop`.
    pub async fn start(&self, stop: CancellationToken) -> Result<(), async_nats::Error> {
        // Follow first, then read what is there: nothing falls in between.
        let prefix = self.kv.prefix.clone();
        let mut pauses = self.client.subscribe(format!("{prefix}{PAUSE_PREFIX}{}", self.key)).await?;
        let mut circuits = self.client.subscribe(format!("{prefix}{CIRCUIT_PREFIX}{}", self.key)).await?;
        let mut windows = self.client.subscribe(format!("{prefix}{WINDOW_PREFIX}{}", self.key)).await?;
        self.beat().await?;
        self.refresh_live().await?;
        // Others that start now must see this replica before it takes a share.
        self.state.lock().expect("quota lock").warm_until_ms = self.now_ms() + 2 * self.heartbeat.as_millis() as u64;
        if let Some(v) = self.kv.get(format!("{PAUSE_PREFIX}{}", self.key)).await? {
            self.note_pause(&v);
        }
        if let Some(v) = self.kv.get(format!("{CIRCUIT_PREFIX}{}", self.key)).await? {
            self.note_circuit(&v);
        }
        if let Some(v) = self.kv.get(format!("{WINDOW_PREFIX}{}", self.key)).await? {
            self.note_window(&v);
        }
        let q = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(q.heartbeat);
            loop {
                tokio::select! {
                    m = pauses.next() => match m { Some(m) => q.note_pause(&m.payload), None => return },
                    m = circuits.next() => match m { Some(m) => q.note_circuit(&m.payload), None => return },
                    m = windows.next() => match m { Some(m) => q.note_window(&m.payload), None => return },
                    _ = tick.tick() => {
                        if let Err(e) = q.beat().await { tracing::warn!(error = %e, "heartbeat failed"); }
                        if let Err(e) = q.refresh_live().await { tracing::warn!(error = %e, "reading replicas failed"); }
                        // A pause or the warm-up may end without a message.
                        q.changed.notify_waiters();
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

    fn note_pause(&self, value: &[u8]) {
        let Ok(p) = serde_json::from_slice::<Pause>(value) else { return };
        let mut st = self.state.lock().expect("quota lock");
        st.paused_until_ms = st.paused_until_ms.max(p.until_ms);
        drop(st);
        self.changed.notify_waiters();
    }

    fn note_circuit(&self, value: &[u8]) {
        let Ok(p) = serde_json::from_slice::<Pause>(value) else { return };
        let mut st = self.state.lock().expect("quota lock");
        st.circuit_until_ms = st.circuit_until_ms.max(p.until_ms);
    }

    fn note_window(&self, value: &[u8]) {
        let Ok(w) = serde_json::from_slice::<Window>(value) else { return };
        let mut st = self.state.lock().expect("quota lock");
        st.window = w.merged(&st.window);
        drop(st);
        self.changed.notify_waiters();
    }

    /// Whether the key's circuit is open (its account is out of quota).
    pub fn circuit_open(&self, _scope: &Scope) -> bool {
        self.state.lock().expect("quota lock").circuit_until_ms > self.now_ms()
    }

    /// Opens the key's circuit for `open_for` on every replica: until then its jobs end
    /// `insufficient_quota` without a call. After it, one call probes the account again.
    pub async fn open_circuit(&self, _scope: &Scope, open_for: Duration) -> Result<(), async_nats::Error> {
        let value = serde_json::to_vec(&Pause { until_ms: self.now_ms() + open_for.as_millis() as u64 })?;
        self.kv.put(format!("{CIRCUIT_PREFIX}{}", self.key), value.clone().into()).await?;
        self.note_circuit(&value);
        Ok(())
    }

    async fn beat(&self) -> Result<(), async_nats::Error> {
        let in_flight = self.state.lock().expect("quota lock").in_flight.values().sum();
        let v = serde_json::to_vec(&Heartbeat { at_ms: self.now_ms(), in_flight })?;
        self.kv.put(format!("{REPLICA_PREFIX}{}", self.me), v.into()).await?;
        Ok(())
    }

    /// Re-reads the live replicas; returns how many others there are.
    async fn refresh_live(&self) -> Result<usize, async_nats::Error> {
        let stale_after = 3 * self.heartbeat.as_millis() as u64;
        let now = self.now_ms();
        let mut live = Vec::new();
        let mut others_in_flight = 0;
        // A partial read would shrink the ranks and inflate this replica's share: any
        // error keeps the previous view instead.
        let mut keys = self.kv.keys().await?;
        while let Some(key) = keys.next().await {
            let key = key?;
            let Some(id) = key.strip_prefix(REPLICA_PREFIX) else { continue };
            let Some(v) = self.kv.get(&key).await? else { continue };
            match serde_json::from_slice::<Heartbeat>(&v) {
                Ok(h) if now.saturating_sub(h.at_ms) <= stale_after => {
                    if id != self.me {
                        others_in_flight += h.in_flight;
                    }
                    live.push(id.to_string());
                }
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
        st.others_in_flight = others_in_flight;
        if st.live != live {
            st.live = live;
            drop(st);
            self.changed.notify_waiters();
        }
        Ok(others)
    }

    /// How long the key is still paused, if it is.
    pub fn paused_for(&self, _scope: &Scope) -> Option<Duration> {
        let until = self.state.lock().expect("quota lock").paused_until_ms;
        let now = self.now_ms();
        (until > now).then(|| Duration::from_millis(until - now))
    }

    /// This replica's share of the key's fleet window (0 while warming up), and never
    /// more than the others leave free by their last heartbeats: while shares move (a
    /// replica joined or left), calls the others still run count against the window.
    fn key_allowance(&self, st: &State) -> u32 {
        if self.now_ms() < st.warm_until_ms {
            return 0;
        }
        let fleet = st.window.fleet(self.key_limit);
        share(fleet, &st.live, &self.me).min(fleet.saturating_sub(st.others_in_flight))
    }

    fn tenant_cap(&self, st: &State, tenant: &str) -> Option<u32> {
        self.limits.get(tenant).map(|limit| share(*limit, &st.live, &self.me))
    }

    fn weight(&self, tenant: &str) -> u32 {
        self.weights.get(tenant).copied().unwrap_or(1)
    }

    /// The tenant of a scope token (`<provider>.<class>.<tenant>`).
    fn tenant_of(token: &str) -> &str {
        token.rsplit('.').next().unwrap_or(token)
    }

    /// Each wanting tenant's fair share of this replica's allowance, and its in-flight.
    fn fair(&self, st: &State, token: &str, allowance: u32) -> u32 {
        let active: u32 = st
            .in_flight
            .iter()
            .chain(st.waiting.iter())
            .filter(|(_, n)| **n > 0)
            .map(|(t, _)| t.as_str())
            .chain(std::iter::once(token))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|t| self.weight(Self::tenant_of(t)))
            .sum();
        let tenant = Self::tenant_of(token);
        fair_share(allowance, self.weight(tenant), active, self.tenant_cap(st, tenant))
    }

    /// Calls this replica may run for `scope` at most now: its share of the key's window,
    /// within the tenant's cap (0 while warming up or without a share).
    pub fn allowance(&self, scope: &Scope) -> u32 {
        let st = self.state.lock().expect("quota lock");
        let a = self.key_allowance(&st);
        self.tenant_cap(&st, &scope.tenant).map_or(a, |c| a.min(c))
    }

    /// The scope's current fair share on this replica (for the `scope_limit` gauge).
    pub fn fair_share(&self, scope: &Scope) -> u32 {
        let st = self.state.lock().expect("quota lock");
        let a = self.key_allowance(&st);
        self.fair(&st, &scope.token(), a)
    }

    /// Whether the start-up warm-up is over (the replica may take a share).
    pub fn warmed_up(&self) -> bool {
        self.now_ms() >= self.state.lock().expect("quota lock").warm_until_ms
    }

    /// The key's fleet window now.
    pub fn fleet_window(&self) -> u32 {
        self.state.lock().expect("quota lock").window.fleet(self.key_limit)
    }

    /// Calls running in `scope` on this replica.
    pub fn in_flight(&self, scope: &Scope) -> u32 {
        self.state.lock().expect("quota lock").in_flight.get(&scope.token()).copied().unwrap_or(0)
    }

    /// Counts a message of `scope` as waiting for a call until the guard drops.
    pub fn waiting(&self, scope: &Scope) -> Waiting {
        let token = scope.token();
        self.count(&token, 1, true);
        Waiting { quota: self.clone(), token }
    }

    /// Whether a call in `scope` may start: the key is not paused, this replica is under
    /// its share of the key's window, and the tenant is under its fair share or no other
    /// tenant below its own is waiting.
    fn room(&self, st: &State, token: &str) -> bool {
        let allowance = self.key_allowance(st);
        let running: u32 = st.in_flight.values().sum();
        if running >= allowance {
            return false;
        }
        let mine = st.in_flight.get(token).copied().unwrap_or(0);
        let tenant = Self::tenant_of(token);
        if self.tenant_cap(st, tenant).is_some_and(|c| mine >= c) {
            return false;
        }
        if mine < self.fair(st, token, allowance) {
            return true;
        }
        // Above its share: only while no other tenant below its own share is waiting.
        !st.waiting.iter().any(|(other, n)| {
            *n > 0 && other != token && st.in_flight.get(other).copied().unwrap_or(0) < self.fair(st, other, allowance)
        })
    }

    pub fn has_room(&self, scope: &Scope) -> bool {
        if self.paused_for(scope).is_some() {
            return false;
        }
        let st = self.state.lock().expect("quota lock");
        self.room(&st, &scope.token())
    }

    /// Starts a call in `scope` if there is room (`has_room`); `None` otherwise.
    pub fn try_start(&self, scope: &Scope) -> Option<ScopeGuard> {
        if self.paused_for(scope).is_some() {
            return None;
        }
        let token = scope.token();
        let mut st = self.state.lock().expect("quota lock");
        if !self.room(&st, &token) {
            return None;
        }
        *st.in_flight.entry(token.clone()).or_default() += 1;
        Some(ScopeGuard { quota: self.clone(), token })
    }

    /// Applies `event` to the key's window here and, when the fleet should know, to the
    /// shared entry (compare-and-set on the entry as read, re-applied on a conflict).
    async fn update_window(&self, event: impl Fn(&mut Window)) -> Result<(), async_nats::Error> {
        let (differs, local) = {
            let mut st = self.state.lock().expect("quota lock");
            let before = st.window;
            event(&mut st.window);
            (st.window.differs(&before), st.window)
        };
        if !differs {
            return Ok(());
        }
        let key = format!("{WINDOW_PREFIX}{}", self.key);
        for _ in 0..8 {
            let entry = self.kv.entry(&key).await?;
            let (mut shared, revision) = match &entry {
                Some(e) if e.operation == kv::Operation::Put => (
                    serde_json::from_slice::<Window>(&e.value).unwrap_or(Window::new(self.probe_every)),
                    Some(e.revision),
                ),
                _ => (self.state.lock().expect("quota lock").window, None),
            };
            if revision.is_some() {
                event(&mut shared);
                shared = shared.merged(&local);
            }
            let value: bytes::Bytes = serde_json::to_vec(&shared)?.into();
            let written = match revision {
                Some(r) => self
                    .kv
                    .update(&key, value, r)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.kind() == kv::UpdateErrorKind::WrongLastRevision),
                None => self
                    .kv
                    .create(&key, value)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.kind() == kv::CreateErrorKind::AlreadyExists),
            };
            match written {
                Ok(()) => {
                    let mut st = self.state.lock().expect("quota lock");
                    st.window = shared.merged(&st.window);
                    drop(st);
                    self.changed.notify_waiters();
                    return Ok(());
                }
                Err(true) => continue,
                Err(false) => return Err("writing the key's window failed".into()),
            }
        }
        Ok(())
    }

    /// Records a 429 for a call started at `started_ms`: pauses the key for every
    /// replica (keeping a later pause), and narrows the fleet's window once per event.
    pub async fn rate_limited(&self, scope: &Scope, pause: Duration, started_ms: u64) -> Result<(), async_nats::Error> {
        let now = self.now_ms();
        let limit = self.key_limit;
        self.update_window(|w| w.on_rate_limited_under(now, started_ms, pause, limit)).await?;
        self.pause(scope, pause).await
    }

    /// Pauses the key for `pause` from now, unless a later pause is already recorded.
    pub async fn pause(&self, _scope: &Scope, pause: Duration) -> Result<(), async_nats::Error> {
        let until_ms = self.now_ms() + pause.as_millis() as u64;
        let key = format!("{PAUSE_PREFIX}{}", self.key);
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
        self.note_pause(&value);
        Ok(())
    }

    /// A call started at `started_ms` succeeded: the fleet's window may grow.
    pub async fn succeeded(&self, _scope: &Scope, started_ms: u64) {
        let (now, cap) = (self.now_ms(), self.key_limit);
        if let Err(e) = self.update_window(|w| w.on_call_success(cap, now, started_ms)).await {
            tracing::warn!(error = %e, "recording the key's window failed");
        }
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
    fn tenants_share_a_replica_allowance_by_weight() {
        // Alone, a tenant takes it all.
        assert_eq!(fair_share(4, 1, 1, None), 4);
        // Two equal tenants: half each.
        assert_eq!(fair_share(4, 1, 2, None), 2);
        // Weights 3:1 of 4 calls.
        assert_eq!((fair_share(4, 3, 4, None), fair_share(4, 1, 4, None)), (3, 1));
        // Rounded up, never below one call while there is any allowance.
        assert_eq!(fair_share(3, 1, 2, None), 2);
        assert_eq!(fair_share(1, 1, 5, None), 1);
        assert_eq!(fair_share(0, 1, 1, None), 0);
        // A tenant's cap holds.
        assert_eq!(fair_share(8, 1, 1, Some(2)), 2);
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

    #[test]
    fn scope_tokens_are_subject_safe() {
        let s = Scope { provider: "openai".into(), model_class: "gpt-4.1 mini".into(), tenant: "acme".into() };
        assert_eq!(s.token(), "openai.gpt-4_1_mini.acme");
    }
}
