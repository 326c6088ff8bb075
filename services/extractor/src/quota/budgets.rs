//! The key's metered budgets (`Budgets`): requests and tokens per minute (and any
//! other dimension the provider meters), configured or learned from the answers'
//! headers, each one bucket for the whole fleet on `QUOTA_<R>`. Every call reserves
//! its cost in each before it starts (`reserve_call`) and is corrected to its answer's
//! usage (`correct_call`) or given back (`release_call`); the provider's readings are
//! followed (`follow_readings`, at most once a second per dimension and replica).
//!
//! A call reserves from this replica's slice of each bucket (`slice`): units taken
//! from the fleet's bucket in one compare-and-set for many calls, and spent here
//! without another; a correction or a release goes back into the slice. What the
//! fleet writes per call stays a fraction of a write whatever the number of replicas.
//! The arithmetic is `bucket`, `slice` and `limits` (pure).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use async_nats::jetstream::kv;
use reviewlane_core::clock::SharedClock;
use reviewlane_core::meter::{Cost, Dimension, Reading};
use tokio::sync::Notify;

use super::bucket::{Bucket, Refused};
use super::fleet::{FleetError, KvTally, cas_spread};
use super::limits::Limits;
use super::slice::Slice;

/// A replica follows a dimension's readings at most this often.
const FOLLOW_EVERY_MS: u64 = 1_000;

/// How long before the end of a provider's short window (`Budgets::windows`) no call
/// is reserved in it: what a reserved call may take to reach the provider.
const WINDOW_MARGIN_MS: u64 = 250;
const MIN_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

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
    /// This replica's slice of each bucket (`slice`).
    slices: Arc<Mutex<BTreeMap<Dimension, Slice>>>,
    /// One take at a time per bucket: the calls that find the slice short meanwhile
    /// wait for it, not take beside it.
    taking: Arc<tokio::sync::Mutex<()>>,
    /// When this replica last followed each dimension's reading.
    followed_ms: Arc<Mutex<BTreeMap<Dimension, u64>>>,
    /// Dimensions the provider enforces over a window shorter than their period (Azure
    /// OpenAI evaluates requests per minute over 10 s): their bucket holds that window's
    /// share of the limit and refills over it, so a burst never exceeds what one window
    /// allows.
    windows: Arc<BTreeMap<Dimension, std::time::Duration>>,
}

impl Budgets {
    pub(super) fn new(kv: kv::Store, key: String, clock: SharedClock, tally: Arc<KvTally>) -> Budgets {
        Budgets {
            kv,
            key,
            clock,
            limits: Arc::default(),
            given_back: Arc::new(Notify::new()),
            tally,
            slices: Arc::default(),
            taking: Arc::default(),
            followed_ms: Arc::default(),
            windows: Arc::default(),
        }
    }

    /// Enforces each `(dimension, window)` over that window (see `windows`).
    pub(super) fn enforce_over(&mut self, windows: Vec<(Dimension, std::time::Duration)>) {
        self.windows = Arc::new(windows.into_iter().collect());
    }

    /// The bucket of a limit of `capacity` per `dim`'s period: that, or the share of it
    /// the provider allows within its window, refilling at the same pace.
    fn shape(&self, dim: Dimension, capacity: u64) -> (u64, u64) {
        let period_ms = dim.period().as_millis() as u64;
        match self.windows.get(&dim) {
            Some(w) if (w.as_millis() as u64) < period_ms => {
                let window_ms = w.as_millis() as u64;
                ((capacity.saturating_mul(window_ms) / period_ms).max(1), window_ms)
            }
            _ => (capacity, period_ms),
        }
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
    fn at_capacity(&self, stored: Option<Bucket>, dim: Dimension, capacity: u64, now_ms: u64) -> Bucket {
        let (capacity, period_ms) = self.shape(dim, capacity);
        let mut b = match stored {
            Some(b) if b.capacity == capacity && b.period_ms == period_ms => b,
            Some(b) => Bucket {
                capacity,
                period_ms,
                level: (b.level_at(now_ms) + capacity.saturating_sub(b.capacity) as f64).min(capacity as f64),
                at_ms: now_ms.max(b.at_ms),
                refills_at_ms: b.refills_at_ms,
            },
            None => Bucket::full_over(capacity, period_ms, now_ms),
        };
        // A dimension enforced over a short window refills at that window's end, the
        // windows falling on the clock's marks (every 10 s from the minute) as the
        // provider's do: a continuous bucket would let through more than one window
        // allows where two windows meet.
        if b.refills_at_ms.is_none() {
            b.refills_at_ms = self.window_end(dim, now_ms);
        }
        b
    }

    /// The end of the provider's window `now_ms` is in, for a dimension it enforces over
    /// a short window (`windows`): the next mark of the clock.
    fn window_end(&self, dim: Dimension, now_ms: u64) -> Option<u64> {
        let window_ms = self.windows.get(&dim)?.as_millis().max(1) as u64;
        Some((now_ms / window_ms + 1) * window_ms)
    }

    /// The start of that window: the last mark.
    fn window_start(&self, dim: Dimension, now_ms: u64) -> Option<u64> {
        let window_ms = self.windows.get(&dim)?.as_millis().max(1) as u64;
        Some(now_ms / window_ms * window_ms)
    }

    /// Reserves `cost` of `dim` (a bucket of `capacity` per period) for the whole fleet.
    /// `Ok(Err(refused))`: it does not fit yet (nothing taken: wait that long), or never.
    pub async fn reserve(&self, dim: Dimension, capacity: u64, cost: u64) -> Result<Result<(), Refused>, FleetError> {
        let now = self.now_ms();
        let mut refused = None;
        cas_spread::<Bucket>(&self.kv, &self.tally, &self.bucket_key(dim), |stored| {
            let mut b = self.at_capacity(stored, dim, capacity, now);
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

    /// Takes a slice of `want` units of `dim` from the fleet's bucket, handing back
    /// `returned` (what the last slice left, or a debt) in the same write.
    /// `Ok(Err(refused))`: the bucket does not hold the slice yet (wait that long;
    /// nothing taken, nothing handed back), or it never will.
    async fn take(
        &self,
        dim: Dimension,
        capacity: u64,
        want: u64,
        returned: f64,
    ) -> Result<Result<u64, Refused>, FleetError> {
        let now = self.now_ms();
        let mut outcome = Err(Refused::Wait(std::time::Duration::ZERO));
        cas_spread::<Bucket>(&self.kv, &self.tally, &self.bucket_key(dim), |stored| {
            let mut b = self.at_capacity(stored, dim, capacity, now);
            b.give(returned, now);
            // The whole slice, or nothing until the bucket holds it: a replica spending
            // at the bucket's pace takes a slice per span, not a call at a time.
            outcome = b.reserve(want, now).map(|()| want);
            outcome.is_ok().then_some(b)
        })
        .await?;
        Ok(outcome)
    }

    /// Corrects a reservation of `reserved` to what the answer `used`.
    pub async fn correct(&self, dim: Dimension, capacity: u64, reserved: u64, used: u64) -> Result<(), FleetError> {
        let now = self.now_ms();
        cas_spread::<Bucket>(&self.kv, &self.tally, &self.bucket_key(dim), |stored| {
            let mut b = self.at_capacity(stored, dim, capacity, now);
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
            let mut b = self.at_capacity(stored, dim, capacity, now);
            let before = b;
            b.follow(reading, now);
            if self.windows.contains_key(&dim) {
                // Its windows are the provider's marks, whatever a reading suggests, and
                // a reading only lowers it: one that shows more left was read before
                // the calls reserved since reached the provider.
                b.refills_at_ms = before.refills_at_ms;
                b.level = b.level.min(before.level_at(now));
            }
            // Written only when the reading changed what the bucket holds or how it
            // refills (bringing its time forward alone is no change).
            let changed = b.level_at(now) != before.level_at(now) || b.refills_at_ms != before.refills_at_ms;
            changed.then_some(b)
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
        Ok(self.at_capacity(stored, dim, capacity, now).level_at(now))
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
    /// the longest wait is returned (nothing spent). Each is spent from this replica's
    /// slice, and a slice taken when it is short. A store error lets the call go
    /// unreserved in that budget (logged): the provider's own 429 still paces it.
    pub async fn reserve_call(&self, cost: Cost) -> Result<Reservation, Refused> {
        let mut taken = Reservation { cost, budgets: Vec::new() };
        let mut refused: Option<Refused> = None;
        for (dim, capacity) in self.limits() {
            match self.reserve_from_slice(dim, capacity, dim.of(cost)).await {
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

    fn slices_lock(&self) -> MutexGuard<'_, BTreeMap<Dimension, Slice>> {
        self.slices.lock().expect("slices lock")
    }

    /// Spends `cost` of `dim` from this replica's slice; takes a new slice first when
    /// it is short or lapsed.
    async fn reserve_from_slice(
        &self,
        dim: Dimension,
        capacity: u64,
        cost: u64,
    ) -> Result<Result<(), Refused>, FleetError> {
        if cost > capacity {
            return Ok(Err(Refused::TooLarge { capacity }));
        }
        // The bucket's refill over a second: one replica alone takes a slice a second,
        // and the fleet's bucket never waits long to gather one.
        let most = capacity as f64 * 1_000.0 / dim.period().as_millis() as f64;
        // Near the end of a provider's short window, a call reserved now would reach it
        // in the next one, which the bucket does not count it in: it waits for the mark.
        if let Some(end) = self.window_end(dim, self.now_ms())
            && self.now_ms() + WINDOW_MARGIN_MS >= end
        {
            return Ok(Err(Refused::Wait(std::time::Duration::from_millis(end - self.now_ms()).max(MIN_WAIT))));
        }
        if let Some(done) = self.spend_or_refused(dim, capacity, cost, self.now_ms()) {
            return Ok(done);
        }
        let _taking = self.taking.lock().await;
        // Another call's take may have refilled the slice while this one waited.
        let now = self.now_ms();
        if let Some(done) = self.spend_or_refused(dim, capacity, cost, now) {
            return Ok(done);
        }
        let (want, returned) = {
            let mut slices = self.slices_lock();
            let slice = slices.entry(dim).or_default();
            let taken_in_a_past_window = self.window_start(dim, now).is_some_and(|start| slice.until_ms <= start);
            let returned = slice.hand_back();
            // What a provider's short window let through lapsed with it: left in a slice
            // of a past window, it is not handed to the next (a debt still is).
            let returned = if taken_in_a_past_window { returned.min(0.0) } else { returned };
            (slice.wanted(cost, most, now), returned)
        };
        let took = self.take(dim, capacity, want, returned).await;
        let mut slices = self.slices_lock();
        let slice = slices.entry(dim).or_default();
        match took {
            Ok(Ok(units)) => {
                slice.taken(units, now);
                if let Some(end) = self.window_end(dim, now) {
                    // Not spent past the provider's window it was taken in.
                    slice.until_ms = slice.until_ms.min(end.saturating_sub(WINDOW_MARGIN_MS));
                }
                let spent = slice.spend(cost, now);
                debug_assert!(spent, "a slice of at least the call");
                Ok(Ok(()))
            }
            other => {
                // Nothing was taken or handed back: the slice keeps what it had, and
                // no call here asks the fleet again before the bucket can have it.
                slice.give_back(returned);
                if let Ok(Err(Refused::Wait(wait))) = &other {
                    slice.refused_until(now + wait.as_millis() as u64, capacity);
                }
                other.map(|r| r.map(|_| ()))
            }
        }
    }

    /// Spends `cost` from the slice (`Ok`), or finds the fleet's bucket, at `capacity`,
    /// refused a take a moment ago and will not have it before the wait returned
    /// (`Err`); `None`: a take is needed.
    fn spend_or_refused(&self, dim: Dimension, capacity: u64, cost: u64, now: u64) -> Option<Result<(), Refused>> {
        let mut slices = self.slices_lock();
        let slice = slices.entry(dim).or_default();
        if slice.spend(cost, now) {
            return Some(Ok(()));
        }
        slice.refused_for(now, capacity).map(|wait| Err(Refused::Wait(wait)))
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

    /// Gives back to this replica's slice of each budget what the call did not use
    /// (all of it when `release`).
    async fn give_back(&self, reserved: &Reservation, used: Cost, release: bool) {
        {
            let mut slices = self.slices_lock();
            for &(dim, _) in &reserved.budgets {
                let used = match dim {
                    _ if release => 0,
                    Dimension::Requests => 1,
                    // Tokens per minute count the output limit when the call starts
                    // (OpenAI): only the prompt's estimate is corrected.
                    Dimension::Tokens => used.input + used.output.max(reserved.cost.output),
                    _ => dim.of(used),
                };
                let unused = dim.of(reserved.cost) as f64 - used as f64;
                slices.entry(dim).or_default().give_back(unused);
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
        let now = self.now_ms();
        for (dim, capacity) in self.limits() {
            let Some(reading) = meter.get(&dim) else { continue };
            {
                let mut followed = self.followed_ms.lock().expect("followed lock");
                let last = followed.entry(dim).or_insert(0);
                if *last != 0 && now.saturating_sub(*last) < FOLLOW_EVERY_MS {
                    continue;
                }
                *last = now;
            }
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
        let mut b = self.at_capacity(stored, dim, capacity, now);
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
        if let Some(slice) = self.slices_lock().get_mut(&dim) {
            slice.empty();
        }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use reviewlane_core::clock::ManualClock;
    use reviewlane_shared::Region;
    use reviewlane_shared::testing::NatsServer;

    use super::*;

    async fn quota_kv(nats: &NatsServer) -> kv::Store {
        let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
        reviewlane_shared::layout::ensure(&js, Region::Us, &Default::default()).await.unwrap().quota
    }

    fn replica(kv: &kv::Store, clock: &Arc<ManualClock>, limits: Vec<(Dimension, u64)>) -> (Budgets, Arc<KvTally>) {
        let tally = Arc::new(KvTally::default());
        let b = Budgets::new(kv.clone(), "openai.k".into(), clock.clone(), tally.clone());
        b.configure(limits);
        (b, tally)
    }

    const CALL: Cost = Cost { input: 800, output: 200 };

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replicas_calls_spend_its_slice_with_a_write_per_slice_not_per_call() {
        let nats = NatsServer::start_provisioned(Region::Us).await;
        let kv = quota_kv(&nats).await;
        let clock = ManualClock::at(1_000_000);
        // 600 requests and 600,000 tokens a minute: ten calls a second.
        let (b, tally) = replica(&kv, &clock, vec![(Dimension::Requests, 600), (Dimension::Tokens, 600_000)]);
        for _ in 0..100 {
            let r = b.reserve_call(CALL).await.expect("within the budgets");
            // Each uses less than it reserved: what it did not use stays in the slice.
            b.correct_call(&r, Cost { input: 500, output: 100 }).await;
            clock.advance(Duration::from_millis(100));
        }
        let writes = tally.counts().writes;
        assert!(writes <= 20, "{writes} writes for 100 calls in two budgets");
        // The fleet's buckets were charged for every slice taken, the calls within them.
        let requests = b.bucket_level(Dimension::Requests, 600).await.unwrap();
        assert!(requests <= 600.0 - 100.0 + 10.0 * 10.0, "{requests}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_enforced_over_ten_seconds_allow_a_sixth_of_the_minute_per_window_on_the_marks() {
        let nats = NatsServer::start_provisioned(Region::Us).await;
        let kv = quota_kv(&nats).await;
        // 60 requests a minute, enforced over 10 s windows on the clock's marks.
        let clock = ManualClock::at(1_000_000);
        let (mut b, _) = replica(&kv, &clock, vec![(Dimension::Requests, 60)]);
        b.enforce_over(vec![(Dimension::Requests, Duration::from_secs(10))]);
        for window in 0..3 {
            let mut made = 0;
            // Calls come every 100 ms through the window: ten go, at its start.
            for _ in 0..97 {
                if let Ok(r) = b.reserve_call(CALL).await {
                    made += 1;
                    b.correct_call(&r, CALL).await;
                }
                clock.advance(Duration::from_millis(100));
            }
            assert_eq!(made, 10, "window {window}");
            // The window's last 250 ms: nothing is reserved, even with room.
            match b.reserve_call(CALL).await {
                Err(Refused::Wait(w)) => assert!(w <= Duration::from_millis(300), "{w:?}"),
                other => panic!("{other:?}"),
            }
            clock.advance(Duration::from_millis(300));
        }
        // A call refused by the provider (a 429) was not counted there: its unit is back.
        let r = b.reserve_call(CALL).await.unwrap();
        b.release_call(&r).await;
        assert!(b.reserve_call(CALL).await.is_ok());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_replicas_spending_slices_never_reserve_more_than_the_bucket_holds() {
        let nats = NatsServer::start_provisioned(Region::Us).await;
        let kv = quota_kv(&nats).await;
        // The clock stands still: nothing refills while the two race.
        let clock = ManualClock::at(1_000_000);
        let (a, _) = replica(&kv, &clock, vec![(Dimension::Requests, 48)]);
        let (b, _) = replica(&kv, &clock, vec![(Dimension::Requests, 48)]);
        let tries = [&a, &b].into_iter().flat_map(|r| (0..40).map(move |_| r.reserve_call(CALL)));
        let results = futures::future::join_all(tries).await;
        let taken = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(taken, 48, "the fleet reserved {taken} calls from a bucket of 48");
        assert!(results.iter().all(|r| r.is_ok() || matches!(r, Err(Refused::Wait(_)))));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lapsed_slice_goes_back_to_the_fleet_with_the_next_take() {
        let nats = NatsServer::start_provisioned(Region::Us).await;
        let kv = quota_kv(&nats).await;
        let clock = ManualClock::at(1_000_000);
        let (a, _) = replica(&kv, &clock, vec![(Dimension::Requests, 6_000)]);
        // Most of the bucket is spent elsewhere: what follows is below its capacity.
        assert_eq!(a.reserve(Dimension::Requests, 6_000, 5_000).await.unwrap(), Ok(()));
        // A replica spending 20 calls a second takes slices of its spend over a span.
        for _ in 0..60 {
            a.reserve_call(CALL).await.unwrap();
            clock.advance(Duration::from_millis(50));
        }
        let held = a.slices_lock()[&Dimension::Requests].units;
        assert!(held > 0.0, "the last slice is not spent yet");
        // It stops; its slice lapses. Its next take hands what was left back in the
        // same write.
        clock.advance(Duration::from_millis(super::super::slice::SPAN_MS));
        let before = a.bucket_level(Dimension::Requests, 6_000).await.unwrap();
        assert!(!a.slices_lock().get_mut(&Dimension::Requests).unwrap().spend(1, a.now_ms()), "lapsed");
        a.reserve_call(CALL).await.unwrap();
        let took = a.slices_lock()[&Dimension::Requests].units + 1.0;
        let after = a.bucket_level(Dimension::Requests, 6_000).await.unwrap();
        assert!((after - (before + held - took)).abs() < 1.0, "{after} = {before} + {held} - {took}");
        // A 429 for the dimension: the slice is not there either.
        a.drain(Dimension::Requests).await;
        assert!(a.slices_lock()[&Dimension::Requests].units <= 0.0);
    }
}
