//! The fleet protocol on KV `QUOTA_<R>`: what the replicas of a region share about a
//! key — its window, its pause, its circuit, their heartbeats — written with one
//! compare-and-set step ([`cas`]) and followed by subscription.

use async_nats::jetstream::kv;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::bucket::{Bucket, Refused};
use super::{Quota, Window};
use reviewlane_core::meter::{Cost, Dimension, Reading};

pub(super) const PAUSE_PREFIX: &str = "pause.";
pub(super) const CIRCUIT_PREFIX: &str = "circuit.";
pub(super) const WINDOW_PREFIX: &str = "window.";
pub(super) const REPLICA_PREFIX: &str = "replica.";
/// `bucket.<key>.<dimension>`: one metered dimension of the key, for the whole fleet.
pub(super) const BUCKET_PREFIX: &str = "bucket.";

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
    fn store(e: impl Into<async_nats::Error>) -> Self {
        FleetError::Store(e.into())
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Pause {
    pub until_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Heartbeat {
    at_ms: u64,
    /// Calls this replica had running on the key when it beat.
    #[serde(default)]
    in_flight: u32,
}

/// One compare-and-set on `key`: `next` says what to write given the value there (or
/// `None` to leave it as it is); it is written from the revision read (or created), and
/// on a lost race read and asked again. The value written, or `None` when left.
pub(super) async fn cas<T: Serialize + DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
    mut next: impl FnMut(Option<T>) -> Option<T>,
) -> Result<Option<T>, FleetError> {
    for _ in 0..CAS_TRIES {
        let entry = kv.entry(key).await.map_err(FleetError::store)?;
        let (current, revision) = match &entry {
            Some(e) if e.operation == kv::Operation::Put => {
                (serde_json::from_slice::<T>(&e.value).ok(), Some(e.revision))
            }
            _ => (None, None),
        };
        let Some(value) = next(current) else { return Ok(None) };
        let bytes: bytes::Bytes = serde_json::to_vec(&value)?.into();
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
    }
    Err(FleetError::Contended)
}

/// [`cas`] for an entry every replica draws from at once (a bucket): after a round of
/// lost races, a short random pause spreads the contenders out before the next round.
/// At most `ROUNDS` rounds; the pause is a few milliseconds and no lease is held.
async fn cas_spread<T: Serialize + DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
    mut next: impl FnMut(Option<T>) -> Option<T>,
) -> Result<Option<T>, FleetError> {
    const ROUNDS: u32 = 8;
    for round in 0..ROUNDS {
        match cas(kv, key, &mut next).await {
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
        self.beat().await?;
        self.refresh_live().await?;
        self.adopt_learned().await?;
        // Others that start now must see this replica before it takes a share.
        self.ledger().warm_until_ms = self.now_ms() + 2 * self.heartbeat.as_millis() as u64;
        for (what, note) in [
            (PAUSE_PREFIX, Quota::note_pause as fn(&Quota, &[u8])),
            (CIRCUIT_PREFIX, Quota::note_circuit),
            (WINDOW_PREFIX, Quota::note_window),
        ] {
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

    pub(super) fn note_pause(&self, value: &[u8]) {
        let Ok(p) = serde_json::from_slice::<Pause>(value) else { return };
        let mut l = self.ledger();
        l.paused_until_ms = l.paused_until_ms.max(p.until_ms);
        drop(l);
        self.changed.notify_waiters();
    }

    fn note_circuit(&self, value: &[u8]) {
        let Ok(p) = serde_json::from_slice::<Pause>(value) else { return };
        let mut l = self.ledger();
        l.circuit_until_ms = l.circuit_until_ms.max(p.until_ms);
    }

    fn note_window(&self, value: &[u8]) {
        let Ok(w) = serde_json::from_slice::<Window>(value) else { return };
        let mut l = self.ledger();
        l.window = w.merged(&l.window);
        drop(l);
        self.changed.notify_waiters();
    }

    /// Records the key's circuit open until `until_ms` for every replica.
    pub(super) async fn share_circuit(&self, until_ms: u64) -> Result<(), FleetError> {
        let value = serde_json::to_vec(&Pause { until_ms })?;
        self.kv.put(format!("{CIRCUIT_PREFIX}{}", self.key), value.clone().into()).await.map_err(FleetError::store)?;
        self.note_circuit(&value);
        Ok(())
    }

    /// Records the key paused until `until_ms` for every replica, unless a later pause
    /// is already recorded.
    pub(super) async fn share_pause(&self, until_ms: u64) -> Result<(), FleetError> {
        let key = format!("{PAUSE_PREFIX}{}", self.key);
        cas(&self.kv, &key, |current: Option<Pause>| {
            current.is_none_or(|p| p.until_ms < until_ms).then_some(Pause { until_ms })
        })
        .await?;
        self.note_pause(&serde_json::to_vec(&Pause { until_ms })?);
        Ok(())
    }

    async fn beat(&self) -> Result<(), FleetError> {
        let in_flight = self.ledger().in_flight.values().sum();
        let v = serde_json::to_vec(&Heartbeat { at_ms: self.now_ms(), in_flight })?;
        self.kv.put(format!("{REPLICA_PREFIX}{}", self.me), v.into()).await.map_err(FleetError::store)?;
        Ok(())
    }

    /// Re-reads the live replicas; returns how many others there are.
    async fn refresh_live(&self) -> Result<usize, FleetError> {
        // Six periods: a replica starved of CPU for a few heartbeats (its calls still
        // running) keeps its rank, so the others do not take its share and run its calls
        // again on top of it; a dead one's lease outlasts this anyway.
        let stale_after = 6 * self.heartbeat.as_millis() as u64;
        let now = self.now_ms();
        let mut live: Vec<String> = Vec::new();
        let mut others_in_flight = 0;
        // A partial read would shrink the ranks and inflate this replica's share: any
        // error keeps the previous view instead.
        let mut keys = self.kv.keys().await.map_err(FleetError::store)?;
        while let Some(key) = keys.next().await {
            let key = key.map_err(FleetError::store)?;
            let Some(id) = key.strip_prefix(REPLICA_PREFIX) else { continue };
            let Some(v) = self.kv.get(&key).await.map_err(FleetError::store)? else { continue };
            match serde_json::from_slice::<Heartbeat>(&v) {
                Ok(h) if now.saturating_sub(h.at_ms) <= stale_after => {
                    if id != self.me {
                        others_in_flight += h.in_flight;
                    }
                    live.push(id.to_string());
                }
                // Long dead: tidy up.
                Ok(h) if now.saturating_sub(h.at_ms) > 10 * stale_after => {
                    let _ = self.kv.delete(&key).await;
                }
                _ => {}
            }
        }
        if !live.contains(&self.me) {
            live.push(self.me.clone());
        }
        let mut l = self.ledger();
        let (live, missing) = super::share::ranks(&l.live, &l.missing, live);
        l.missing = missing;
        let others = live.len() - 1;
        l.others_in_flight = others_in_flight;
        if l.live != live {
            tracing::info!(replicas = live.len(), was = l.live.len(), "live replicas on the key changed");
            l.live = live;
            l.live_changed_ms = now;
            drop(l);
            self.changed.notify_waiters();
        }
        Ok(others)
    }

    /// Applies `event` to the key's window here and, when the fleet should know, to the
    /// shared entry (the event re-applied to the entry as read, merged with ours).
    pub(super) async fn update_window(&self, event: impl Fn(&mut Window)) -> Result<(), FleetError> {
        let (differs, local, level_before) = {
            let mut l = self.ledger();
            let before = l.window;
            event(&mut l.window);
            (l.window.differs(&before), l.window, before.fleet(l.key_limit))
        };
        if !differs {
            return Ok(());
        }
        let key = format!("{WINDOW_PREFIX}{}", self.key);
        let written = cas(&self.kv, &key, |shared: Option<Window>| {
            Some(match shared {
                Some(mut shared) => {
                    event(&mut shared);
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
        Ok(())
    }
}

/// The key's buckets, one per metered dimension, shared by every replica and tenant on
/// the key through `QUOTA_<R>`: each change is one compare-and-set, so two replicas
/// never both take what only one of them could have.
impl Quota {
    fn bucket_key(&self, dim: Dimension) -> String {
        format!("{BUCKET_PREFIX}{}.{}", self.key, dim.as_str())
    }

    /// The bucket as stored, at `capacity`; a full one when there is none yet. A lower
    /// limit keeps what is left, up to it; a higher one adds the difference at once
    /// (what the provider's own bucket gained).
    fn at_capacity(stored: Option<Bucket>, dim: Dimension, capacity: u64, now_ms: u64) -> Bucket {
        let period_ms = dim.period().as_millis() as u64;
        match stored {
            Some(b) if b.capacity == capacity && b.period_ms == period_ms => b,
            Some(b) => Bucket {
                capacity,
                period_ms,
                level: (b.level_at(now_ms) + capacity.saturating_sub(b.capacity) as f64).min(capacity as f64),
                at_ms: now_ms.max(b.at_ms),
                refills_at_ms: b.refills_at_ms,
            },
            None => Bucket::full_over(capacity, period_ms, now_ms),
        }
    }

    /// Reserves `cost` of `dim` (a bucket of `capacity` per period) for the whole fleet.
    /// `Ok(Err(refused))`: it does not fit yet (nothing taken: wait that long), or never.
    pub async fn reserve(&self, dim: Dimension, capacity: u64, cost: u64) -> Result<Result<(), Refused>, FleetError> {
        let now = self.now_ms();
        let mut refused = None;
        cas_spread::<Bucket>(&self.kv, &self.bucket_key(dim), |stored| {
            let mut b = Quota::at_capacity(stored, dim, capacity, now);
            match b.reserve(cost, now) {
                Ok(()) => {
                    refused = None;
                    Some(b)
                }
                Err(r) => {
                    refused = Some(r);
                    None
                }
            }
        })
        .await?;
        Ok(refused.map_or(Ok(()), Err))
    }

    /// Corrects a reservation of `reserved` to what the answer `used`.
    pub async fn correct(&self, dim: Dimension, capacity: u64, reserved: u64, used: u64) -> Result<(), FleetError> {
        let now = self.now_ms();
        cas_spread::<Bucket>(&self.kv, &self.bucket_key(dim), |stored| {
            let mut b = Quota::at_capacity(stored, dim, capacity, now);
            b.correct(reserved, used, now);
            Some(b)
        })
        .await
        .map(|_| ())
    }

    /// Follows what the provider reported (it only ever lowers the level).
    pub async fn follow(&self, dim: Dimension, capacity: u64, reading: &Reading) -> Result<(), FleetError> {
        let now = self.now_ms();
        cas_spread::<Bucket>(&self.kv, &self.bucket_key(dim), |stored| {
            let mut b = Quota::at_capacity(stored, dim, capacity, now);
            let before = b;
            b.follow(reading, now);
            (b != before).then_some(b)
        })
        .await
        .map(|_| ())
    }

    /// What the fleet's bucket of `dim` holds now (full when nothing was drawn yet).
    pub async fn bucket_level(&self, dim: Dimension, capacity: u64) -> Result<f64, FleetError> {
        let now = self.now_ms();
        let stored = self.kv.get(self.bucket_key(dim)).await.map_err(FleetError::store)?;
        let stored = stored.and_then(|v| serde_json::from_slice::<Bucket>(&v).ok());
        Ok(Quota::at_capacity(stored, dim, capacity, now).level_at(now))
    }

    /// Adopts the limits other replicas learned: the capacity of each bucket the fleet
    /// keeps for a dimension this replica has no configured limit for.
    pub(super) async fn adopt_learned(&self) -> Result<(), FleetError> {
        for dim in Dimension::ALL {
            let Some(v) = self.kv.get(self.bucket_key(dim)).await.map_err(FleetError::store)? else { continue };
            if let Ok(b) = serde_json::from_slice::<Bucket>(&v) {
                let now = self.now_ms();
                self.limits().adopt(dim, b.capacity, now);
            }
        }
        Ok(())
    }

    /// Reserves one call of `cost` in every budget the key has now (configured or
    /// learned), or in none: when one refuses, what the others took is given back, and
    /// the longest wait is returned (nothing spent). A store error lets the call go
    /// unreserved in that budget (logged): the provider's own 429 still paces it.
    pub async fn reserve_call(&self, cost: Cost) -> Result<Reservation, Refused> {
        let mut taken = Reservation { cost, budgets: Vec::new() };
        let mut refused: Option<Refused> = None;
        for (dim, capacity) in self.budgets() {
            match self.reserve(dim, capacity, dim.of(cost)).await {
                Ok(Ok(())) => taken.budgets.push((dim, capacity)),
                Ok(Err(r)) => {
                    refused = Some(match (refused, r) {
                        (Some(Refused::Wait(a)), Refused::Wait(b)) => Refused::Wait(a.max(b)),
                        (Some(too @ Refused::TooLarge { .. }), _) | (_, too @ Refused::TooLarge { .. }) => too,
                        (None, r) => r,
                    })
                }
                Err(e) => tracing::warn!(error = %e, dimension = dim.as_str(), "reserving a call's budget failed"),
            }
        }
        let Some(refused) = refused else { return Ok(taken) };
        self.release_call(&taken).await;
        Err(refused)
    }

    /// A reserved call that was answered: each budget is corrected to what it `used`
    /// (its request stays spent, and so does the output limit tokens per minute count
    /// at start; output tokens per minute are counted as produced).
    pub async fn correct_call(&self, reserved: &Reservation, used: Cost) {
        self.give_back(reserved, used, false).await
    }

    /// A reserved call that was never made: all of it is given back.
    pub async fn release_call(&self, reserved: &Reservation) {
        self.give_back(reserved, Cost::default(), true).await
    }

    /// Gives back to each budget what the call did not use (all of it when `release`).
    async fn give_back(&self, reserved: &Reservation, used: Cost, release: bool) {
        for &(dim, capacity) in &reserved.budgets {
            let used = match dim {
                _ if release => 0,
                Dimension::Requests => 1,
                // Tokens per minute count the output limit when the call starts (OpenAI):
                // only the prompt's estimate is corrected.
                Dimension::Tokens => used.input + used.output.max(reserved.cost.output),
                _ => dim.of(used),
            };
            if let Err(e) = self.correct(dim, capacity, dim.of(reserved.cost), used).await {
                tracing::warn!(error = %e, dimension = dim.as_str(), "correcting a reservation failed");
            }
        }
        self.given_back.notify_waiters();
    }

    /// Learns the limits an answer's headers reported, then follows what they said of
    /// each budget: a provider that reports less than the fleet's bucket holds wins
    /// (another deployment on the account, or traffic outside reviewlane, is absorbed
    /// within one answer).
    ///
    /// A learned limit the answers stopped reporting lapses (`Limits::learn`): its bucket
    /// is removed, so that a replica starting later does not adopt it.
    pub async fn follow_readings(&self, meter: &crate::upstream::Meter) {
        let learnt = self.limits().learn(meter, self.now_ms());
        if learnt.changed {
            tracing::info!(budgets = ?self.budgets(), "the key's limits, as the provider reports them");
        }
        for dim in learnt.lapsed {
            tracing::info!(dimension = dim.as_str(), "a learned limit lapsed: no answer reported it for a while");
            if let Err(e) = self.kv.delete(self.bucket_key(dim)).await {
                tracing::warn!(error = %e, dimension = dim.as_str(), "removing a lapsed bucket failed");
            }
        }
        for (dim, capacity) in self.budgets() {
            let Some(reading) = meter.get(&dim) else { continue };
            if let Err(e) = self.follow(dim, capacity, reading).await {
                tracing::warn!(error = %e, dimension = dim.as_str(), "following the provider's reading failed");
            }
        }
    }

    /// A 429 without a hint that the answers predicted (`Limits::predicted`: the last
    /// reading of a limited dimension said none remained): that dimension, and how long
    /// until its bucket, emptied, has room again — for a fixed window, the window's end.
    /// Such a 429 is the bucket's, not congestion; each reading predicts one.
    pub async fn predicted(&self) -> Option<(Dimension, std::time::Duration)> {
        let dim = self.limits().predicted()?;
        let capacity = self.limits().of(dim)?;
        let now = self.now_ms();
        let stored = match self.kv.get(self.bucket_key(dim)).await {
            Ok(v) => v.and_then(|v| serde_json::from_slice::<Bucket>(&v).ok()),
            Err(e) => {
                tracing::warn!(error = %e, dimension = dim.as_str(), "reading a bucket failed");
                None
            }
        };
        let mut b = Quota::at_capacity(stored, dim, capacity, now);
        b.follow(&Reading { remaining: Some(0), ..Default::default() }, now);
        let wait = match b.reserve(1, now) {
            Err(Refused::Wait(d)) => d,
            _ => std::time::Duration::from_millis(1),
        };
        Some((dim, wait))
    }

    /// A 429 that names `dim` (or whose headers say it is empty): its bucket, when the
    /// key has one, is empty now.
    pub(super) async fn drain(&self, dim: Dimension) {
        let Some(capacity) = self.limits().of(dim) else { return };
        let empty = Reading { remaining: Some(0), ..Default::default() };
        if let Err(e) = self.follow(dim, capacity, &empty).await {
            tracing::warn!(error = %e, dimension = dim.as_str(), "draining a bucket failed");
        }
    }

    /// Whether every dimension the answer reports empty has a bucket: then the buckets
    /// pace the next calls exactly, and no headroom pause (until the dimension is full
    /// again) is needed.
    pub fn paces_every_empty(&self, meter: &crate::upstream::Meter) -> bool {
        let limits = self.limits();
        meter.iter().filter(|(_, r)| r.remaining == Some(0)).all(|(d, _)| limits.of(*d).is_some())
    }

    pub fn has_budgets(&self) -> bool {
        !self.limits().is_empty()
    }
}

/// What a call reserved: its cost, in each budget the key had when it started.
#[derive(Debug, Clone, PartialEq)]
pub struct Reservation {
    pub cost: Cost,
    budgets: Vec<(Dimension, u64)>,
}
