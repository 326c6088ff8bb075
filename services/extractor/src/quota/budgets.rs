//! The key's metered budgets (`Budgets`): requests and tokens per minute (and any
//! other dimension the provider meters), configured or learned from the answers'
//! headers, each one bucket for the whole fleet on `QUOTA_<R>`. Every call reserves
//! its cost in each before it starts (`reserve_call`) and is corrected to its answer's
//! usage (`correct_call`) or given back (`release_call`); the provider's readings are
//! followed (`follow_readings`). The arithmetic is `bucket` and `limits` (pure).

use std::sync::{Arc, Mutex, MutexGuard};

use async_nats::jetstream::kv;
use reviewlane_core::clock::SharedClock;
use reviewlane_core::meter::{Cost, Dimension, Reading};
use tokio::sync::Notify;

use super::bucket::{Bucket, Refused};
use super::fleet::{FleetError, KvTally, cas_spread};
use super::limits::Limits;

/// `bucket.<key>.<dimension>`: one metered dimension of the key, for the whole fleet.
pub(super) const BUCKET_PREFIX: &str = "bucket.";

/// The key's metered budgets: its limits (configured and learned, `Limits`) and one
/// bucket per limited dimension, shared by every replica and tenant on the key through
/// `QUOTA_<R>` (`bucket.<key>.<dimension>`). Each change of a bucket is one
/// compare-and-set, so two replicas never both take what only one of them could have.
/// Cheap to clone.
#[derive(Clone)]
pub struct Budgets {
    kv: kv::Store,
    /// The provider key (account) token.
    key: String,
    clock: SharedClock,
    limits: Arc<Mutex<Limits>>,
    /// Woken when this replica gives budget back (a reservation corrected or released).
    pub given_back: Arc<Notify>,
    tally: Arc<KvTally>,
}

impl Budgets {
    pub(super) fn new(kv: kv::Store, key: String, clock: SharedClock, tally: Arc<KvTally>) -> Budgets {
        Budgets { kv, key, clock, limits: Arc::default(), given_back: Arc::new(Notify::new()), tally }
    }

    /// The configured limits (requests, tokens, ...); the others are learned.
    pub(super) fn configure(&self, configured: Vec<(Dimension, u64)>) {
        *self.limits_lock() = Limits::configured(configured);
    }

    fn limits_lock(&self) -> MutexGuard<'_, Limits> {
        self.limits.lock().expect("limits lock")
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The key's budgets now: each limited dimension and its limit.
    pub fn limits(&self) -> Vec<(Dimension, u64)> {
        self.limits_lock().active()
    }

    /// Whether `dim` is limited.
    pub fn limits_dimension(&self, dim: Dimension) -> bool {
        self.limits_lock().of(dim).is_some()
    }

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
        cas_spread::<Bucket>(&self.kv, &self.tally, &self.bucket_key(dim), |stored| {
            let mut b = Budgets::at_capacity(stored, dim, capacity, now);
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
        cas_spread::<Bucket>(&self.kv, &self.tally, &self.bucket_key(dim), |stored| {
            let mut b = Budgets::at_capacity(stored, dim, capacity, now);
            b.correct(reserved, used, now);
            Some(b)
        })
        .await
        .map(|_| ())
    }

    /// Follows what the provider reported (it only ever lowers the level).
    pub async fn follow(&self, dim: Dimension, capacity: u64, reading: &Reading) -> Result<(), FleetError> {
        let now = self.now_ms();
        cas_spread::<Bucket>(&self.kv, &self.tally, &self.bucket_key(dim), |stored| {
            let mut b = Budgets::at_capacity(stored, dim, capacity, now);
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
        self.tally.read();
        let stored = self.kv.get(self.bucket_key(dim)).await.map_err(FleetError::store)?;
        let stored = stored.and_then(|v| serde_json::from_slice::<Bucket>(&v).ok());
        Ok(Budgets::at_capacity(stored, dim, capacity, now).level_at(now))
    }

    /// Adopts the limits other replicas learned: the capacity of each bucket the fleet
    /// keeps for a dimension this replica has no configured limit for.
    pub(super) async fn adopt_learned(&self) -> Result<(), FleetError> {
        for dim in Dimension::ALL {
            self.tally.read();
            let Some(v) = self.kv.get(self.bucket_key(dim)).await.map_err(FleetError::store)? else { continue };
            if let Ok(b) = serde_json::from_slice::<Bucket>(&v) {
                let now = self.now_ms();
                self.limits_lock().adopt(dim, b.capacity, now);
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
        for (dim, capacity) in self.limits() {
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
        let learnt = self.limits_lock().learn(meter, self.now_ms());
        if learnt.changed {
            tracing::info!(budgets = ?self.limits(), "the key's limits, as the provider reports them");
        }
        for dim in learnt.lapsed {
            tracing::info!(dimension = dim.as_str(), "a learned limit lapsed: no answer reported it for a while");
            self.tally.wrote();
            if let Err(e) = self.kv.delete(self.bucket_key(dim)).await {
                tracing::warn!(error = %e, dimension = dim.as_str(), "removing a lapsed bucket failed");
            }
        }
        for (dim, capacity) in self.limits() {
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
        let dim = self.limits_lock().predicted()?;
        let capacity = self.limits_lock().of(dim)?;
        let now = self.now_ms();
        self.tally.read();
        let stored = match self.kv.get(self.bucket_key(dim)).await {
            Ok(v) => v.and_then(|v| serde_json::from_slice::<Bucket>(&v).ok()),
            Err(e) => {
                tracing::warn!(error = %e, dimension = dim.as_str(), "reading a bucket failed");
                None
            }
        };
        let mut b = Budgets::at_capacity(stored, dim, capacity, now);
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
        let Some(capacity) = self.limits_lock().of(dim) else { return };
        let empty = Reading { remaining: Some(0), ..Default::default() };
        if let Err(e) = self.follow(dim, capacity, &empty).await {
            tracing::warn!(error = %e, dimension = dim.as_str(), "draining a bucket failed");
        }
    }

    /// Whether every dimension the answer reports empty has a bucket: then the buckets
    /// pace the next calls exactly, and no headroom pause (until the dimension is full
    /// again) is needed.
    pub fn paces_every_empty(&self, meter: &crate::upstream::Meter) -> bool {
        let limits = self.limits_lock();
        meter.iter().filter(|(_, r)| r.remaining == Some(0)).all(|(d, _)| limits.of(*d).is_some())
    }

    pub fn has_budgets(&self) -> bool {
        !self.limits_lock().is_empty()
    }
}

/// What a call reserved: its cost, in each budget the key had when it started.
#[derive(Debug, Clone, PartialEq)]
pub struct Reservation {
    pub cost: Cost,
    budgets: Vec<(Dimension, u64)>,
}
