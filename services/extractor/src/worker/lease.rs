//! Step 1, lease: read the job (creating its record from the message when the ingress
//! died between its two writes), find whether it needs anything, and take a lease whose
//! generation every later write names. The result cache is read beside it: a hit is a
//! validated result of the same review, reused without a call.
//!
//! A job whose previous holder died after keeping its answer is finished from that
//! answer, without a call. A live lease of another holder, or a retry delay not yet
//! over, hands the message back until then: no second call while one may be running.

use std::ops::ControlFlow;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use reviewlane_core::job::{Event, JobState, TerminalReason, TransitionError};
use reviewlane_shared::job_store::{Created, StoreError};

use reviewlane_core::findings::Validated;
use reviewlane_core::job::JobRecord;
use reviewlane_shared::result_cache::CacheEntry;

use super::parts::Planned;
use super::{Decision, End, Job, Lease, Outcome, Target, Worker};
use crate::quota::CircuitCause;

/// Taking the lease: a held lease (and what for, from `take`), or the trip's end.
type Taken<T> = Result<ControlFlow<End, T>, StoreError>;

/// What a held lease is for.
pub(super) enum Next<'j> {
    /// One call for the whole review.
    Call(Target<'j>),
    /// The same review's validated result is cached: kept without a call.
    Cached(Target<'j>, Validated),
    /// A review larger than the model's context, finished part by part.
    Split(std::sync::Arc<Vec<reviewlane_core::parts::Part>>, reviewlane_core::job::Parts),
}

/// Margin added when handing a message back until another holder's lease ends.
const LEASE_MARGIN: Duration = Duration::from_millis(250);

impl Worker {
    /// Takes the lease (with the result cache read beside it, not after it), then finds
    /// what the job needs: one call, the cached result, its parts — or a decision
    /// without a call (the diff cannot be read back, or it splits too large).
    pub(super) async fn take<'j>(&self, job: &'j Job<'_>) -> Taken<(Box<Lease>, Next<'j>)> {
        let (leased, lookup) = tokio::join!(self.lease(job), self.cache_lookup(job));
        let lease = match leased? {
            ControlFlow::Continue(lease) => lease,
            ControlFlow::Break(end) => return Ok(ControlFlow::Break(end)),
        };
        let Some(diff) = job.diff.as_ref() else {
            let decision = Decision::Terminal { reason: TerminalReason::InvalidInput, status: None };
            return Ok(ControlFlow::Break(End::decided(lease, decision)));
        };
        let whole = Target { diff, text: crate::provider::prompt_diff(job.review, diff), part: None };
        // A split review under way is finished part by part, never from the cache.
        if lease.rec.parts.is_none()
            && let Some(hit) = self.cached(job, lookup)
        {
            return Ok(ControlFlow::Continue((lease, Next::Cached(whole, hit))));
        }
        // A token is at least one byte: a prompt no longer than the budget in bytes fits
        // one call without counting (and never enters `parts`).
        if lease.rec.parts.is_none() && whole.text.len() <= self.policy.parts.plan.limits.budget() {
            return Ok(ControlFlow::Continue((lease, Next::Call(whole))));
        }
        let next = match self.plan_parts(job, &lease).await? {
            Planned::Whole => Next::Call(whole),
            Planned::Split(parts, progress) => Next::Split(parts, progress),
            Planned::Decided(decision) => return Ok(ControlFlow::Break(End::decided(lease, decision))),
        };
        Ok(ControlFlow::Continue((lease, next)))
    }

    pub(super) async fn lease(&self, job: &Job<'_>) -> Taken<Box<Lease>> {
        let id = job.id();
        let (rec, revision) = match self.stores.jobs.get(id).await? {
            Some(found) => found,
            // The message is durable before its record: finish what the ingress began.
            None => match self.stores.jobs.create(&job.review.record()).await? {
                Created::New(rec, revision) => {
                    tracing::info!("job record created from its lane message");
                    let index = reviewlane_shared::job_index::JobIndex::new(self.stores.layout.js.clone(), self.region);
                    index.add(&rec, &job.review.metadata.repository).await?;
                    (rec, revision)
                }
                Created::Exists(_) => self.stores.jobs.get(id).await?.ok_or(StoreError::NotFound)?,
            },
        };
        if !job.review.request_digest.is_empty() && rec.request_digest != job.review.request_digest {
            // A concurrent submit with the same key but other content lost the race for
            // the record: its message is not this job's.
            tracing::warn!("lane message does not match its job record; dropping the message");
            return Ok(ControlFlow::Break(End::answered(Outcome::Skipped, AckKind::Term)));
        }
        let now = self.clock.now_ms();
        match rec.state {
            JobState::Terminal | JobState::Published | JobState::Validated => {
                return Ok(ControlFlow::Break(needs_nothing(rec.state, rec.reason)));
            }
            // The holder's lease is over: it may have kept its answer before it died.
            JobState::Running if rec.lease_expires_at_ms.is_none_or(|until| now >= until) => {
                let generation = rec.generation();
                if let Some(kept) = self.stores.results.read(&rec.tenant, id, generation).await? {
                    tracing::info!(generation, "finishing from the answer a previous holder kept");
                    let decision = Decision::Validated {
                        findings: kept.findings.len(),
                        quarantined: kept.quarantined.len(),
                        dropped: kept.findings_dropped,
                    };
                    return Ok(ControlFlow::Break(End::decided(Box::new(Lease::new(rec)), decision)));
                }
            }
            _ => {}
        }
        let event = Event::Leased {
            owner: reviewlane_core::job::Owner::Replica(job.deployment.quota.replica_id().to_string()),
            lease_expires_at_ms: now + self.policy.lease.as_millis() as u64,
        };
        match self.stores.jobs.apply_tracked(id, Some((rec, revision)), &event, None).await {
            Ok((rec, revision)) => {
                let lease = Box::new(Lease::written(rec, revision));
                // The deployment left routing while the lease was written: hand over.
                if crate::pool::steps_aside(&job.deployment.quota, job.others) {
                    let delay = crate::pool::hand_over_delay(job.others);
                    return Ok(ControlFlow::Break(End::decided(lease, Decision::Release(delay))));
                }
                match self.ends_uncalled(job, &lease.rec).await? {
                    Some(reason) => {
                        Ok(ControlFlow::Break(End::decided(lease, Decision::Terminal { reason, status: None })))
                    }
                    None => Ok(ControlFlow::Continue(lease)),
                }
            }
            Err(StoreError::Transition(TransitionError::LeaseHeld { until_ms: at }, _))
            | Err(StoreError::Transition(TransitionError::NotEligible { at_ms: at }, _)) => {
                let wait = Duration::from_millis(at.saturating_sub(self.clock.now_ms())) + LEASE_MARGIN;
                tracing::debug!(wait_ms = wait.as_millis() as u64, "job held or not yet eligible; handed back");
                Ok(ControlFlow::Break(End::answered(Outcome::Deferred(wait), AckKind::Nak(Some(wait)))))
            }
            Err(StoreError::Transition(_, current)) => {
                tracing::info!(state = current.state.as_str(), "job moved on before lease");
                Ok(ControlFlow::Break(needs_nothing(current.state, current.reason)))
            }
            Err(e) => Err(e),
        }
    }

    /// Why a job just leased ends without a call, if it does: the provider account is
    /// out of money (ended under the lease, so no other holder's job is ended); its
    /// deadline passed while it waited; or it is an item of a cancelled sweep whose call
    /// failed (or whose holder died without keeping an answer).
    async fn ends_uncalled(&self, job: &Job<'_>, rec: &JobRecord) -> Result<Option<TerminalReason>, StoreError> {
        // No other deployment of the class could take it (it would have been handed
        // over): the account's or the key's refusal ends it; a failing deployment is
        // called as usual, each call a probe.
        match job.deployment.quota.circuit_cause() {
            Some(CircuitCause::InsufficientQuota) => return Ok(Some(TerminalReason::InsufficientQuota)),
            Some(CircuitCause::KeyRefused) => return Ok(Some(TerminalReason::UpstreamRejected)),
            Some(CircuitCause::Failing) | None => {}
        }
        if rec.deadline_ms.is_some_and(|d| self.clock.now_ms() >= d) {
            return Ok(Some(TerminalReason::DeadlineExceeded));
        }
        if rec.attempts.leases > 1
            && let Some(sweep) = rec.sweep_id.as_deref()
            && self.sweep_cancelled(&rec.tenant, sweep).await?
        {
            return Ok(Some(TerminalReason::Cancelled));
        }
        Ok(None)
    }

    /// A review whose deadline passed while its scope was paused: leased only to be
    /// ended `deadline_exceeded` (or settled as its record says), never called. Should
    /// this worker's clock not find it late, it goes back until the scope may be called.
    pub(super) async fn late_trip(&self, job: &Job<'_>) -> Result<End, StoreError> {
        match self.lease(job).await? {
            ControlFlow::Break(end) => Ok(end),
            ControlFlow::Continue(lease) => Ok(End::decided(lease, Decision::Release(Some(LEASE_MARGIN)))),
        }
    }

    /// Reads the result cache (`None`: the cache is off). Only a read: what it found
    /// counts once `cached` uses it.
    async fn cache_lookup(&self, job: &Job<'_>) -> Option<Option<CacheEntry>> {
        let cache = self.stores.cache.as_ref()?;
        Some(cache.get(&job.cache_key).await)
    }

    /// The result of a cache read, counted as a hit or a miss.
    fn cached(&self, job: &Job<'_>, lookup: Option<Option<CacheEntry>>) -> Option<Validated> {
        let hit = lookup?;
        self.metrics.cache(hit.is_some());
        let hit = hit?;
        // The call the hit saves, in the tokens it cost when it was made.
        if let Some(t) = hit.tokens {
            self.metrics.tokens_saved(&job.review.tenant, &job.scope.model_class, t);
        }
        Some(hit.validated)
    }

    /// Whether the tenant's sweep was cancelled (read only on a sweep item's retry).
    async fn sweep_cancelled(&self, tenant: &str, sweep_id: &str) -> Result<bool, StoreError> {
        let layout = &self.stores.layout;
        let sweeps = reviewlane_shared::sweeps::Sweeps::new(layout.js.clone(), layout.sweeps.clone());
        let state = sweeps.get(tenant, sweep_id).await?.map(|(s, _)| s.state);
        Ok(state == Some(reviewlane_core::sweep::SweepState::Cancelled))
    }
}

/// The job needs nothing more from this message: answered as done, after a dead letter
/// when it ended failed.
fn needs_nothing(state: JobState, reason: Option<TerminalReason>) -> End {
    let dead_letter = (state == JobState::Terminal).then(|| reason.unwrap_or(TerminalReason::Cancelled));
    End::Answered { outcome: Outcome::Skipped, ack: Some(AckKind::Ack), dead_letter }
}
