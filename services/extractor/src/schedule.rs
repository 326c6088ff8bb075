//! Scheduling ahead of the worker pool.
//!
//! One durable pull consumer per (lane, tenant) subject, each served by `weight` loops
//! of its own. A loop pulls only when its tenant's quota scope is not paused (and, for
//! batch, while the interactive lane is not backlogged), and holds at most one message.
//! No call slot is held during a long-poll, so an idle lane or tenant parks no capacity.
//! A message that has arrived waits for a slot — interactive before batch, except that
//! batch keeps `batch_min` slots whenever it has work, so it slows down under an
//! interactive backlog but is never starved; and, while interactive work came within the
//! last minute, batch leaves `interactive_reserve` slots free beyond its minimum, so an
//! interactive review that arrives while batch fills the pool starts at once instead of
//! waiting for a batch call to end — and for its
//! scope's allowance, keeping its lease alive with progress acks; waiters are served in
//! the order they started waiting, so tenants of a lane take turns. A message whose
//! scope is paused goes back with the remaining delay, spending no budget.
//!
//! A deadline is a deadline while a scope is paused: its loop still pulls, and each
//! review goes back until the pause ends or its deadline passes, whichever is first;
//! one whose deadline has passed is ended by the worker without a call (`Work::Late`).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use reviewlane_core::diff::Diff;
use reviewlane_core::messages::ReviewMessage;
use reviewlane_core::region::Lane;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use reviewlane_shared::pull::{Puller, ack};

use crate::quota::{Quota, Reservation, Scope, ScopeGuard};

struct SlotState {
    free: usize,
    /// Batch calls running, and how many batch keeps at least while interactive work
    /// is backlogged (its aging bound: batch slows down, never stops).
    batch_running: usize,
    batch_min: usize,
    /// Slots batch leaves free for interactive work once it runs its minimum, while
    /// interactive work came within `RESERVE_HOLD`.
    interactive_reserve: usize,
    /// When an interactive review last asked for a slot.
    interactive_seen: Option<tokio::time::Instant>,
    /// Interactive reviews admitted and not yet settled.
    interactive_in_flight: usize,
    /// Waiting messages in arrival order, by ticket. The first interactive one is served
    /// first; without interactive waiters, the first of all. Only messages whose scope
    /// has room wait here, so none blocks the queue.
    queue: VecDeque<(u64, Lane)>,
    next_ticket: u64,
}

/// How long after the last interactive review batch keeps leaving the reserve free.
const RESERVE_HOLD: Duration = Duration::from_secs(60);

/// Provider call slots of this process: first come, first served, interactive first.
pub struct Slots {
    state: Mutex<SlotState>,
    changed: Arc<Notify>,
}

/// One slot; freed when dropped, waking the waiters.
pub struct Slot {
    slots: Arc<Slots>,
    lane: Lane,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.slots.state.lock().expect("slots lock");
        st.free += 1;
        if self.lane == Lane::Batch {
            st.batch_running -= 1;
        }
        drop(st);
        self.slots.changed.notify_waiters();
    }
}

/// An interactive review in flight (see `Slots::interactive_started`).
pub struct InFlight(Arc<Slots>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.state.lock().expect("slots lock").interactive_in_flight -= 1;
        self.0.changed.notify_waiters();
    }
}

impl Slots {
    /// `n` call slots; batch keeps `batch_min` of them whenever it has work (at most `n`)
    /// and, beyond that minimum, leaves `interactive_reserve` free (at most what is left).
    pub fn new(n: usize, batch_min: usize, interactive_reserve: usize, changed: Arc<Notify>) -> Arc<Slots> {
        let batch_min = batch_min.min(n);
        let state = SlotState {
            free: n,
            batch_running: 0,
            batch_min,
            interactive_reserve: interactive_reserve.min(n - batch_min),
            interactive_seen: None,
            interactive_in_flight: 0,
            queue: VecDeque::new(),
            next_ticket: 0,
        };
        Arc::new(Slots { state: Mutex::new(state), changed })
    }

    /// Whether batch runs fewer calls than it keeps at least (it may pull even while
    /// interactive work is backlogged).
    pub fn batch_below_min(&self) -> bool {
        let st = self.state.lock().expect("slots lock");
        st.batch_running < st.batch_min
    }

    /// Whether an interactive review asked for a slot within `d`: interactive work is
    /// about, and what can wait (a provider batch's results) gives way to it.
    pub fn interactive_within(&self, d: Duration) -> bool {
        let st = self.state.lock().expect("slots lock");
        st.interactive_seen.is_some_and(|at| at.elapsed() < d)
    }

    /// An interactive review admitted here: it counts as in flight until the guard is
    /// dropped, after its settlement.
    pub fn interactive_started(self: &Arc<Self>) -> InFlight {
        self.state.lock().expect("slots lock").interactive_in_flight += 1;
        InFlight(self.clone())
    }

    /// Waits until no interactive review is in flight here, or `most` has passed: what
    /// can wait (a provider batch's results) goes between interactive reviews, not
    /// beside them, yet never stops while they keep coming. `true`: none in flight.
    pub async fn interactive_settled(&self, most: Duration) -> bool {
        let until = tokio::time::Instant::now() + most;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.state.lock().expect("slots lock").interactive_in_flight == 0 {
                return true;
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(until) => return false,
            }
        }
    }

    fn join(&self, lane: Lane) -> u64 {
        let mut st = self.state.lock().expect("slots lock");
        if lane == Lane::Interactive {
            st.interactive_seen = Some(tokio::time::Instant::now());
        }
        let t = st.next_ticket;
        st.next_ticket += 1;
        st.queue.push_back((t, lane));
        t
    }

    fn leave(&self, ticket: u64) {
        let mut st = self.state.lock().expect("slots lock");
        st.queue.retain(|(t, _)| *t != ticket);
        drop(st);
        // The head may have changed.
        self.changed.notify_waiters();
    }

    /// A slot for `ticket` if one is free and it is this ticket's turn.
    fn try_take(self: &Arc<Self>, ticket: u64) -> Option<Slot> {
        let mut st = self.state.lock().expect("slots lock");
        if st.free == 0 {
            return None;
        }
        // Interactive first, except that batch keeps its minimum.
        let first = |lane: Lane| st.queue.iter().find(|(_, l)| *l == lane);
        let head = if st.batch_running < st.batch_min { first(Lane::Batch) } else { None }
            .or(first(Lane::Interactive))
            .or(st.queue.front())
            .copied();
        let (t, lane) = head?;
        if t != ticket || !st.may_take(lane) {
            return None;
        }
        st.queue.retain(|(t, _)| *t != ticket);
        Some(self.take(&mut st, lane))
    }

    /// A slot for one more call of an admitted message of `lane`, if one is free that
    /// no waiting message is in line for and beyond the interactive reserve: like batch
    /// past its minimum, the other parts of a split review leave those slots free, so
    /// an interactive review arriving while they fill the pool starts at once. Never
    /// queues.
    fn take_free(self: &Arc<Self>, lane: Lane) -> Option<Slot> {
        let mut st = self.state.lock().expect("slots lock");
        if !st.queue.is_empty() || st.free <= st.interactive_reserve || !st.may_take(lane) {
            return None;
        }
        Some(self.take(&mut st, lane))
    }

    fn take(self: &Arc<Self>, st: &mut SlotState, lane: Lane) -> Slot {
        st.free -= 1;
        if lane == Lane::Batch {
            st.batch_running += 1;
        }
        Slot { slots: self.clone(), lane }
    }
}

impl SlotState {
    /// Whether a free slot may go to `lane`: past its minimum, batch does not take the
    /// slots kept for interactive work while interactive work is about; batch alone
    /// uses every slot.
    fn may_take(&self, lane: Lane) -> bool {
        let interactive_about = self.interactive_seen.is_some_and(|at| at.elapsed() < RESERVE_HOLD);
        !(lane == Lane::Batch
            && interactive_about
            && self.batch_running >= self.batch_min
            && self.free <= self.interactive_reserve)
    }
}

/// Whether the interactive lane's oldest waiting review is older than its threshold;
/// batch loops stop pulling while it is.
#[derive(Clone, Default)]
pub struct Backlog(Arc<AtomicBool>);

impl Backlog {
    pub fn set(&self, v: bool) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

pub struct LaneLoop {
    pub lane: Lane,
    pub scope: Scope,
    /// The other deployments of the class: while this loop's deployment steps aside for
    /// them (`pool::steps_aside`), the loop pulls nothing and hands back what it holds.
    pub others: crate::pool::Others,
    pub consumer: PullConsumer,
    /// The tokens a review's call will be metered for (its prompt, and the output limit
    /// the provider counts at start): what it reserves of the key's budgets.
    pub cost: CallCost,
    /// The class's other deployments, in rank order, for this loop's tenant: where a
    /// split review's parts also run when this deployment has no room for one.
    pub siblings: Arc<Vec<crate::pool::Callee>>,
}

/// What a review's call will be metered for (`None`: a message that does not decode,
/// reserved as the largest call).
pub type CallCost = Arc<dyn Fn(Option<&Decoded>) -> reviewlane_core::meter::Cost + Send + Sync>;

/// A pulled review, decoded once: what its cost is reckoned from and what the worker
/// runs.
pub struct Decoded {
    pub review: ReviewMessage,
    /// `None`: the diff does not parse.
    pub diff: Option<Diff>,
}

impl Decoded {
    /// `None`: the message is not a review.
    pub fn of(payload: &[u8]) -> Option<Decoded> {
        let review: ReviewMessage = serde_json::from_slice(payload).ok()?;
        let diff = review.parse_diff().ok();
        Some(Decoded { review, diff })
    }
}

/// Where one call runs: a call slot of this process and a place in its scope's
/// allowance, both held until dropped.
pub struct Place {
    pub slot: Slot,
    pub running: ScopeGuard,
}

/// What a started message needs to run.
pub struct Admitted {
    pub msg: jetstream::Message,
    /// `None`: the message is not a review.
    pub decoded: Option<Decoded>,
    pub scope: Scope,
    pub place: Place,
    /// What its call reserved in the key's budgets, if any.
    pub reserved: Option<Reservation>,
    /// Further calls for the same message (the other parts of a split review).
    pub more: More,
}

/// Further calls for an admitted message, each taken only when it may start at once.
#[derive(Clone)]
pub struct More {
    slots: Arc<Slots>,
    lane: Lane,
    scope: Scope,
    quota: Quota,
    siblings: Arc<Vec<crate::pool::Callee>>,
    /// Shutdown: no new calls (those in flight finish, the message goes back).
    stop: CancellationToken,
}

/// Where one more call of a delivery may start: its place, its reservation, and the
/// deployment it goes to when not the admitting one.
pub type Taken = (Place, Option<Reservation>, Option<crate::pool::Callee>);

impl More {
    fn new(slots: &Arc<Slots>, l: &LaneLoop, quota: &Quota, stop: &CancellationToken) -> More {
        let (slots, scope, quota, stop) = (slots.clone(), l.scope.clone(), quota.clone(), stop.clone());
        More { slots, lane: l.lane, scope, quota, siblings: l.siblings.clone(), stop }
    }

    /// A place and a reservation for one more call, if it may start now: a slot is free
    /// that no waiting message is in line for, and a deployment of the class can take
    /// the call — the admitting one first (`own`), then the others in rank order. One
    /// can when it is in routing and not paused, the tenant's scope on it has room (its
    /// share of the window, its tenant's fair share and cap), and its budgets have room
    /// for the call (`cost_on` that deployment). Never waits and never queues, so the
    /// parts of one review take no place that another message waits for.
    pub async fn try_take(
        &self,
        own: &crate::pool::Deployment,
        cost_on: impl Fn(&crate::pool::Deployment) -> reviewlane_core::meter::Cost,
    ) -> Option<Taken> {
        let open = |quota: &Quota, scope: &Scope| quota.paused_for().is_none() && quota.has_room(scope);
        let sibling_open =
            |c: &&crate::pool::Callee| !c.deployment.quota.circuit_open() && open(&c.deployment.quota, &c.scope);
        let own_open = open(&self.quota, &self.scope);
        if self.stop.is_cancelled() || (!own_open && !self.siblings.iter().any(|c| sibling_open(&c))) {
            return None;
        }
        let slot = self.slots.take_free(self.lane)?;
        if own_open && let Some((running, reserved)) = take_on(&self.quota, &self.scope, || cost_on(own)).await {
            return Some((Place { slot, running }, reserved, None));
        }
        for sibling in self.siblings.iter().filter(sibling_open) {
            let quota = &sibling.deployment.quota;
            if let Some((running, reserved)) = take_on(quota, &sibling.scope, || cost_on(&sibling.deployment)).await {
                return Some((Place { slot, running }, reserved, Some(sibling.clone())));
            }
        }
        None
    }
}

/// The scope's allowance and a reservation on one deployment's key, if its budgets
/// have room for the call now.
async fn take_on(
    quota: &Quota,
    scope: &Scope,
    cost: impl FnOnce() -> reviewlane_core::meter::Cost,
) -> Option<(ScopeGuard, Option<Reservation>)> {
    let running = quota.try_start(scope)?;
    let reserved = reserve(quota, cost).await.ok()?;
    Some((running, reserved))
}

/// What a loop hands the worker.
pub enum Work {
    /// A call may be made: the slot and the scope's allowance are held.
    Call(Box<Admitted>),
    /// The review's deadline passed while its scope was paused: it ends without a call
    /// (and without a slot).
    Late { msg: Box<jetstream::Message>, decoded: Option<Box<Decoded>>, scope: Scope },
}

/// What to do with a review pulled while its scope is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhilePaused {
    /// Its deadline has passed: end it.
    Late,
    /// Back on the lane until the pause ends or its deadline passes, whichever is first.
    HandBack(Duration),
}

/// Comes back just after the deadline, not just before it.
const DEADLINE_MARGIN: Duration = Duration::from_millis(20);

/// The pure rule for a review met while its scope is paused for `remaining`.
pub fn while_paused(deadline_ms: Option<u64>, now_ms: u64, remaining: Duration) -> WhilePaused {
    match deadline_ms {
        Some(d) if d <= now_ms => WhilePaused::Late,
        Some(d) => WhilePaused::HandBack(remaining.min(Duration::from_millis(d - now_ms) + DEADLINE_MARGIN)),
        None => WhilePaused::HandBack(remaining),
    }
}

/// A review message's deadline, read without keeping the rest of it.
fn deadline_of(msg: &jetstream::Message) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Deadline {
        #[serde(default)]
        deadline_ms: Option<u64>,
    }
    serde_json::from_slice::<Deadline>(&msg.payload).ok()?.deadline_ms
}

/// Waits until `ready()` holds, re-checking whenever capacity changes (or every
/// `max_wait`). Returns false if `stop` fired.
async fn wait_until(
    changed: &Notify,
    stop: &CancellationToken,
    max_wait: Duration,
    mut ready: impl FnMut() -> bool,
) -> bool {
    loop {
        let notified = changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if ready() {
            return true;
        }
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(max_wait) => {}
            _ = stop.cancelled() => return false,
        }
    }
}

/// Serves one (lane, tenant) consumer until `stop`. `run` gets each admitted message.
#[allow(clippy::too_many_arguments)]
pub async fn serve<F, Fut>(
    l: LaneLoop,
    mut puller: Puller,
    slots: Arc<Slots>,
    quota: Quota,
    backlog: Backlog,
    lease: Duration,
    tasks: TaskTracker,
    stop: CancellationToken,
    run: F,
) where
    F: Fn(Work) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let changed = quota.changed.clone();
    loop {
        // Pull for a scope this replica has a share of: to call (batch only without
        // backlog), or while the scope is paused to hand reviews back until the pause
        // ends or their deadline passes.
        let pull_ok = || {
            quota.allowance(&l.scope) > 0
                && !crate::pool::steps_aside(&quota, &l.others)
                && (quota.paused_for().is_some()
                    || l.lane == Lane::Interactive
                    || !backlog.get()
                    || slots.batch_below_min())
        };
        if !wait_until(&changed, &stop, Duration::from_millis(500), pull_ok).await {
            return;
        }
        if !puller.ask(1, &stop).await {
            return;
        }
        let msg = tokio::select! {
            m = puller.next() => m,
            _ = stop.cancelled() => return,
        };
        // The request expired (or the server ended or lost it): pull again.
        let Some(msg) = msg else { continue };
        if crate::pool::steps_aside(&quota, &l.others) {
            ack(&msg, AckKind::Nak(crate::pool::hand_over_delay(&l.others))).await;
            continue;
        }
        if let Some(remaining) = quota.paused_for() {
            match while_paused(deadline_of(&msg), quota.now_ms(), remaining) {
                WhilePaused::Late => {
                    let decoded = Decoded::of(&msg.payload).map(Box::new);
                    tasks.spawn(run(Work::Late { msg: Box::new(msg), decoded, scope: l.scope.clone() }));
                }
                WhilePaused::HandBack(delay) => ack(&msg, AckKind::Nak(Some(delay))).await,
            }
            continue;
        }
        match admit(&l, msg, &slots, &quota, lease, &stop).await {
            Some(admitted) => {
                let work = run(Work::Call(Box::new(admitted)));
                match l.lane {
                    Lane::Interactive => {
                        let in_flight = slots.interactive_started();
                        tasks.spawn(async move {
                            work.await;
                            drop(in_flight);
                        });
                    }
                    Lane::Batch => {
                        tasks.spawn(work);
                    }
                }
            }
            None if stop.is_cancelled() => return,
            None => {}
        }
    }
}

/// Waits for a slot and the scope's allowance while keeping the message's lease alive.
/// Hands the message back (and returns `None`) when its scope is paused, when this
/// replica has no share of the scope, or at shutdown.
async fn admit(
    l: &LaneLoop,
    msg: jetstream::Message,
    slots: &Arc<Slots>,
    quota: &Quota,
    lease: Duration,
    stop: &CancellationToken,
) -> Option<Admitted> {
    let mut heartbeat = reviewlane_shared::pull::heartbeat(lease / 3);
    let decoded = Decoded::of(&msg.payload);
    // While here, the tenant counts as wanting calls (its weighted share is kept for it).
    let _waiting = quota.waiting(&l.scope);
    let mut ticket: Option<u64> = None;
    let hand_back = |ticket: Option<u64>| ticket.map(|t| slots.leave(t));
    loop {
        // Until a pause ends, or just past the deadline (then ended as late); at once when
        // this replica lost its share (another replica joined): let others take it.
        let back = match quota.paused_for() {
            // Another deployment of the class takes it: at once, or when it has room.
            _ if crate::pool::steps_aside(quota, &l.others) => Some(crate::pool::hand_over_delay(&l.others)),
            Some(remaining) => Some(Some(back_for(&msg, quota, remaining))),
            None => (quota.allowance(&l.scope) == 0).then_some(None),
        };
        if let Some(delay) = back {
            hand_back(ticket);
            ack(&msg, AckKind::Nak(delay)).await;
            return None;
        }
        let notified = quota.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if quota.has_room(&l.scope) {
            let t = *ticket.get_or_insert_with(|| slots.join(l.lane));
            if let Some(slot) = slots.try_take(t) {
                ticket = None;
                match quota.try_start(&l.scope) {
                    Some(running) => match reserve(quota, || (l.cost)(decoded.as_ref())).await {
                        Ok(reserved) => {
                            let more = More::new(slots, l, quota, stop);
                            let place = Place { slot, running };
                            let scope = l.scope.clone();
                            return Some(Admitted { msg, decoded, scope, place, reserved, more });
                        }
                        // The key's budgets have no room for this call yet. Calls in
                        // flight may give part of their reservation back when they are
                        // answered: wait here (no lease, no slot) until one does, or for
                        // at most the wait, and look again. With none in flight, back to
                        // the lane until they have room (or just past its deadline): no
                        // lease taken, no retry spent.
                        Err(wait) => {
                            drop((running, slot));
                            quota.refused_for(wait);
                            if l.others.can_take() {
                                // Another deployment of the class may have the budget.
                                ack(&msg, AckKind::Nak(None)).await;
                                return None;
                            }
                            if quota.fleet_in_flight() == 0 {
                                ack(&msg, AckKind::Nak(Some(back_for(&msg, quota, wait)))).await;
                                return None;
                            }
                            if !wait_for_give_back(quota, wait, &mut heartbeat, &msg, stop).await {
                                return None;
                            }
                            continue;
                        }
                    },
                    // Lost a race for the scope's last place: the slot goes to the next.
                    None => drop(slot),
                }
            }
        } else if let Some(t) = ticket.take() {
            // Wait for the scope outside the queue, so others are served meanwhile.
            slots.leave(t);
        }
        tokio::select! {
            _ = notified => {}
            _ = heartbeat.tick() => ack(&msg, AckKind::Progress).await,
            // A pause may end without a notification.
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.cancelled() => {
                hand_back(ticket);
                ack(&msg, AckKind::Nak(None)).await;
                return None;
            }
        }
    }
}

/// How long a message goes back to its lane for: until `wait` is over, or just past its
/// deadline when that comes first (then it ends as late).
fn back_for(msg: &jetstream::Message, quota: &Quota, wait: Duration) -> Duration {
    match while_paused(deadline_of(msg), quota.now_ms(), wait) {
        WhilePaused::Late => Duration::ZERO,
        WhilePaused::HandBack(d) => d,
    }
}

/// Waits, holding no lease and no slot, until a call in flight gives back part of its
/// reservation, or `wait` (at most `BUDGET_RECHECK`) is over; keeps the message's ack
/// wait alive meanwhile. `false` when stopping (the message is handed back).
async fn wait_for_give_back(
    quota: &Quota,
    wait: Duration,
    heartbeat: &mut tokio::time::Interval,
    msg: &jetstream::Message,
    stop: &CancellationToken,
) -> bool {
    tokio::select! {
        _ = quota.budgets().given_back.notified() => {}
        _ = tokio::time::sleep(wait.min(BUDGET_RECHECK)) => {}
        _ = heartbeat.tick() => ack(msg, AckKind::Progress).await,
        _ = stop.cancelled() => {
            ack(msg, AckKind::Nak(None)).await;
            return false;
        }
    }
    true
}

/// Longest a review refused by the key's budgets waits before it looks again while calls
/// are in flight (their answers' usage may give back what they reserved; another
/// replica's give-back is not signalled here).
const BUDGET_RECHECK: Duration = Duration::from_secs(1);

/// Reserves a call costing `cost()` in the key's budgets (reckoned only when the key
/// has budgets); `Err`: how long until they have room. A call larger than a whole
/// budget goes ahead unreserved (logged): the part budget is capped so that it cannot
/// happen, and the provider still answers 429.
async fn reserve(
    quota: &Quota,
    cost: impl FnOnce() -> reviewlane_core::meter::Cost,
) -> Result<Option<Reservation>, Duration> {
    if !quota.budgets().has_budgets() {
        return Ok(None);
    }
    match quota.budgets().reserve_call(cost()).await {
        Ok(reserved) => Ok(Some(reserved)),
        Err(crate::quota::bucket::Refused::Wait(wait)) => Err(wait),
        Err(crate::quota::bucket::Refused::TooLarge { capacity }) => {
            tracing::error!(capacity, "a call larger than the key's whole budget; sent unreserved");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn interactive_work_is_about_for_a_while_after_it_last_asked_for_a_slot() {
        let slots = Slots::new(2, 1, 0, Arc::new(Notify::new()));
        let about = Duration::from_secs(5);
        assert!(!slots.interactive_within(about), "none yet");
        let b = slots.join(Lane::Batch);
        slots.leave(b);
        assert!(!slots.interactive_within(about), "batch work alone is not interactive work");
        let i = slots.join(Lane::Interactive);
        slots.leave(i);
        assert!(slots.interactive_within(about));
        tokio::time::advance(about).await;
        assert!(!slots.interactive_within(about), "over once it stopped asking");
    }

    #[tokio::test(start_paused = true)]
    async fn what_can_wait_goes_between_interactive_reviews_but_never_stops() {
        let slots = Slots::new(2, 1, 0, Arc::new(Notify::new()));
        let most = Duration::from_millis(250);
        let t0 = tokio::time::Instant::now();
        assert!(slots.interactive_settled(most).await, "none in flight: at once");
        assert_eq!(t0.elapsed(), Duration::ZERO);

        // One in flight, settled 40 ms later: the wait ends then, not at `most`.
        let review = slots.interactive_started();
        let settle = async {
            tokio::time::sleep(Duration::from_millis(40)).await;
            drop(review);
        };
        let (settled, ()) = tokio::join!(slots.interactive_settled(most), settle);
        assert!(settled);
        assert_eq!(t0.elapsed(), Duration::from_millis(40));

        // Two in flight: both must settle.
        let (a, b) = (slots.interactive_started(), slots.interactive_started());
        let t1 = tokio::time::Instant::now();
        let settle = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            drop(a);
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(b);
        };
        let (settled, ()) = tokio::join!(slots.interactive_settled(most), settle);
        assert!(settled);
        assert_eq!(t1.elapsed(), Duration::from_millis(30));

        // One that never settles: the wait gives up at `most`.
        let _stuck = slots.interactive_started();
        let t2 = tokio::time::Instant::now();
        assert!(!slots.interactive_settled(most).await);
        assert_eq!(t2.elapsed(), most);
    }

    #[test]
    fn interactive_first_but_batch_keeps_its_minimum() {
        let slots = Slots::new(2, 1, 0, Arc::new(Notify::new()));
        let i1 = slots.join(Lane::Interactive);
        let i2 = slots.join(Lane::Interactive);
        let b1 = slots.join(Lane::Batch);
        // Batch runs nothing: its first waiter goes before the interactive ones.
        assert!(slots.try_take(i1).is_none());
        let batch = slots.try_take(b1).expect("batch keeps one slot");
        let first = slots.try_take(i1).expect("then interactive");
        assert!(slots.try_take(i2).is_none(), "no slot free");
        // At its minimum, batch waits behind interactive work.
        let b2 = slots.join(Lane::Batch);
        drop(first);
        assert!(slots.try_take(b2).is_none());
        let second = slots.try_take(i2).expect("interactive first");
        // The batch call ends: batch is below its minimum again and goes first.
        drop(batch);
        assert!(slots.batch_below_min());
        let _b2 = slots.try_take(b2).expect("batch's minimum again");
        drop(second);
    }

    /// Batch slots taken, asking for up to `n`.
    fn take_batch(slots: &Arc<Slots>, n: usize) -> Vec<Slot> {
        let mut held = Vec::new();
        for _ in 0..n {
            let t = slots.join(Lane::Batch);
            match slots.try_take(t) {
                Some(s) => held.push(s),
                None => slots.leave(t),
            }
        }
        held
    }

    #[tokio::test(start_paused = true)]
    async fn batch_leaves_the_reserve_free_while_interactive_work_is_about() {
        let slots = Slots::new(4, 1, 1, Arc::new(Notify::new()));
        // Batch alone uses every slot.
        let all = take_batch(&slots, 4);
        assert_eq!(all.len(), 4);
        drop(all);
        // An interactive review came: batch now fills all but the reserved slot, and the
        // next interactive review starts at once.
        let first = slots.try_take(slots.join(Lane::Interactive)).expect("a free slot");
        drop(first);
        let batch = take_batch(&slots, 4);
        assert_eq!(batch.len(), 3, "batch leaves the reserve free");
        let next = slots.try_take(slots.join(Lane::Interactive)).expect("starts at once");
        drop((batch, next));
        // A while without interactive work: batch has every slot again.
        tokio::time::advance(RESERVE_HOLD).await;
        assert_eq!(take_batch(&slots, 4).len(), 4);
        // The reserve is never more than what batch's minimum leaves.
        let tight = Slots::new(2, 2, 1, Arc::new(Notify::new()));
        drop(tight.try_take(tight.join(Lane::Interactive)));
        assert_eq!(take_batch(&tight, 2).len(), 2);
    }

    #[test]
    fn more_calls_of_an_admitted_review_take_only_slots_nobody_waits_for_beyond_the_reserve() {
        let slots = Slots::new(4, 1, 1, Arc::new(Notify::new()));
        let first = slots.try_take(slots.join(Lane::Interactive)).expect("admitted");
        // Two more: the last free slot is the interactive reserve.
        let more: Vec<_> = (0..3).filter_map(|_| slots.take_free(Lane::Interactive)).collect();
        assert_eq!(more.len(), 2);
        // The reserve goes to the next review at once.
        let next = slots.join(Lane::Interactive);
        let arriving = slots.try_take(next).expect("the reserve");
        // A slot freed while a review waits for one goes to it, not to more calls.
        let waiting = slots.join(Lane::Interactive);
        drop(more);
        assert!(slots.take_free(Lane::Interactive).is_none(), "a review waits");
        let served = slots.try_take(waiting).expect("the waiting review");
        assert!(slots.take_free(Lane::Interactive).is_none(), "only the reserve is free");
        drop((first, arriving, served));
        let idle: Vec<_> = (0..4).filter_map(|_| slots.take_free(Lane::Interactive)).collect();
        assert_eq!(idle.len(), 3, "an idle pool less the reserve");
    }

    #[test]
    fn a_review_met_while_its_scope_is_paused_comes_back_by_its_deadline() {
        let pause = Duration::from_secs(30);
        assert_eq!(while_paused(Some(10_000), 10_000, pause), WhilePaused::Late);
        assert_eq!(while_paused(Some(9_000), 10_000, pause), WhilePaused::Late);
        assert_eq!(
            while_paused(Some(12_000), 10_000, pause),
            WhilePaused::HandBack(Duration::from_millis(2_000) + DEADLINE_MARGIN),
            "back just after its deadline, before the pause ends"
        );
        assert_eq!(
            while_paused(Some(100_000), 10_000, pause),
            WhilePaused::HandBack(pause),
            "back when the pause ends"
        );
        assert_eq!(while_paused(None, 10_000, pause), WhilePaused::HandBack(pause));
    }

    #[test]
    fn without_interactive_work_batch_takes_every_slot() {
        let slots = Slots::new(3, 1, 0, Arc::new(Notify::new()));
        let held: Vec<_> = (0..3).map(|_| slots.join(Lane::Batch)).map(|t| slots.try_take(t).unwrap()).collect();
        assert_eq!(held.len(), 3);
        assert!(!slots.batch_below_min());
    }
}
