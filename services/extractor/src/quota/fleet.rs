//! The fleet protocol on KV `QUOTA_<R>`: what the replicas of a region share about a
//! key — its window, its pause, its circuit, their heartbeats — written with one
//! compare-and-set step ([`cas`]) and followed by subscription.

use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::jetstream::kv;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{Quota, Window};

pub(super) const PAUSE_PREFIX: &str = "pause.";
pub(super) const CIRCUIT_PREFIX: &str = "circuit.";
pub(super) const WINDOW_PREFIX: &str = "window.";
pub(super) const REPLICA_PREFIX: &str = "replica.";

/// Compare-and-set tries before giving up on a contended entry.
const CAS_TRIES: usize = 8;

/// Why a write of the key's shared state failed.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("quota store: {0}")]
    Store(async_nats::Error),
    #[error("the key's shared state kept changing under the compare-and-set")]
    Contended,
    #[error("quota value not encodable: {0}")]
    Encode(#[from] serde_json::Error),
}

impl FleetError {
    pub(super) fn store(e: impl Into<async_nats::Error>) -> Self {
        FleetError::Store(e.into())
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Pause {
    pub until_ms: u64,
}

/// A key's open circuit; an entry without a cause was written for `insufficient_quota`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Circuit {
    pub until_ms: u64,
    #[serde(default)]
    pub cause: super::CircuitCause,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(super) struct Heartbeat {
    at_ms: u64,
    /// Calls this replica had running on the key when it beat.
    #[serde(default)]
    in_flight: u32,
}

/// What a replica's quota did on `QUOTA_<R>`, counted as it goes.
#[derive(Debug, Default)]
pub(super) struct KvTally {
    reads: AtomicU64,
    writes: AtomicU64,
    conflicts: AtomicU64,
}

/// A replica's quota operations on `QUOTA_<R>` so far: reads (an entry, a key listing),
/// writes (a put, an update, a create, a delete) and compare-and-set conflicts (a write
/// refused because another replica wrote first).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct KvCounts {
    pub reads: u64,
    pub writes: u64,
    pub conflicts: u64,
}

impl KvTally {
    pub(super) fn read(&self) {
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    fn conflict(&self) {
        self.conflicts.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn counts(&self) -> KvCounts {
        KvCounts {
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            conflicts: self.conflicts.load(Ordering::Relaxed),
        }
    }
}

/// One compare-and-set on `key`: `next` says what to write given the value there (or
/// `None` to leave it as it is); it is written from the revision read (or created), and
/// on a lost race read and asked again. The value written, or `None` when left.
pub(super) async fn cas<T: Serialize + DeserializeOwned>(
    kv: &kv::Store,
    tally: &KvTally,
    key: &str,
    mut next: impl FnMut(Option<T>) -> Option<T>,
) -> Result<Option<T>, FleetError> {
    for _ in 0..CAS_TRIES {
        tally.read();
        let entry = kv.entry(key).await.map_err(FleetError::store)?;
        let (current, revision) = match &entry {
            Some(e) if e.operation == kv::Operation::Put => {
                (serde_json::from_slice::<T>(&e.value).ok(), Some(e.revision))
            }
            _ => (None, None),
        };
        let Some(value) = next(current) else { return Ok(None) };
        let bytes: bytes::Bytes = serde_json::to_vec(&value)?.into();
        tally.wrote();
        let written = match revision {
            Some(r) => match kv.update(key, bytes, r).await {
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => false,
                other => other.map(|_| true).map_err(FleetError::store)?,
            },
            None => match kv.create(key, bytes).await {
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => false,
                other => other.map(|_| true).map_err(FleetError::store)?,
            },
        };
        if written {
            return Ok(Some(value));
        }
        tally.conflict();
    }
    Err(FleetError::Contended)
}

/// [`cas`] for an entry every replica draws from at once (a bucket): after a round of
/// lost races, a short random pause spreads the contenders out before the next round.
/// At most `ROUNDS` rounds; the pause is a few milliseconds and no lease is held.
pub(super) async fn cas_spread<T: Serialize + DeserializeOwned>(
    kv: &kv::Store,
    tally: &KvTally,
    key: &str,
    mut next: impl FnMut(Option<T>) -> Option<T>,
) -> Result<Option<T>, FleetError> {
    const ROUNDS: u32 = 8;
    for round in 0..ROUNDS {
        match cas(kv, tally, key, &mut next).await {
            Err(FleetError::Contended) if round + 1 < ROUNDS => {
                let ms = rand::random_range(1..=(2u64 << round));
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            other => return other,
        }
    }
    Err(FleetError::Contended)
}

impl Quota {
    /// Announces this replica, loads the key's pause, circuit and window, and keeps them
    /// current until `stop`.
    pub async fn start(&self, stop: CancellationToken) -> Result<(), FleetError> {
        // Follow first, then read what is there: nothing falls in between.
        let prefix = self.kv.prefix.clone();
        let subscribe = |what: &str| self.client.subscribe(format!("{prefix}{what}{}", self.key));
        let mut pauses = subscribe(PAUSE_PREFIX).await.map_err(FleetError::store)?;
        let mut circuits = subscribe(CIRCUIT_PREFIX).await.map_err(FleetError::store)?;
        let mut windows = subscribe(WINDOW_PREFIX).await.map_err(FleetError::store)?;
        // Every replica's heartbeat, followed as it is written: no replica reads all the
        // others' every period (N² reads a second for the fleet).
        let mut beats =
            self.client.subscribe(format!("{prefix}{}*", self.replicas())).await.map_err(FleetError::store)?;
        self.beat().await?;
        self.load_heartbeats().await?;
        self.refresh_live().await;
        self.budgets.adopt_learned().await?;
        // Others that start now must see this replica before it takes a share.
        self.ledger().warm_until_ms = self.now_ms() + 2 * self.heartbeat.as_millis() as u64;
        for (what, note) in [
            (PAUSE_PREFIX, Quota::note_pause as fn(&Quota, &[u8])),
            (CIRCUIT_PREFIX, Quota::note_circuit),
            (WINDOW_PREFIX, Quota::note_window),
        ] {
            self.tally.read();
            if let Some(v) = self.kv.get(format!("{what}{}", self.key)).await.map_err(FleetError::store)? {
                note(self, &v);
            }
        }
        let q = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(q.heartbeat);
            loop {
                tokio::select! {
                    m = pauses.next() => match m { Some(m) => q.note_pause(&m.payload), None => return },
                    m = circuits.next() => match m { Some(m) => q.note_circuit(&m.payload), None => return },
                    m = windows.next() => match m { Some(m) => q.note_window(&m.payload), None => return },
                    m = beats.next() => match m { Some(m) => q.note_heartbeat(&m), None => return },
                    _ = tick.tick() => {
                        if let Err(e) = q.beat().await { tracing::warn!(error = %e, "heartbeat failed"); }
                        q.refresh_live().await;
                        // A pause or the warm-up may end without a message.
                        q.changed.notify_waiters();
                    }
                    _ = stop.cancelled() => {
                        q.tally.wrote();
                        let _ = q.kv.delete(format!("{}{}", q.replicas(), q.me)).await;
                        return;
                    }
                }
            }
        });
        Ok(())
    }

    pub(super) fn note_pause(&self, value: &[u8]) {
        let Ok(p) = serde_json::from_slice::<Pause>(value) else { return };
        let mut l = self.ledger();
        l.paused_until_ms = l.paused_until_ms.max(p.until_ms);
        drop(l);
        self.changed.notify_waiters();
    }

    fn note_circuit(&self, value: &[u8]) {
        let Ok(c) = serde_json::from_slice::<Circuit>(value) else { return };
        let mut l = self.ledger();
        if c.until_ms >= l.circuit_until_ms {
            (l.circuit_until_ms, l.circuit_cause) = (c.until_ms, c.cause);
        }
        drop(l);
        self.changed.notify_waiters();
    }

    fn note_window(&self, value: &[u8]) {
        let Ok(w) = serde_json::from_slice::<Window>(value) else { return };
        let mut l = self.ledger();
        l.window = w.merged(&l.window);
        drop(l);
        self.changed.notify_waiters();
    }

    /// Records the key's circuit open until `until_ms`, for `cause`, for every replica.
    pub(super) async fn share_circuit(&self, until_ms: u64, cause: super::CircuitCause) -> Result<(), FleetError> {
        let value = serde_json::to_vec(&Circuit { until_ms, cause })?;
        self.tally.wrote();
        self.kv.put(format!("{CIRCUIT_PREFIX}{}", self.key), value.clone().into()).await.map_err(FleetError::store)?;
        self.note_circuit(&value);
        Ok(())
    }

    /// Records the key paused until `until_ms` for every replica, unless a later pause
    /// is already recorded.
    pub(super) async fn share_pause(&self, until_ms: u64) -> Result<(), FleetError> {
        let key = format!("{PAUSE_PREFIX}{}", self.key);
        cas(&self.kv, &self.tally, &key, |current: Option<Pause>| {
            current.is_none_or(|p| p.until_ms < until_ms).then_some(Pause { until_ms })
        })
        .await?;
        self.note_pause(&serde_json::to_vec(&Pause { until_ms })?);
        Ok(())
    }

    async fn beat(&self) -> Result<(), FleetError> {
        let in_flight = self.ledger().in_flight.values().sum();
        let v = serde_json::to_vec(&Heartbeat { at_ms: self.now_ms(), in_flight })?;
        self.tally.wrote();
        self.kv.put(format!("{}{}", self.replicas(), self.me), v.into()).await.map_err(FleetError::store)?;
        Ok(())
    }

    /// The prefix of the key's heartbeats, `replica.<key>.`: each key counts its own
    /// replicas (a replica calling several keys beats once on each, with its calls on
    /// that key).
    fn replicas(&self) -> String {
        format!("{REPLICA_PREFIX}{}.", self.key)
    }

    /// Reads every replica's heartbeat once (at start; later ones arrive as written).
    /// A failed read fails the start rather than shrink the ranks.
    async fn load_heartbeats(&self) -> Result<(), FleetError> {
        self.tally.read();
        let prefix = self.replicas();
        let keys =
            reviewlane_shared::kv_listing::keys(&self.kv, &format!("{prefix}>")).await.map_err(FleetError::store)?;
        for key in &keys {
            let Some(id) = key.strip_prefix(&prefix) else { continue };
            self.tally.read();
            let Some(v) = self.kv.get(key).await.map_err(FleetError::store)? else { continue };
            if let Ok(h) = serde_json::from_slice::<Heartbeat>(&v) {
                self.heartbeats.lock().expect("heartbeats lock").entry(id.to_string()).or_insert(h);
            }
        }
        Ok(())
    }

    /// A heartbeat written (or removed) by a replica, as `QUOTA_<R>` delivers it.
    fn note_heartbeat(&self, m: &async_nats::Message) {
        let Some(id) = m.subject.as_str().rsplit_once(&self.replicas()).map(|(_, id)| id.to_string()) else { return };
        let removed = reviewlane_shared::kv_listing::is_removal(m.headers.as_ref());
        let mut beats = self.heartbeats.lock().expect("heartbeats lock");
        match serde_json::from_slice::<Heartbeat>(&m.payload) {
            Ok(h) if !removed => {
                beats.insert(id, h);
            }
            _ => {
                beats.remove(&id);
            }
        }
    }

    /// Works out the live replicas from the heartbeats followed.
    async fn refresh_live(&self) {
        // Six periods: a replica starved of CPU for a few heartbeats (its calls still
        // running) keeps its rank, so the others do not take its share and run its calls
        // again on top of it; a dead one's lease outlasts this anyway.
        let stale_after = 6 * self.heartbeat.as_millis() as u64;
        let now = self.now_ms();
        let mut live: Vec<String> = Vec::new();
        let mut others_in_flight = 0;
        let mut long_dead = Vec::new();
        for (id, h) in self.heartbeats.lock().expect("heartbeats lock").iter() {
            if now.saturating_sub(h.at_ms) <= stale_after {
                if *id != self.me {
                    others_in_flight += h.in_flight;
                }
                live.push(id.clone());
            } else if now.saturating_sub(h.at_ms) > 10 * stale_after {
                long_dead.push(id.clone());
            }
        }
        // Long dead: tidy up (each removal reaches every replica as a delete).
        for id in long_dead {
            self.tally.wrote();
            let _ = self.kv.delete(format!("{}{id}", self.replicas())).await;
        }
        if !live.contains(&self.me) {
            live.push(self.me.clone());
        }
        let mut l = self.ledger();
        let (live, missing) = super::share::ranks(&l.live, &l.missing, live);
        l.missing = missing;
        l.others_in_flight = others_in_flight;
        if l.live != live {
            tracing::info!(replicas = live.len(), was = l.live.len(), "live replicas on the key changed");
            l.live = live;
            l.live_changed_ms = now;
            drop(l);
            self.changed.notify_waiters();
        }
    }

    /// Applies `event` to the key's window here and, when the fleet should know, to the
    /// shared entry (the event re-applied to the entry as read, merged with ours).
    /// What the event said, as last applied (to the shared entry when it was written).
    pub(super) async fn update_window<T>(&self, event: impl Fn(&mut Window) -> T) -> Result<T, FleetError> {
        let (differs, local, level_before, mut value) = {
            let mut l = self.ledger();
            let before = l.window;
            let value = event(&mut l.window);
            (l.window.differs(&before), l.window, before.fleet(l.key_limit), value)
        };
        if !differs {
            return Ok(value);
        }
        let key = format!("{WINDOW_PREFIX}{}", self.key);
        let written = cas(&self.kv, &self.tally, &key, |shared: Option<Window>| {
            Some(match shared {
                Some(mut shared) => {
                    value = event(&mut shared);
                    shared.merged(&local)
                }
                None => local,
            })
        })
        .await?;
        if let Some(shared) = written {
            let mut l = self.ledger();
            l.window = shared.merged(&l.window);
            let after = l.window.fleet(l.key_limit);
            drop(l);
            if after != level_before {
                tracing::info!(window = after, was = level_before, "the key's congestion window changed");
            }
            self.changed.notify_waiters();
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use reviewlane_core::clock::{ManualClock, SharedClock};
    use reviewlane_shared::Region;
    use reviewlane_shared::testing::NatsServer;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::quota::KeyConfig;

    async fn quota_store(nats: &NatsServer) -> (kv::Store, async_nats::Client) {
        let client = async_nats::connect(nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client.clone());
        let layout = reviewlane_shared::layout::ensure(&js, Region::Us, &Default::default()).await.unwrap();
        (layout.quota, client)
    }

    fn replica(kv: &kv::Store, client: &async_nats::Client, clock: SharedClock) -> Quota {
        replica_of("openai.k", kv, client, clock)
    }

    fn replica_of(key: &str, kv: &kv::Store, client: &async_nats::Client, clock: SharedClock) -> Quota {
        let key =
            KeyConfig { key: key.into(), limit: 8, tenant_limits: Default::default(), weights: Default::default() };
        Quota::new(kv.clone(), client.clone(), key, Duration::from_millis(100), Duration::from_secs(60), clock)
    }

    /// Polls `cond` every 20 ms for up to 10 s.
    async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
        for _ in 0..500 {
            if cond() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_compare_and_sets_on_one_entry_lose_no_update() {
        let nats = NatsServer::start_provisioned(Region::Us).await;
        let (kv, _client) = quota_store(&nats).await;
        let writers =
            (0..16).map(|_| {
                let kv = kv.clone();
                async move {
                    cas_spread::<u64>(&kv, &KvTally::default(), "window.counter", |n| Some(n.unwrap_or(0) + 1)).await
                }
            });
        let written = futures::future::join_all(writers).await;
        assert!(written.iter().all(Result::is_ok), "{written:?}");
        let stored: u64 = serde_json::from_slice(&kv.get("window.counter").await.unwrap().unwrap()).unwrap();
        assert_eq!(stored, 16, "every increment kept");
        // A step that leaves the entry as it is writes nothing.
        assert_eq!(cas::<u64>(&kv, &KvTally::default(), "window.counter", |_| None).await.unwrap(), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pause_and_an_open_circuit_reach_every_replica_and_end_on_the_clock() {
        let nats = NatsServer::start_provisioned(Region::Us).await;
        let (kv, client) = quota_store(&nats).await;
        let clock = ManualClock::at(1_000_000);
        let (a, b) = (replica(&kv, &client, clock.clone()), replica(&kv, &client, clock.clone()));
        let stop = CancellationToken::new();
        a.start(stop.clone()).await.unwrap();
        b.start(stop.clone()).await.unwrap();

        a.pause(Duration::from_secs(3)).await.unwrap();
        assert!(eventually(|| b.paused_for() == Some(Duration::from_secs(3))).await, "b follows a's pause");
        // A shorter pause does not shorten the longer one.
        b.pause(Duration::from_secs(1)).await.unwrap();
        assert_eq!(a.paused_for(), Some(Duration::from_secs(3)));
        clock.advance(Duration::from_secs(3));
        assert_eq!((a.paused_for(), b.paused_for()), (None, None), "over on the clock, with no message");

        b.open_circuit(super::super::CircuitCause::InsufficientQuota, Duration::from_secs(60)).await.unwrap();
        assert!(eventually(|| a.circuit_open()).await, "a follows b's open circuit");
        // A replica starting later reads what is there.
        let late = replica(&kv, &client, clock.clone());
        late.start(stop.clone()).await.unwrap();
        assert!(late.circuit_open());
        clock.advance(Duration::from_secs(60));
        assert!(!a.circuit_open() && !late.circuit_open());
        stop.cancel();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replicas_see_each_others_heartbeats_and_a_stopped_one_leaves() {
        let nats = NatsServer::start_provisioned(Region::Us).await;
        let (kv, client) = quota_store(&nats).await;
        let clock: SharedClock = reviewlane_core::clock::system();
        let (a, b) = (replica(&kv, &client, clock.clone()), replica(&kv, &client, clock.clone()));
        let (stop_a, stop_b) = (CancellationToken::new(), CancellationToken::new());
        a.start(stop_a.clone()).await.unwrap();
        b.start(stop_b.clone()).await.unwrap();
        let live = |q: &Quota| q.ledger().live.len();
        assert!(eventually(|| live(&a) == 2 && live(&b) == 2).await, "each sees two replicas");
        stop_b.cancel();
        assert!(eventually(|| live(&a) == 1).await, "a stopped replica's heartbeat is removed");
        stop_a.cancel();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_key_counts_only_the_replicas_calling_it() {
        // One process calling two deployments beats on each key: neither key's window is
        // shared with the calls of the other.
        let nats = NatsServer::start_provisioned(Region::Us).await;
        let (kv, client) = quota_store(&nats).await;
        let clock: SharedClock = reviewlane_core::clock::system();
        let stop = CancellationToken::new();
        let (a1, a2) =
            (replica_of("openai.a", &kv, &client, clock.clone()), replica_of("openai.a", &kv, &client, clock.clone()));
        let b = replica_of("azure.b", &kv, &client, clock.clone());
        for q in [&a1, &a2, &b] {
            q.start(stop.clone()).await.unwrap();
        }
        let live = |q: &Quota| q.ledger().live.len();
        assert!(eventually(|| live(&a1) == 2 && live(&a2) == 2).await, "key a: its two replicas");
        // Heartbeats have gone round several times: b still counts itself alone.
        let beats = clock.now_ms();
        assert!(eventually(|| clock.now_ms() >= beats + 300).await);
        assert_eq!(live(&b), 1, "key b: only its own replica");
        assert_eq!(live(&a1), 2);
        stop.cancel();
    }
}
