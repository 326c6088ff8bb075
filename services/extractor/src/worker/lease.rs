//! Step 1, lease: read the job (creating its record from the message when the ingress
//! died between its two writes), find whether it needs anything, and take a lease whose
//! generation every later write names.
//!
//! A job whose previous holder died after keeping its answer is finished from that
//! answer, without a call. A live lease of another holder, or a retry delay not yet
//! over, hands the message back until then: no second call while one may be running.

use std::time::Duration;

use async_nats::jetstream::AckKind;
use reviewlane_core::job::{Event, JobState, TerminalReason, TransitionError};
use reviewlane_shared::job_store::{Created, StoreError};

use super::settle::{self, Decision, Outcome};
use reviewlane_core::job::JobRecord;

use reviewlane_core::findings::Validated;

use super::parts::Planned;
use super::{Job, Target, Worker};

/// A lease this worker holds: the record as leased (its generation is the one every
/// later write names).
pub struct Lease {
    pub rec: JobRecord,
    /// Whether this lease made a provider call (a cache hit, an open circuit or a
    /// resumed answer do not).
    pub called: std::sync::atomic::AtomicBool,
    /// The tokens of a paid call of this lease, charged to the record with its next
    /// write (`charge`).
    pub tokens: std::sync::Mutex<Option<reviewlane_core::job::Tokens>>,
    /// The record and revision this lease last wrote: its next write is a
    /// compare-and-set on that revision without reading first (a read follows only when
    /// someone else wrote meanwhile).
    known: std::sync::Mutex<Option<(JobRecord, u64)>>,
}

impl Lease {
    pub fn new(rec: JobRecord) -> Self {
        Lease { rec, called: Default::default(), tokens: Default::default(), known: Default::default() }
    }

    /// A lease whose record was written at `revision`.
    pub fn written(rec: JobRecord, revision: u64) -> Self {
        let known = std::sync::Mutex::new(Some((rec.clone(), revision)));
        Lease { known, ..Lease::new(rec) }
    }

    pub fn generation(&self) -> u32 {
        self.rec.generation()
    }

    /// The tokens of a paid call, to be charged to the job with the next decision's
    /// write.
    pub fn charge(&self, tokens: Option<reviewlane_core::job::Tokens>) {
        *self.tokens.lock().expect("tokens lock") = tokens;
    }

    /// Provider calls the job has made, this lease's included: one per retry spent, and
    /// this one if it called.
    pub fn calls(&self, rec: &JobRecord) -> u32 {
        let a = rec.attempts;
        a.congestion + a.transient + a.schema + u32::from(self.called.load(std::sync::atomic::Ordering::Relaxed))
    }
}

pub enum Leased {
    Held(Box<Lease>),
    /// Nothing to call: the message is settled (or deliberately left alone).
    Settled(Outcome),
}

/// Step 1 as the trip sees it: a lease and what the job needs next, or nothing to do.
pub(super) enum Taken<'j> {
    Held(Box<Lease>, Next<'j>),
    Settled(Outcome),
}

/// What a held lease is for.
pub(super) enum Next<'j> {
    /// One call for the whole review.
    Call(Target<'j>),
    /// The same review's validated result is cached: kept without a call.
    Cached(Target<'j>, Validated),
    /// A review larger than the model's context, finished part by part.
    Split(std::sync::Arc<Vec<reviewlane_core::chunk::Part>>, reviewlane_core::job::Parts),
    /// Decided without a call: the diff cannot be read back, or it splits too large.
    Settle(Decision),
}

/// Margin added when handing a message back until another holder's lease ends.
const LEASE_MARGIN: Duration = Duration::from_millis(250);

impl Worker {
    /// Takes the lease (with the result cache read beside it, not after it), then finds
    /// what the job needs: one call, the cached result, its parts, or a decision.
    pub(super) async fn take<'j>(&self, job: &'j Job<'_>) -> Result<Taken<'j>, StoreError> {
        let (leased, lookup) = tokio::join!(self.lease(job), self.cache_lookup(job));
        let lease = match leased? {
            Leased::Held(lease) => lease,
            Leased::Settled(outcome) => return Ok(Taken::Settled(outcome)),
        };
        let Some(diff) = job.diff.as_ref() else {
            let decision = Decision::Terminal { reason: TerminalReason::InvalidInput, status: None };
            return Ok(Taken::Held(lease, Next::Settle(decision)));
        };
        let whole = Target { diff, text: crate::provider::prompt_diff(job.review, diff), part: None };
        // A split review under way is finished part by part, never from the cache.
        if lease.rec.parts.is_none()
            && let Some(hit) = self.cached(job, lookup)
        {
            return Ok(Taken::Held(lease, Next::Cached(whole, hit)));
        }
        let next = match self.plan(job, &lease).await? {
            Planned::Whole => Next::Call(whole),
            Planned::Split(parts, progress) => Next::Split(parts, progress),
            Planned::Decided(decision) => Next::Settle(decision),
        };
        Ok(Taken::Held(lease, next))
    }

    pub(super) async fn lease(&self, job: &Job<'_>) -> Result<Leased, StoreError> {
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
            settle::ack(job.msg, AckKind::Term).await;
            return Ok(Leased::Settled(Outcome::Skipped));
        }
        let now = self.clock.now_ms();
        match rec.state {
            JobState::Terminal | JobState::Published | JobState::Validated => {
                return self.settled(job, rec.state, rec.reason).await;
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
                    let lease = Lease::new(rec);
                    return Ok(Leased::Settled(self.settle(job, &lease, decision).await?));
                }
            }
            _ => {}
        }
        let event = Event::Leased {
            owner: self.quota.replica_id().to_string(),
            lease_expires_at_ms: now + self.policy.lease.as_millis() as u64,
        };
        match self.stores.jobs.apply_tracked(id, Some((rec, revision)), &event, None).await {
            Ok((rec, revision)) => {
                let lease = Lease::written(rec, revision);
                // The provider account is out of money: end the job without paying for a
                // call (under the lease, so no other holder's job is ended).
                if self.quota.circuit_open() {
                    let decision = Decision::Terminal { reason: TerminalReason::InsufficientQuota, status: None };
                    return Ok(Leased::Settled(self.settle(job, &lease, decision).await?));
                }
                // Its deadline passed while it waited (queued or between retries): it ends
                // without a call.
                if lease.rec.deadline_ms.is_some_and(|d| self.clock.now_ms() >= d) {
                    let decision = Decision::Terminal { reason: TerminalReason::DeadlineExceeded, status: None };
                    return Ok(Leased::Settled(self.settle(job, &lease, decision).await?));
                }
                // An item of a cancelled sweep whose call failed (or whose holder died
                // without keeping an answer) is not called again: it ends `cancelled`.
                if lease.rec.attempts.leases > 1
                    && let Some(sweep) = lease.rec.sweep_id.as_deref()
                    && self.sweep_cancelled(&lease.rec.tenant, sweep).await?
                {
                    let decision = Decision::Terminal { reason: TerminalReason::Cancelled, status: None };
                    return Ok(Leased::Settled(self.settle(job, &lease, decision).await?));
                }
                Ok(Leased::Held(Box::new(lease)))
            }
            Err(StoreError::Transition(TransitionError::LeaseHeld { until_ms: at }, _))
            | Err(StoreError::Transition(TransitionError::NotEligible { at_ms: at }, _)) => {
                let wait = Duration::from_millis(at.saturating_sub(self.clock.now_ms())) + LEASE_MARGIN;
                tracing::debug!(wait_ms = wait.as_millis() as u64, "job held or not yet eligible; handed back");
                settle::ack(job.msg, AckKind::Nak(Some(wait))).await;
                Ok(Leased::Settled(Outcome::Deferred(wait)))
            }
            Err(StoreError::Transition(_, current)) => {
                tracing::info!(state = current.state.as_str(), "job moved on before lease");
                self.settled(job, current.state, current.reason).await
            }
            Err(e) => Err(e),
        }
    }

    /// A review whose deadline passed while its scope was paused: leased only to be
    /// ended `deadline_exceeded` (or settled as its record says), never called. Should
    /// this worker's clock not find it late, it goes back until the scope may be called.
    pub(super) async fn late_trip(&self, job: &Job<'_>) -> Result<Outcome, StoreError> {
        match self.lease(job).await? {
            Leased::Settled(outcome) => Ok(outcome),
            Leased::Held(lease) => self.settle(job, &lease, Decision::Release(Some(LEASE_MARGIN))).await,
        }
    }

    /// Whether the tenant's sweep was cancelled (read only on a sweep item's retry).
    async fn sweep_cancelled(&self, tenant: &str, sweep_id: &str) -> Result<bool, StoreError> {
        let layout = &self.stores.layout;
        let sweeps = reviewlane_shared::sweeps::Sweeps::new(layout.js.clone(), layout.sweeps.clone(), self.region);
        let state = sweeps.get(tenant, sweep_id).await?.map(|(s, _)| s.state);
        Ok(state == Some(reviewlane_core::sweep::SweepState::Cancelled))
    }

    /// The job needs nothing more from this message.
    async fn settled(
        &self,
        job: &Job<'_>,
        state: JobState,
        reason: Option<TerminalReason>,
    ) -> Result<Leased, StoreError> {
        if state == JobState::Terminal {
            self.dead_letter(job, reason.unwrap_or(TerminalReason::Cancelled)).await?;
        }
        settle::ack(job.msg, AckKind::Ack).await;
        Ok(Leased::Settled(Outcome::Skipped))
    }

    /// Applies `event` to the job's record from the revision this lease last wrote,
    /// remembering the revision it writes.
    pub(super) async fn apply_leased(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        event: &reviewlane_core::job::Event,
        charge: Option<(reviewlane_core::job::Tokens, u64)>,
    ) -> Result<JobRecord, StoreError> {
        let known = lease.known.lock().expect("known lock").take();
        let (rec, revision) = self.stores.jobs.apply_tracked(job.id(), known, event, charge).await?;
        *lease.known.lock().expect("known lock") = Some((rec.clone(), revision));
        Ok(rec)
    }
}
