//! The extractor's unit of work: one lane message -> at most one paid answer, kept
//! before anything else can fail -> one decision, recorded by a fenced compare-and-set
//! before the message is settled. No worker sleeps holding a lease waiting for the
//! provider: a retry is a nak with a delay.
//!
//! A job's trip reads top to bottom as named steps, each in its own file:
//! `lease` (take the job, or find it needs nothing), `call` (the provider, with the
//! lease kept alive and watched), `keep` (validate, then store the answer before any
//! other write), `settle` (the one place that records a decision and settles the
//! message). A review larger than the model's context goes through `parts`: one part
//! per delivery, then the merge.

mod call;
mod keep;
mod lease;
pub mod parts;
pub mod plan;
mod settle;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use reviewlane_core::clock::SharedClock;
use reviewlane_core::diff::{self, Diff};
use reviewlane_core::job::{Budget, JobRecord, TerminalReason};
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
use crate::provider::Provider;
use crate::quota::{Quota, Scope};
use crate::schedule::{Admitted, Work};
use crate::upstream::{Backoff, UpstreamOutcome};
use reviewlane_shared::store::StoreRetry;

pub use call::Answer;
pub use settle::{Decision, Outcome};

/// A worker of the region: a few named parts.
pub struct Worker {
    pub region: Region,
    pub stores: Stores,
    pub policy: WorkPolicy,
    pub provider: Arc<dyn Provider>,
    pub quota: Quota,
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
    /// The model's price, for the estimated cost of each call (none: cost 0).
    pub price: Option<crate::config::Price>,
    /// Largest raw item kept with a quarantined finding (its JSON text).
    pub quarantine_raw_max: usize,
    /// Splitting reviews larger than the model's context.
    pub parts: crate::config::PartConfig,
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
    pub scope: &'a Scope,
    /// The diff, parsed once; `None` when it cannot be read back (never expected: the
    /// ingress validated it).
    pub diff: Option<Diff>,
}

impl Job<'_> {
    pub fn id(&self) -> &str {
        &self.review.job_id
    }
}

/// A lease this worker holds: the record as leased (its generation is the one every
/// later write names).
pub struct Lease {
    pub rec: JobRecord,
    /// Whether this lease made a provider call (a cache hit, an open circuit or a
    /// resumed answer do not).
    pub called: std::sync::atomic::AtomicBool,
    /// The tokens of this lease's paid call, charged to the record with its next write.
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

    /// Provider calls the job has made, this lease's included: one per retry spent, and
    /// this one if it called.
    pub fn calls(&self, rec: &JobRecord) -> u32 {
        let a = rec.attempts;
        a.congestion + a.transient + a.schema + u32::from(self.called.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Retry after our own infrastructure failed (NATS), not the provider.
const INFRA_RETRY: Duration = Duration::from_secs(1);

impl Worker {
    /// Processes one admitted message (it holds a call slot and its scope's allowance
    /// until this returns). `abort` fires when the shutdown grace is over: a call still
    /// running is abandoned and the message handed back at once.
    ///
    /// Runs in a `process` span whose parent is the `enqueue` span of the ingress (the
    /// message's `traceparent`), so each delivery of a job joins the job's trace.
    pub async fn process_one(&self, work: Work, abort: &CancellationToken) -> Outcome {
        let (msg, scope) = match &work {
            Work::Call(a) => (&a.msg, &a.scope),
            Work::Late { msg, scope } => (&**msg, scope),
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
            provider = self.provider.name(),
            outcome = Empty,
        );
        reviewlane_shared::telemetry::set_remote_parent(
            &span,
            reviewlane_shared::telemetry::parent_from_nats(msg.headers.as_ref()),
        );
        let outcome = self.process(work, abort).instrument(span.clone()).await;
        span.record("outcome", outcome.as_str());
        outcome
    }

    async fn process(&self, work: Work, abort: &CancellationToken) -> Outcome {
        // A call holds its slot and the scope's allowance until this returns.
        let (msg, scope, held) = match work {
            Work::Call(admitted) => {
                let Admitted { msg, scope, slot, running } = *admitted;
                (msg, scope, Some((slot, running)))
            }
            Work::Late { msg, scope } => (*msg, scope, None),
        };
        let review: ReviewMessage = match serde_json::from_slice(&msg.payload) {
            Ok(r) => r,
            Err(_) => {
                tracing::error!("undecodable review message; terminating it");
                settle::ack(&msg, AckKind::Term).await;
                return Outcome::Skipped;
            }
        };
        Span::current()
            .record("job_id", review.job_id.as_str())
            .record("lane", review.lane.as_str())
            .record("schema_version", review.schema_version.as_str())
            .record("review_depth", review.review_depth.as_str());
        if review.region != self.region {
            // Cannot happen through our subjects; refuse rather than process.
            tracing::error!(message_region = %review.region, "message of another region on this lane");
            settle::ack(&msg, AckKind::Term).await;
            return Outcome::Skipped;
        }
        let job = Job { msg: &msg, review: &review, scope: &scope, diff: diff::parse(&review.diff_text()).ok() };
        let trip = match held {
            Some(_) => self.trip(&job, abort).await,
            None => self.late_trip(&job).await,
        };
        match trip {
            Ok(outcome) => outcome,
            Err(e) => {
                self.health.refused(self.region, &e);
                tracing::warn!(error = %e, kind = e.kind(), "store error; handing the message back");
                settle::ack(&msg, AckKind::Nak(Some(INFRA_RETRY))).await;
                Outcome::Released
            }
        }
    }

    /// lease -> call (or the result cache) -> keep -> settle; or, for a review larger
    /// than the model's context, lease -> one part -> settle (-> merge -> settle).
    async fn trip(&self, job: &Job<'_>, abort: &CancellationToken) -> Result<Outcome, StoreError> {
        // The result cache is read beside the lease, not after it.
        let (leased, lookup) = tokio::join!(self.lease(job), self.cache_lookup(job));
        let lease = match leased? {
            lease::Leased::Held(lease) => lease,
            lease::Leased::Settled(outcome) => return Ok(outcome),
        };
        let Some(diff) = job.diff.as_ref() else {
            let decision = Decision::Terminal { reason: TerminalReason::InvalidInput, status: None };
            return self.settle(job, &lease, decision).await;
        };
        let whole = Target { diff, text: crate::provider::prompt_diff(job.review, diff), part: None };
        // A split review under way is finished part by part, never from the cache.
        if lease.rec.parts.is_none()
            && let Some(hit) = self.cached(job, lookup)
        {
            let decision = self.decide(job, &lease, &whole, Answer::Cached(hit)).await;
            return self.settle(job, &lease, decision).await;
        }
        match self.plan(job, &lease).await? {
            parts::Planned::Whole => {}
            parts::Planned::Split(parts, progress) => {
                return self.split_trip(job, &lease, parts, progress, abort).await;
            }
            parts::Planned::Decided(decision) => return self.settle(job, &lease, decision).await,
        }
        let answer = self.call(job, &lease, &whole, abort).await?;
        let decision = self.decide(job, &lease, &whole, answer).await;
        self.settle(job, &lease, decision).await
    }

    /// What an answer means for the job (the pure `plan::verdict`). A usable answer is
    /// validated and kept here, before any other write; then the key's quota learns
    /// from it.
    async fn decide(&self, job: &Job<'_>, lease: &Lease, target: &Target<'_>, answer: Answer) -> Decision {
        self.note(&answer);
        let used = lease.rec.attempts.congestion;
        let (verdict, effect) = plan::verdict(answer, used, self.backoff(job.review), rand::random::<f64>());
        let decision = match verdict {
            plan::Verdict::Cached(hit) => self.keep(job, lease, hit, 0, None).await,
            plan::Verdict::Usable { output, usage, status } => {
                if let Some(u) = usage {
                    self.metrics.tokens(&job.review.tenant, &job.scope.model_class, u);
                    *lease.tokens.lock().expect("tokens lock") = Some(u);
                }
                match (self.validate(job, lease, target.diff, &output), target.part) {
                    (Ok(validated), None) => {
                        let tokens = *lease.tokens.lock().expect("tokens lock");
                        self.keep(job, lease, validated, 0, Some(tokens)).await
                    }
                    (Ok(validated), Some(index)) => self.keep_part(job, lease, index, validated).await,
                    (Err(invalid), _) => {
                        Decision::Retry { budget: Budget::Schema, hint: None, status, invalid: Some(invalid.as_str()) }
                    }
                }
            }
            plan::Verdict::Decided(decision) => decision,
        };
        self.learn(effect).await;
        decision
    }

    /// What an answer tells the operator, before it is decided on.
    fn note(&self, answer: &Answer) {
        match answer {
            Answer::Cached(_) => tracing::info!("result cache hit"),
            Answer::DeadlinePassed => tracing::info!("deadline reached during the provider call; call abandoned"),
            Answer::Upstream { outcome: UpstreamOutcome::RateLimited { capped: true, .. }, .. } => {
                self.metrics.hint_capped();
                tracing::warn!("provider retry hint above the ceiling; rescheduled at the ceiling");
            }
            Answer::Upstream { outcome: UpstreamOutcome::QuotaExhausted, .. } => {
                tracing::error!("provider account out of quota; circuit open for the scope");
            }
            Answer::Upstream { outcome: UpstreamOutcome::Permanent { status }, .. } => {
                tracing::warn!(status = *status, "provider rejected the request");
            }
            _ => {}
        }
    }

    /// Records what the key's shared quota learns (best effort: a failed write is
    /// logged, and the next answer teaches it again).
    async fn learn(&self, effect: plan::QuotaEffect) {
        let written = match effect {
            plan::QuotaEffect::None => return,
            plan::QuotaEffect::Succeeded { started_ms, pause } => {
                self.quota.succeeded(started_ms).await;
                match pause {
                    Some(d) => self.quota.pause(d).await.map_err(|e| ("recording a headroom pause failed", e)),
                    None => Ok(()),
                }
            }
            plan::QuotaEffect::RateLimited { started_ms, delay } => {
                self.quota.rate_limited(delay, started_ms).await.map_err(|e| ("recording the scope pause failed", e))
            }
            plan::QuotaEffect::OpenCircuit => self
                .quota
                .open_circuit(self.policy.circuit_open_for)
                .await
                .map_err(|e| ("recording the open circuit failed", e)),
        };
        if let Err((what, e)) = written {
            tracing::warn!(error = %e, "{what}");
        }
    }

    /// Applies `event` to the job's record from the revision this lease last wrote,
    /// remembering the revision it writes.
    async fn apply_leased(
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

    fn backoff(&self, review: &ReviewMessage) -> &Backoff {
        &self.policy.backoff[usize::from(review.lane == reviewlane_shared::Lane::Batch)]
    }
}
