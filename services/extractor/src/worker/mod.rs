//! The extractor's unit of work: one lane message -> at most one paid answer, kept
//! before anything else can fail -> one decision, recorded by a fenced compare-and-set
//! before the message is settled. No worker sleeps holding a lease waiting for the
//! provider: a retry is a nak with a delay.
//!
//! A job's trip (`Worker::trip`, here) reads top to bottom as four steps, each in its
//! own file with the helpers it needs and its pure table beside it, each returning to
//! the trip:
//!
//! 1. `lease` — take the job (the result cache read beside it), or find it needs
//!    nothing: a held `Lease` and what it is for, or the trip's `End`;
//! 2. `call` — the provider, with the lease kept alive and watched: an `Answer`;
//! 3. `keep` — what the answer means (the pure `verdict`), then validate it and store
//!    it before any other write (and in the cache), and let the key's quota learn: a
//!    `Decision`;
//! 4. `settle` — `conclude`, the one place a message is answered: the decision's
//!    record (the pure `settlement`, then one fenced write), then the ack.
//!
//! A review larger than the model's context goes through `parts` instead of `call`
//! and `keep` once: its parts called concurrently, as far as admission allows, each
//! kept and recorded as it is answered; then the merge. This file holds the worker's
//! parts and what the steps hand each other: the job, its lease, a decision, the
//! trip's end and a message's outcome.

mod call;
mod keep;
mod lease;
pub mod parts;
mod settle;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use reviewlane_core::clock::SharedClock;
use reviewlane_core::diff::Diff;
use reviewlane_core::job::{Budget, JobRecord, TerminalReason, Tokens};
use reviewlane_core::messages::ReviewMessage;
use reviewlane_core::region::Region;
use reviewlane_shared::faults::Faults;
use reviewlane_shared::job_store::{JobStore, StoreError};
use reviewlane_shared::layout::RegionLayout;
use reviewlane_shared::results::Results;
use tokio_util::sync::CancellationToken;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::config::Budgets;
use crate::metrics::Metrics;
use crate::pool::{Deployment, Others};
use crate::quota::Scope;
use crate::schedule::{Admitted, Decoded, More, Place, Work};
use crate::upstream::Backoff;
use reviewlane_shared::store::StoreRetry;

pub use call::Answer;

/// A worker of the region: a few named parts.
pub struct Worker {
    pub region: Region,
    pub stores: Stores,
    pub policy: WorkPolicy,
    pub metrics: Metrics,
    /// What the store refused (counted; a full store makes the replica unready).
    pub health: reviewlane_shared::store_health::StoreHealth,
    /// Lease times and eligibility.
    pub clock: SharedClock,
    pub faults: Faults,
    /// The parts of the last few split reviews (see `parts`).
    pub split_cache: parts::SplitCache,
    /// Fires when the shutdown grace is over: work still running is handed back.
    pub abort: CancellationToken,
}

/// The region's stores a worker writes and reads.
pub struct Stores {
    pub layout: RegionLayout,
    pub jobs: JobStore,
    pub results: Results,
    /// `CACHE_<R>`: validated results by (tenant, diff, schema, depth, provider,
    /// model, prompt version); `None` when the cache is off.
    pub cache: Option<reviewlane_shared::result_cache::ResultCache>,
}

/// How a worker leases, calls, retries and keeps.
pub struct WorkPolicy {
    pub budgets: Budgets,
    /// Backoff without a hint: interactive, batch.
    pub backoff: [Backoff; 2],
    pub lease: Duration,
    pub provider_timeout: Duration,
    /// How long an `insufficient_quota` answer closes a scope to calls.
    pub circuit_open_for: Duration,
    /// Retries of a store write once an answer is paid for.
    pub store_retry: StoreRetry,
    /// Largest raw item kept with a quarantined finding (its JSON text).
    pub quarantine_raw_max: usize,
    /// Splitting reviews larger than the model's context.
    pub parts: crate::config::PartConfig,
    /// The tokens every call sends besides its diff: the instructions and schema.
    pub call_overhead: u64,
}

impl WorkPolicy {
    /// What a call for one part of a split review is metered for on a deployment whose
    /// calls ask for at most `output` tokens (counted at start where the budget does).
    pub fn part_cost(&self, part: &reviewlane_core::parts::Part, output: u32) -> reviewlane_core::meter::Cost {
        reviewlane_core::meter::Cost { input: self.call_overhead + part.tokens as u64, output: u64::from(output) }
    }

    /// The backoff of `lane` without a provider's hint.
    pub fn backoff(&self, lane: reviewlane_shared::Lane) -> &Backoff {
        &self.backoff[usize::from(lane == reviewlane_shared::Lane::Batch)]
    }
}

/// What one call reviews: the whole diff, or one part of a split review.
pub struct Target<'a> {
    /// What findings are validated against.
    pub diff: &'a Diff,
    /// What the model is shown.
    pub text: std::borrow::Cow<'a, str>,
    pub part: Option<u32>,
}

/// One delivery of a review being worked on.
pub struct Job<'a> {
    pub msg: &'a jetstream::Message,
    pub review: &'a ReviewMessage,
    /// The deployment the review was admitted on: its provider is called, its key's
    /// quota learns from the answers.
    pub deployment: &'a Deployment,
    /// The other deployments of its class, which may take it when this one cannot.
    pub others: &'a Others,
    pub scope: &'a Scope,
    /// The diff, parsed once; `None` when it cannot be read back (never expected: the
    /// ingress validated it).
    pub diff: Option<Diff>,
    /// What the delivery's call reserved of the key's budgets, and what became of it.
    pub metering: Arc<Metering>,
    /// Where the delivery's call runs (its slot and scope place): held until the trip
    /// ends, or — for a split review — until its first part is answered.
    pub place: std::sync::Mutex<Option<Place>>,
    /// Further calls for the delivery: a split review's other parts (none for a late
    /// review).
    pub more: Option<More>,
    /// The reservations of a split review's other parts, as they start.
    pub part_metering: std::sync::Mutex<Vec<Arc<Metering>>>,
    /// What makes this review the same as another for the result cache: read beside
    /// the lease, written when a fresh answer is kept.
    pub cache_key: reviewlane_shared::result_cache::CacheKey<'a>,
}

/// One call's reservation in the key's budgets: corrected to the usage of its answer,
/// kept when a call was made without one, given back when no call was made; and the
/// tokens its answer reported, charged to the job with the decision's write.
#[derive(Default)]
pub struct Metering {
    pub reserved: Option<crate::quota::Reservation>,
    /// The deployment the call goes to when it is not the one that admitted the review
    /// (a split review's part on another of its class): its key holds the reservation.
    pub callee: Option<crate::pool::Callee>,
    /// A provider call was made for it.
    pub called: std::sync::atomic::AtomicBool,
    /// Its answer's usage corrected it, or it was given back unused.
    pub corrected: std::sync::atomic::AtomicBool,
    /// The usage its answer reported.
    pub tokens: std::sync::Mutex<Option<Tokens>>,
}

impl Metering {
    pub fn new(reserved: Option<crate::quota::Reservation>) -> Arc<Metering> {
        Arc::new(Metering { reserved, ..Default::default() })
    }

    /// A reservation on `callee`'s key (`None`: the admitting deployment's).
    pub fn on(reserved: Option<crate::quota::Reservation>, callee: Option<crate::pool::Callee>) -> Arc<Metering> {
        Arc::new(Metering { reserved, callee, ..Default::default() })
    }

    pub fn tokens(&self) -> Option<Tokens> {
        *self.tokens.lock().expect("tokens lock")
    }
}

impl Job<'_> {
    pub fn id(&self) -> &str {
        &self.review.job_id
    }

    /// Where the call of `m` goes: the deployment, the others of its class as it sees
    /// them, and the tenant's scope on it.
    pub fn callee<'m>(&'m self, m: &'m Metering) -> (&'m Deployment, &'m Others, &'m Scope) {
        match &m.callee {
            Some(c) => (&c.deployment, &c.others, &c.scope),
            None => (self.deployment, self.others, self.scope),
        }
    }

    /// The call of `m` as charged to the job: its answer's tokens at the price of the
    /// deployment that answered (`None`: no paid answer).
    pub fn charge_of(&self, m: &Metering) -> Option<reviewlane_core::job::Charge> {
        m.tokens().map(|t| self.callee(m).0.charge(t))
    }

    /// Whether this delivery made a provider call (a cache hit, an open circuit or a
    /// resumed answer do not): one of its reservations was called.
    pub fn called(&self) -> bool {
        let called = |m: &Metering| m.called.load(std::sync::atomic::Ordering::Relaxed);
        called(&self.metering) || self.part_metering.lock().expect("parts lock").iter().any(|m| called(m))
    }
}

/// A lease this worker holds: the record as leased (its generation is the one every
/// later write names).
pub struct Lease {
    pub rec: JobRecord,
    /// The record and revision this lease last wrote: its next write is a
    /// compare-and-set on that revision without reading first (a read follows only when
    /// someone else wrote meanwhile).
    known: std::sync::Mutex<Option<(JobRecord, u64)>>,
}

impl Lease {
    /// A lease on `rec` as read (nothing written by this lease yet).
    pub fn new(rec: JobRecord) -> Self {
        Lease { rec, known: Default::default() }
    }

    /// A lease whose record was written at `revision`.
    pub fn written(rec: JobRecord, revision: u64) -> Self {
        let known = std::sync::Mutex::new(Some((rec.clone(), revision)));
        Lease { rec, known }
    }

    pub fn generation(&self) -> u32 {
        self.rec.generation()
    }

    /// Applies `event` to the job's record from the revision this lease last wrote
    /// (fenced by its generation), charging `charge`, and remembers the revision it
    /// writes.
    pub async fn apply(
        &self,
        jobs: &JobStore,
        event: &reviewlane_core::job::Event,
        charge: Option<&reviewlane_core::job::Charge>,
    ) -> Result<JobRecord, StoreError> {
        let known = self.known.lock().expect("known lock").take();
        let (rec, revision) = jobs.apply_tracked(&self.rec.job_id, known, event, charge).await?;
        *self.known.lock().expect("known lock") = Some((rec.clone(), revision));
        Ok(rec)
    }
}

/// What the trip decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The result of the lease's generation is kept: record `validated`.
    Validated {
        findings: usize,
        quarantined: usize,
        /// Findings the merge of a split review left out (over the cap).
        dropped: u32,
    },
    /// One part of a split review is kept on `PARTS_<R>` at `seq`: record it done (the
    /// lease and the message stay held for the other parts).
    PartDone {
        index: u32,
        seq: u64,
        findings: usize,
        quarantined: usize,
    },
    /// Spend one unit of `budget` and try again after the hint (else backoff).
    Retry {
        budget: Budget,
        hint: Option<Duration>,
        status: Option<String>,
        /// Why an output was invalid (schema budget): a class, never content.
        invalid: Option<&'static str>,
    },
    Terminal {
        reason: TerminalReason,
        status: Option<String>,
    },
    /// Hand the message back (`None`: at once, for shutdown), recording nothing.
    Release(Option<Duration>),
    /// The lease was taken over: record nothing, settle nothing.
    Stale,
    /// The job ended while the call ran: move the message to the dead letters.
    Ended(TerminalReason),
}

/// How the worker settled one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Validated {
        findings: usize,
        quarantined: usize,
    },
    RetryScheduled {
        budget: Budget,
        delay: Duration,
    },
    Terminal(TerminalReason),
    /// Nothing to do: the job is final or its result is already recorded.
    Skipped,
    /// Handed back until another holder's lease or a retry delay is over.
    Deferred(Duration),
    /// The answer came after the lease was taken over: discarded.
    Stale,
    /// Handed back without delay (shutdown) or after an infrastructure error.
    Released,
    /// A part of a split review is recorded done; `parts` as recorded. The message is
    /// still held.
    PartDone {
        parts: reviewlane_core::job::Parts,
    },
}

impl Outcome {
    /// The outcome's class, for the `process` span.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Validated { .. } => "validated",
            Outcome::RetryScheduled { .. } => "retry_scheduled",
            Outcome::Terminal(_) => "terminal",
            Outcome::Skipped => "skipped",
            Outcome::Deferred(_) => "deferred",
            Outcome::Stale => "stale",
            Outcome::Released => "released",
            Outcome::PartDone { .. } => "part_done",
        }
    }
}

/// How a trip ends for its message (`settle::conclude` carries it out).
pub enum End {
    /// The lease's decision: recorded (fenced by its generation) with the tokens of the
    /// paid calls it charges, then the message answered as its settlement says.
    Decided { lease: Box<Lease>, decision: Decision, charge: Option<reviewlane_core::job::Charge> },
    /// Nothing (more) to record: the message is answered with `ack` (`None`: left
    /// alone), after a dead letter for `dead_letter`.
    Answered { outcome: Outcome, ack: Option<AckKind>, dead_letter: Option<TerminalReason> },
}

impl End {
    /// The lease's decision, charging nothing.
    pub fn decided(lease: Box<Lease>, decision: Decision) -> End {
        End::Decided { lease, decision, charge: None }
    }

    /// Answered with `ack`, nothing recorded.
    pub fn answered(outcome: Outcome, ack: AckKind) -> End {
        End::Answered { outcome, ack: Some(ack), dead_letter: None }
    }
}

impl Worker {
    /// Processes one admitted message (it holds a call slot and its scope's allowance
    /// until this returns). `abort` fires when the shutdown grace is over: a call still
    /// running is abandoned and the message handed back at once.
    ///
    /// Runs in a `process` span whose parent is the `enqueue` span of the ingress (the
    /// message's `traceparent`), so each delivery of a job joins the job's trace.
    pub async fn process_one(
        &self,
        work: Work,
        deployment: &Deployment,
        others: &Others,
        abort: &CancellationToken,
    ) -> Outcome {
        let (msg, scope) = match &work {
            Work::Call(a) => (&a.msg, &a.scope),
            Work::Late { msg, scope, .. } => (&**msg, scope),
        };
        let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
        let span = tracing::info_span!(
            parent: None,
            "process",
            otel.name = "process review",
            otel.kind = "consumer",
            messaging.system = "nats",
            messaging.operation.type = "process",
            messaging.destination.name = %msg.subject,
            messaging.nats.delivered = delivered,
            job_id = Empty,
            tenant = %scope.tenant,
            region = %self.region,
            lane = Empty,
            schema_version = Empty,
            review_depth = Empty,
            provider = deployment.provider.name(),
            deployment = %deployment.id,
            outcome = Empty,
        );
        reviewlane_shared::telemetry::set_remote_parent(
            &span,
            reviewlane_shared::telemetry::parent_from_nats(msg.headers.as_ref()),
        );
        let outcome = self.process(work, deployment, others, abort).instrument(span.clone()).await;
        span.record("outcome", outcome.as_str());
        outcome
    }

    async fn process(
        &self,
        work: Work,
        deployment: &Deployment,
        others: &Others,
        abort: &CancellationToken,
    ) -> Outcome {
        // A call holds its slot and the scope's allowance until this returns.
        let (msg, decoded, scope, place, reserved, more) = match work {
            Work::Call(admitted) => {
                let Admitted { msg, decoded, scope, place, reserved, more } = *admitted;
                (msg, decoded, scope, Some(place), reserved, Some(more))
            }
            Work::Late { msg, decoded, scope } => (*msg, decoded.map(|d| *d), scope, None, None, None),
        };
        let unread = || Ok(End::answered(Outcome::Skipped, AckKind::Term));
        let Some(Decoded { review, diff }) = decoded else {
            tracing::error!("undecodable review message; terminating it");
            return self.conclude(&msg, None, unread()).await;
        };
        Span::current()
            .record("job_id", review.job_id.as_str())
            .record("lane", review.lane.as_str())
            .record("schema_version", review.schema_version.as_str())
            .record("review_depth", review.review_depth.as_str());
        if review.region != self.region {
            // Cannot happen through our subjects; refuse rather than process.
            tracing::error!(message_region = %review.region, "message of another region on this lane");
            return self.conclude(&msg, None, unread()).await;
        }
        let late = place.is_none();
        let job = Job {
            msg: &msg,
            review: &review,
            deployment,
            others,
            scope: &scope,
            diff,
            metering: Metering::new(reserved),
            place: std::sync::Mutex::new(place),
            more,
            part_metering: Default::default(),
            cache_key: reviewlane_shared::result_cache::CacheKey {
                tenant: &review.tenant,
                input_digest: &review.input_digest,
                schema_version: &review.schema_version,
                review_depth: review.review_depth.as_str(),
                // Answers of the same provider kind and class serve each other's
                // identical reviews, whichever deployment gave them.
                provider: deployment.provider.name(),
                model_class: &scope.model_class,
                prompt_version: crate::provider::PROMPT_VERSION,
            },
        };
        let end = if late { self.late_trip(&job).await } else { self.trip(&job, abort).await };
        self.release_unused(&job, &job.metering).await;
        self.conclude(&msg, Some(&job), end).await
    }

    /// Gives a reservation back to the key's budgets when no call was made for it
    /// (once).
    async fn release_unused(&self, job: &Job<'_>, metering: &Metering) {
        if let Some(reserved) = &metering.reserved
            && !metering.called.load(std::sync::atomic::Ordering::Relaxed)
            && !metering.corrected.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            job.callee(metering).0.quota.budgets().release_call(reserved).await;
        }
    }

    /// lease -> call -> keep, to the trip's end (`conclude` carries it out). The lease
    /// step also finds what the job needs: its cached result (keep), its parts (one
    /// part, then the merge, in `parts`), or nothing more (the end).
    async fn trip(&self, job: &Job<'_>, abort: &CancellationToken) -> Result<End, StoreError> {
        // Out of routing here while another deployment of the class is in it: back to
        // the lane, untouched — at once if another can take it now, else after a short
        // wait (it is paused or at its budgets for a moment).
        if crate::pool::steps_aside(&job.deployment.quota, job.others) {
            let delay = crate::pool::hand_over_delay(job.others);
            return Ok(End::answered(Outcome::Released, AckKind::Nak(delay)));
        }
        let (lease, next) = match self.take(job).await? {
            ControlFlow::Continue(held) => held,
            ControlFlow::Break(end) => return Ok(end),
        };
        let whole = match next {
            lease::Next::Call(whole) => whole,
            lease::Next::Cached(whole, hit) => {
                let decision = self.decide(job, &lease, &whole, &job.metering, Answer::Cached(hit)).await;
                return Ok(End::decided(lease, decision));
            }
            lease::Next::Split(parts, progress) => return self.split_trip(job, lease, parts, progress, abort).await,
        };
        let answer = self.call(job, &lease, &whole, &job.metering, abort).await?;
        let decision = self.decide(job, &lease, &whole, &job.metering, answer).await;
        Ok(End::Decided { lease, decision, charge: job.charge_of(&job.metering) })
    }

    /// Between two tries of a store write: counted, logged, and the lease kept alive
    /// (a progress ack on the message).
    fn store_retried(
        &self,
        job: &Job<'_>,
        what: &'static str,
        e: &StoreError,
        attempt: u32,
        delay: Duration,
    ) -> impl std::future::Future<Output = ()> + use<> {
        self.health.refused(self.region, e);
        tracing::warn!(
            what,
            kind = e.kind(),
            attempt,
            delay_ms = delay.as_millis() as u64,
            "store write failed; retrying the write"
        );
        self.metrics.store_retry(e.kind());
        let msg = job.msg.clone();
        async move {
            let _ = msg.ack_with(AckKind::Progress).await;
        }
    }
}
