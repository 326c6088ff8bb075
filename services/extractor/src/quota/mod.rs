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
//! - `replica.<key>.<id>` = `{"at_ms": …, "in_flight": …}`: heartbeats on the key (a
//!   replica calling several keys beats on each), followed by every replica of the key
//!   as they are written (read once at start, never listed again). Each replica may run
//!   its share of the
//!   window among the live replicas (rank-ordered, so the shares sum to the window, and
//!   the minimum of one call holds for the fleet, not per replica). A replica whose
//!   heartbeat expires drops out of the ranks at once: the survivors take its share on
//!   their next heartbeat. A starting replica heartbeats for two periods before it takes
//!   a share, so the others see it first and the shares never sum above the window.
//! - `pause.<key>` = `{"until_ms": …}`: a 429 pauses the key, once, for every replica
//!   (compare-and-set keeps the later time).
//! - `bucket.<key>.<dimension>` = a `Bucket`: one metered dimension of the key
//!   (requests, tokens, input or output tokens per minute, tokens per day) for the
//!   whole fleet. A replica takes a slice of it in one compare-and-set and spends it
//!   call by call without another (`slice`); a provider's reading that lowers it is
//!   one more. A replica starting adopts the limits the fleet learned.
//! - `circuit.<key>` = `{"until_ms": …, "cause": …}`: the key out of routing
//!   (`CircuitCause`): a 429 `insufficient_quota` (the account is out of money), a refused
//!   key (401/403), or transient failures in a row. Until then another deployment of the
//!   class takes its reviews (`pool`); with none, a review ends at once for the account
//!   or the key, and is called as usual (a probe) for a failing deployment.
//!
//! Within a replica's share, tenants take calls by weight (`fair_share`): a tenant below
//! its weighted share is served before one above it, and a tenant alone takes it all.
//! A tenant's `scope_limit` caps it across the fleet.
//!
//! The rooms: `scope` (names), `share` and `window` (pure arithmetic), `bucket` (one
//! metered dimension as a token bucket with continuous refill, corrected by usage and
//! the provider's readings; pure), `slice` (a replica's slice of a bucket; pure), `limits` (each dimension's limit, configured or
//! learned from the headers; pure), `ledger` (the pure decisions of room, fairness and tenant caps, given the time), `fleet` (the
//! protocol on `QUOTA_<R>`, one compare-and-set step, a typed error), and here the
//! key-wide facade the scheduler and the worker call: what acts on the key takes no
//! scope.

pub mod bucket;
mod budgets;
mod fleet;
mod ledger;
mod limits;
mod scope;
mod share;
mod slice;
mod window;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::kv;
use reviewlane_core::clock::SharedClock;
use tokio::sync::Notify;

pub use budgets::{Budgets, Reservation};
pub use fleet::{FleetError, KvCounts};
use ledger::Ledger;
pub use scope::{KeyConfig, Scope};
pub use share::{fair_share, share};
pub use window::{Congestion, RateLimited, Window};

/// Shared quota state of this replica for its provider key. Cheap to clone.
#[derive(Clone)]
pub struct Quota {
    kv: kv::Store,
    client: async_nats::Client,
    me: String,
    /// The provider key (account) token: `<provider>.<key id>`.
    key: String,
    heartbeat: Duration,
    ledger: Arc<Mutex<Ledger>>,
    /// Woken whenever a pause, a share, the window or an in-flight count changes.
    pub changed: Arc<Notify>,
    /// Pause times, heartbeats and windows are judged on this clock.
    clock: SharedClock,
    /// The key's metered budgets: every call reserves its cost in each before it
    /// starts (`Budgets::reserve_call`).
    budgets: Budgets,
    /// This replica's operations on `QUOTA_<R>`, its budgets' included.
    tally: Arc<fleet::KvTally>,
    /// Every replica's last heartbeat, as followed on `QUOTA_<R>`.
    heartbeats: Arc<Mutex<std::collections::BTreeMap<String, fleet::Heartbeat>>>,
    /// Until when (clock ms) the key's budgets last refused a call here: another
    /// deployment of the class takes reviews meanwhile.
    refused_until_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Transient failures in a row on this replica (a success starts over).
    failures: Arc<std::sync::atomic::AtomicU32>,
}

/// Why a key's circuit is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitCause {
    /// 429 `insufficient_quota`: the account is out of money.
    #[default]
    InsufficientQuota,
    /// 401 or 403: the key is refused.
    KeyRefused,
    /// Transient failures (5xx, timeouts) one after another.
    Failing,
}

impl CircuitCause {
    pub fn as_str(self) -> &'static str {
        match self {
            CircuitCause::InsufficientQuota => "insufficient_quota",
            CircuitCause::KeyRefused => "key_refused",
            CircuitCause::Failing => "failing",
        }
    }
}

/// A 429, as the key's quota learns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    /// How long every replica's calls on the key wait.
    pub pause: Duration,
    /// When the refused call started.
    pub started_ms: u64,
    /// The fleet's calls in flight when it started (itself included), if known.
    pub in_flight: Option<u32>,
    /// The metered dimension it was refused for, when the answer names one.
    pub bucket: Option<reviewlane_core::meter::Dimension>,
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
        let ledger = Ledger::new(me.clone(), key.limit, key.tenant_limits, key.weights, Window::new(probe_every));
        let tally = Arc::new(fleet::KvTally::default());
        let budgets = Budgets::new(kv.clone(), key.key.clone(), clock.clone(), tally.clone());
        Quota {
            kv,
            client,
            me,
            key: key.key,
            heartbeat,
            ledger: Arc::new(Mutex::new(ledger)),
            changed: Arc::new(Notify::new()),
            clock,
            budgets,
            tally,
            heartbeats: Arc::default(),
            refused_until_ms: Arc::default(),
            failures: Arc::default(),
        }
    }

    /// The quota of another key this replica calls (another deployment of the pool): its
    /// own window, pause, circuit and budgets, under the same replica id, and waking the
    /// same waiters when it changes.
    pub fn another_key(&self, key: KeyConfig, probe_every: Duration) -> Quota {
        let ledger = Ledger::new(self.me.clone(), key.limit, key.tenant_limits, key.weights, Window::new(probe_every));
        let tally = Arc::new(fleet::KvTally::default());
        let budgets = Budgets::new(self.kv.clone(), key.key.clone(), self.clock.clone(), tally.clone());
        Quota {
            kv: self.kv.clone(),
            client: self.client.clone(),
            me: self.me.clone(),
            key: key.key,
            heartbeat: self.heartbeat,
            ledger: Arc::new(Mutex::new(ledger)),
            changed: self.changed.clone(),
            clock: self.clock.clone(),
            budgets,
            tally,
            heartbeats: Arc::default(),
            refused_until_ms: Arc::default(),
            failures: Arc::default(),
        }
    }

    /// The key's budgets refused a call that would have room after `wait`.
    pub fn refused_for(&self, wait: Duration) {
        let until = self.now_ms() + wait.as_millis() as u64;
        self.refused_until_ms.fetch_max(until, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the key's budgets refused a call here that they have no room for yet.
    pub fn refusing(&self) -> bool {
        self.now_ms() < self.refused_until_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The key's token, `<provider>.<key id>`.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// This replica's quota operations on `QUOTA_<R>` so far.
    pub fn kv_counts(&self) -> KvCounts {
        self.tally.counts()
    }

    /// The key's configured limits (requests, tokens, ...) that calls reserve from;
    /// the others are learned from the answers' headers.
    pub fn with_budgets(self, budgets: Vec<(reviewlane_core::meter::Dimension, u64)>) -> Quota {
        self.budgets.configure(budgets);
        self
    }

    /// The dimensions the provider enforces over a shorter window than their period
    /// (`Budgets::windows`); before any call is made.
    pub fn enforced_over(mut self, windows: Vec<(reviewlane_core::meter::Dimension, Duration)>) -> Quota {
        self.budgets.enforce_over(windows);
        self
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().expect("quota lock")
    }

    /// The key's metered budgets (requests, tokens, ...), shared by the fleet.
    pub fn budgets(&self) -> &Budgets {
        &self.budgets
    }

    /// The fleet's calls in flight on the key, as this replica knows them: its own, and
    /// the others' by their last heartbeats.
    pub fn fleet_in_flight(&self) -> u32 {
        let l = self.ledger();
        l.in_flight.values().sum::<u32>() + l.others_in_flight
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// This replica's id (its heartbeat key, and the owner it writes into leases).
    pub fn replica_id(&self) -> &str {
        &self.me
    }

    fn count(&self, token: &str, by: i32, waiting: bool) {
        self.ledger().count(token, by, waiting);
        self.changed.notify_waiters();
    }

    /// Whether the key's circuit is open: out of routing for its cause.
    pub fn circuit_open(&self) -> bool {
        self.ledger().circuit_open(self.now_ms())
    }

    /// Why the key's circuit is open, if it is.
    pub fn circuit_cause(&self) -> Option<CircuitCause> {
        let l = self.ledger();
        l.circuit_open(self.now_ms()).then_some(l.circuit_cause)
    }

    /// Opens the key's circuit for `open_for` on every replica, for `cause`: until then
    /// another deployment of the class takes its reviews, or — none able — they end
    /// without a call (`insufficient_quota`, a refused key) or are called as usual (a
    /// failing deployment: each call a probe). After it, the next call probes it again.
    pub async fn open_circuit(&self, cause: CircuitCause, open_for: Duration) -> Result<(), FleetError> {
        self.share_circuit(self.now_ms() + open_for.as_millis() as u64, cause).await
    }

    /// A call on the key failed transiently (5xx, a timeout, a reset): `true` when it is
    /// the `threshold`-th in a row on this replica, and the count starts over.
    pub fn failed_in_a_row(&self, threshold: u32) -> bool {
        let n = self.failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if n >= threshold {
            self.failures.store(0, std::sync::atomic::Ordering::Relaxed);
            return true;
        }
        false
    }

    /// How long the key is still paused, if it is.
    pub fn paused_for(&self) -> Option<Duration> {
        self.ledger().paused_for(self.now_ms())
    }

    /// Calls this replica may run for `scope` at most now: its share of the key's window,
    /// within the tenant's cap (0 while warming up or without a share).
    pub fn allowance(&self, scope: &Scope) -> u32 {
        self.ledger().allowance(&scope.tenant, self.now_ms())
    }

    /// The scope's current fair share on this replica (for the `scope_limit` gauge).
    pub fn fair_share(&self, scope: &Scope) -> u32 {
        let now = self.now_ms();
        let l = self.ledger();
        l.fair(&scope.token(), l.key_allowance(now))
    }

    /// Whether the start-up warm-up is over (the replica may take a share).
    pub fn warmed_up(&self) -> bool {
        self.ledger().warmed_up(self.now_ms())
    }

    /// The key's fleet window now.
    pub fn fleet_window(&self) -> u32 {
        let l = self.ledger();
        l.window.fleet(l.key_limit)
    }

    /// Calls running in `scope` on this replica.
    pub fn in_flight(&self, scope: &Scope) -> u32 {
        self.ledger().in_flight.get(&scope.token()).copied().unwrap_or(0)
    }

    /// Counts a message of `scope` as waiting for a call until the guard drops.
    pub fn waiting(&self, scope: &Scope) -> Waiting {
        let token = scope.token();
        self.count(&token, 1, true);
        Waiting { quota: self.clone(), token }
    }

    /// Whether a call in `scope` may start now (see `Ledger::room`).
    pub fn has_room(&self, scope: &Scope) -> bool {
        self.ledger().room(&scope.token(), self.now_ms())
    }

    /// Starts a call in `scope` if there is room (`has_room`); `None` otherwise.
    pub fn try_start(&self, scope: &Scope) -> Option<ScopeGuard> {
        let token = scope.token();
        let now = self.now_ms();
        self.ledger().start(&token, now).then(|| ScopeGuard { quota: self.clone(), token })
    }

    /// Records a 429: pauses the key for every replica (keeping a later pause); a 429 of
    /// a metered dimension (`bucket`) the key has a limit for empties that bucket and
    /// leaves the window alone,
    /// any other narrows the fleet's window once per event (unless it was a race between
    /// replicas, `Window::on_congestion`).
    pub async fn rate_limited(&self, limited: Limited) -> Result<(), FleetError> {
        let Limited { pause, started_ms, in_flight, bucket } = limited;
        // A dimension the key has no limit for has no bucket to lower: the window takes
        // it (a provider that says `requests` for calls in flight, as some do).
        let bucket = bucket.filter(|d| self.budgets.limits_dimension(*d));
        match bucket {
            Some(dim) => self.budgets.drain(dim).await,
            None => {
                let now = self.now_ms();
                let (limit, changed_ms) = {
                    let l = self.ledger();
                    (l.key_limit, l.live_changed_ms)
                };
                // Within two heartbeats of a change in the live replicas, shares move.
                let shares_moving = now.saturating_sub(changed_ms) <= 2 * self.heartbeat.as_millis() as u64;
                let c = RateLimited { now_ms: now, started_ms, pause, limit, in_flight, shares_moving };
                if self.update_window(|w| w.on_congestion(c)).await? == Congestion::Race {
                    tracing::info!("429 while the fleet ran above its window (replicas racing): level kept");
                }
            }
        }
        self.pause(pause).await
    }

    /// Pauses the key for `pause` from now, unless a later pause is already recorded.
    pub async fn pause(&self, pause: Duration) -> Result<(), FleetError> {
        self.share_pause(self.now_ms() + pause.as_millis() as u64).await
    }

    /// A call started at `started_ms` succeeded: the fleet's window may grow.
    pub async fn succeeded(&self, started_ms: u64) {
        self.failures.store(0, std::sync::atomic::Ordering::Relaxed);
        let now = self.now_ms();
        let cap = self.ledger().key_limit;
        if let Err(e) = self.update_window(|w| w.on_call_success(cap, now, started_ms)).await {
            tracing::warn!(error = %e, "recording the key's window failed");
        }
    }
}
