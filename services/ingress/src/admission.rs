//! Admission, per tenant: a tenant's predicted queue age (its reviews waiting on the lane
//! / its weighted share of the lane's recent throughput, all from stream and consumer
//! metadata, never content) against the lane's window decides whether its review is
//! accepted, accepted at reduced depth (`changed_hunks`), or refused with a retry
//! delay; and a tenant may hold at most its share of the lane's bound. So a flooding
//! tenant is refused while the others are still admitted. The decisions are pure
//! functions; `Sampler` keeps their inputs current.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use reviewlane_core::region::{Lane, Region};
use reviewlane_shared::layout;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LanePolicy {
    /// The lane's service window: a review should be done within it.
    pub window: Duration,
    /// Predicted ages up to `window * degrade_factor` are served at reduced depth.
    pub degrade_factor: f64,
    /// Below this many waiting reviews, accept without a prediction (cold start).
    pub min_waiting: u64,
    /// A review's deadline when its submit sets none.
    pub deadline: Duration,
}

/// How long a review submitted now is predicted to wait before it is served: the
/// reviews waiting ahead of it over the lane's recent throughput. `None` when there is
/// no prediction to act on: fewer waiting than `min_waiting` (cold start, as for
/// admission), or no throughput measured yet. Only a prediction ends a job at admission.
pub fn predicted_wait(waiting: u64, per_sec: Option<f64>, min_waiting: u64) -> Option<Duration> {
    if waiting < min_waiting.max(1) {
        return None;
    }
    match per_sec {
        Some(r) if r > 0.0 => Some(Duration::from_secs_f64((waiting as f64 / r).min(1e9))),
        _ => None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    Accept,
    Degrade,
    Refuse { retry_after: Duration },
}

/// `waiting`: reviews on the lane; `per_sec`: recent completions per second while the
/// lane had work, `None` before any busy interval was seen (then the bounded lane is
/// the only limit).
pub fn decide(waiting: u64, per_sec: Option<f64>, p: &LanePolicy) -> Decision {
    let Some(per_sec) = per_sec else { return Decision::Accept };
    if waiting < p.min_waiting {
        return Decision::Accept;
    }
    let predicted = if per_sec > 0.0 { waiting as f64 / per_sec } else { f64::INFINITY };
    let window = p.window.as_secs_f64();
    if predicted <= window {
        Decision::Accept
    } else if predicted <= window * p.degrade_factor {
        Decision::Degrade
    } else {
        // Come back when the excess over the degrade bound has drained; at least 1 s,
        // at most the window (a stalled lane is not predicted to ever drain).
        let excess = predicted - window * p.degrade_factor;
        let retry = if excess.is_finite() { excess.clamp(1.0, window.max(1.0)) } else { window.max(1.0) };
        Decision::Refuse { retry_after: Duration::from_secs_f64(retry) }
    }
}

/// A tenant's decision: `decide` on its own reviews waiting, against its weighted share
/// of the lane's throughput (`weight` of the `active_weight` of the tenants with work
/// waiting, itself included) — and a refusal once it holds `bound` reviews on the lane.
pub fn decide_for_tenant(
    waiting: u64,
    bound: u64,
    lane_per_sec: Option<f64>,
    weight: u32,
    active_weight: u32,
    p: &LanePolicy,
) -> Decision {
    if waiting >= bound {
        return Decision::Refuse { retry_after: p.window.clamp(Duration::from_secs(1), Duration::from_secs(30)) };
    }
    let share = f64::from(weight.max(1)) / f64::from(active_weight.max(weight).max(1));
    decide(waiting, lane_per_sec.map(|r| r * share), p)
}

/// Throughput of a work-queue stream from its metadata: reviews removed (done or
/// dead-lettered) = last sequence - messages still there, over a sliding horizon of
/// busy samples. Idle time (nothing waiting, nothing removed) is left out, so the rate
/// reflects capacity, not demand.
#[derive(Debug, Default, Clone)]
struct LaneSample {
    waiting: u64,
    per_sec: Option<f64>,
    /// (time, removed so far) while busy, oldest first, spanning at most `HORIZON`.
    busy: VecDeque<(Instant, u64)>,
    removed: u64,
}

/// Rates are measured over this much busy time.
const HORIZON: Duration = Duration::from_secs(10);

/// (region, lane, tenant).
type TenantLane = (Region, Lane, String);

/// Keeps (waiting, throughput) per (region, lane), and waiting per tenant, fresh.
#[derive(Clone, Default)]
pub struct Sampler {
    lanes: Arc<Mutex<HashMap<(Region, Lane), LaneSample>>>,
    /// Reviews of a tenant on a lane (not yet done: waiting or in progress).
    tenants: Arc<Mutex<HashMap<TenantLane, u64>>>,
    /// Each lane's bound (its stream's maximum messages).
    bounds: Arc<Mutex<HashMap<(Region, Lane), u64>>>,
}

/// What a tenant's admission needs to know.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantView {
    pub waiting: u64,
    pub lane_per_sec: Option<f64>,
    pub lane_bound: u64,
    /// Weights of the tenants with work on the lane (this one excluded).
    pub others_active_weight: u32,
}

impl Sampler {
    pub fn get(&self, region: Region, lane: Lane) -> (u64, Option<f64>) {
        let l = self.lanes.lock().expect("sampler lock");
        l.get(&(region, lane)).map(|s| (s.waiting, s.per_sec)).unwrap_or((0, None))
    }

    /// The view of `tenant` on a lane; `weights` of the region's tenants.
    pub fn tenant(&self, region: Region, lane: Lane, tenant: &str, weights: &[(String, u32)]) -> TenantView {
        let (_, lane_per_sec) = self.get(region, lane);
        let t = self.tenants.lock().expect("sampler lock");
        let waiting_of = |id: &str| t.get(&(region, lane, id.to_string())).copied().unwrap_or(0);
        let others_active_weight =
            weights.iter().filter(|(id, _)| id != tenant && waiting_of(id) > 0).map(|(_, w)| *w).sum();
        let lane_bound = self.bounds.lock().expect("sampler lock").get(&(region, lane)).copied().unwrap_or(u64::MAX);
        TenantView { waiting: waiting_of(tenant), lane_per_sec, lane_bound, others_active_weight }
    }

    fn record(&self, region: Region, lane: Lane, messages: u64, last_seq: u64, now: Instant) {
        let mut l = self.lanes.lock().expect("sampler lock");
        let s = l.entry((region, lane)).or_default();
        let removed = last_seq.saturating_sub(messages);
        let idle = messages == 0 && removed == s.removed;
        s.waiting = messages;
        s.removed = removed;
        if idle {
            // Keep the last busy rate; the next busy spell starts a new horizon.
            s.busy.clear();
            return;
        }
        s.busy.push_back((now, removed));
        while s.busy.len() > 2 && s.busy.front().is_some_and(|(t, _)| now.duration_since(*t) > HORIZON) {
            s.busy.pop_front();
        }
        let (t0, r0) = *s.busy.front().expect("just pushed");
        let span = now.duration_since(t0);
        if removed > r0 && !span.is_zero() {
            s.per_sec = Some((removed - r0) as f64 / span.as_secs_f64());
        } else if span >= HORIZON {
            // Busy for a whole horizon without finishing anything: stalled.
            s.per_sec = Some(0.0);
        }
    }

    /// Samples every lane of `region`, and each of `tenants`' reviews on it (from the
    /// extractor's consumer of that tenant, and its consumer of reviews at depth
    /// `changed_hunks` for a tenant that gives them a class of their own: the `bool`),
    /// every `period` until `stop`.
    pub async fn run(
        self,
        region: Region,
        js: jetstream::Context,
        tenants: Vec<(String, bool)>,
        period: Duration,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(period);
        loop {
            tokio::select! { _ = tick.tick() => {}, _ = stop.cancelled() => return }
            for lane in Lane::ALL {
                match js.get_stream(layout::lane_stream(region, lane)).await {
                    Ok(mut s) => {
                        if let Ok(info) = s.info().await {
                            self.record(region, lane, info.state.messages, info.state.last_sequence, Instant::now());
                            let bound = u64::try_from(info.config.max_messages).unwrap_or(u64::MAX);
                            self.bounds.lock().expect("sampler lock").insert((region, lane), bound);
                        }
                        for (tenant, splits_depth) in &tenants {
                            let mut names = vec![layout::lane_consumer(lane, tenant)];
                            if *splits_depth {
                                names.push(layout::lane_depth_consumer(lane, tenant));
                            }
                            let mut waiting = None;
                            for name in names {
                                let Ok(mut c) = s.get_consumer::<jetstream::consumer::pull::Config>(&name).await else {
                                    continue;
                                };
                                if let Ok(info) = c.info().await {
                                    *waiting.get_or_insert(0) += info.num_pending + info.num_ack_pending as u64;
                                }
                            }
                            if let Some(waiting) = waiting {
                                self.tenants
                                    .lock()
                                    .expect("sampler lock")
                                    .insert((region, lane, tenant.clone()), waiting);
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, region = %region, lane = lane.as_str(), "lane sample failed"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: LanePolicy = LanePolicy {
        window: Duration::from_secs(10),
        degrade_factor: 2.0,
        min_waiting: 4,
        deadline: Duration::from_secs(60),
    };

    #[test]
    fn the_predicted_wait_is_the_backlog_over_the_throughput() {
        assert_eq!(predicted_wait(30, Some(10.0), 4), Some(Duration::from_secs(3)));
        // No prediction: cold start, nothing measured, nothing served lately.
        assert_eq!(predicted_wait(3, Some(10.0), 4), None);
        assert_eq!(predicted_wait(5, None, 4), None);
        assert_eq!(predicted_wait(5, Some(0.0), 4), None);
    }

    #[test]
    fn accept_degrade_refuse_by_predicted_age() {
        assert_eq!(decide(0, Some(0.0), &P), Decision::Accept);
        assert_eq!(decide(3, Some(0.0), &P), Decision::Accept, "few waiting");
        assert_eq!(decide(500, None, &P), Decision::Accept, "no busy interval seen yet");
        assert_eq!(decide(10, Some(1.0), &P), Decision::Accept, "10 s predicted");
        assert_eq!(decide(15, Some(1.0), &P), Decision::Degrade, "15 s");
        assert_eq!(decide(20, Some(1.0), &P), Decision::Degrade, "20 s");
        assert_eq!(decide(25, Some(1.0), &P), Decision::Refuse { retry_after: Duration::from_secs(5) });
        // A stalled lane (busy, nothing done) refuses, retrying after the window.
        assert_eq!(decide(5, Some(0.0), &P), Decision::Refuse { retry_after: Duration::from_secs(10) });
        // Retry delay bounded by the window.
        assert_eq!(decide(10_000, Some(1.0), &P), Decision::Refuse { retry_after: Duration::from_secs(10) });
    }

    #[test]
    fn a_flooding_tenant_is_refused_while_another_is_admitted() {
        // The lane serves 1 review/s; two tenants of equal weight have work.
        let rate = Some(1.0);
        // The flooder: 40 waiting against half the throughput: 80 s predicted.
        assert!(matches!(decide_for_tenant(40, 1_000, rate, 1, 2, &P), Decision::Refuse { .. }));
        // The other: 3 waiting: accepted.
        assert_eq!(decide_for_tenant(3, 1_000, rate, 1, 2, &P), Decision::Accept);
        // Alone, a tenant has the whole throughput: 15 waiting is 15 s, degraded.
        assert_eq!(decide_for_tenant(15, 1_000, rate, 1, 1, &P), Decision::Degrade);
        // A weight of 3 against 1: three quarters of the throughput.
        assert_eq!(decide_for_tenant(7, 1_000, rate, 3, 4, &P), Decision::Accept);
        // Its share of the lane's bound is full: refused whatever the prediction.
        assert!(matches!(decide_for_tenant(50, 50, None, 1, 1, &P), Decision::Refuse { .. }));
    }

    #[test]
    fn throughput_from_removed_messages_over_busy_time() {
        let s = Sampler::default();
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        s.record(Region::Us, Lane::Batch, 100, 100, at(0));
        assert_eq!(s.get(Region::Us, Lane::Batch), (100, None), "unknown before anything finished");
        s.record(Region::Us, Lane::Batch, 100, 100, at(1));
        assert_eq!(s.get(Region::Us, Lane::Batch).1, None, "busy without finishing is not yet a stall");
        // 20 removed in 2 s, 10 added.
        s.record(Region::Us, Lane::Batch, 90, 110, at(2));
        let (waiting, rate) = s.get(Region::Us, Lane::Batch);
        assert_eq!(waiting, 90);
        assert!((rate.unwrap() - 10.0).abs() < 1e-9, "{rate:?}");
        // Drained, then idle for a minute: the rate is kept.
        s.record(Region::Us, Lane::Batch, 0, 200, at(4));
        let (_, drained) = s.get(Region::Us, Lane::Batch);
        s.record(Region::Us, Lane::Batch, 0, 200, at(64));
        assert_eq!(s.get(Region::Us, Lane::Batch), (0, drained));
        // A new burst that finishes nothing for a whole horizon: stalled.
        for t in 65..=76 {
            s.record(Region::Us, Lane::Batch, 30, 230, at(t));
        }
        assert_eq!(s.get(Region::Us, Lane::Batch).1, Some(0.0));
    }
}
