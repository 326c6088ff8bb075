//! Step 3, keep: what an answer means (`verdict`, pure, at the end of this file), then
//! validate a 200's output (pure) and store the result before anything else can fail
//! (and in the result cache, beside it); then the key's quota learns from the answer. From here on a store failure retries the store, never the provider
//! call: while the answer exists only in this worker, the write is retried with backoff
//! — the lease kept alive — until the store takes it (a full store, an outage) or the
//! job's deadline passes (`deadline_exceeded`). A store that refuses the write for good
//! ends the job `store_budget_exhausted`. Should the process die meanwhile, the message
//! returns after its lease and the job is called again: a second paid call, not a lost
//! review.

use std::future::Future;
use std::time::Duration;

use reviewlane_core::findings::{self, InvalidOutput, Validated};
use reviewlane_core::job::{Budget, TerminalReason, Tokens};
use reviewlane_core::messages::FindingsMessage;
use reviewlane_shared::faults::point;
use reviewlane_shared::job_store::StoreError;
use reviewlane_shared::result_cache::CacheEntry;
use tracing::Instrument;
use tracing::field::Empty;

use super::call::Answer;
use super::{Decision, Job, Lease, Metering, Target, Worker};
use crate::upstream::{Backoff, UpstreamOutcome};

impl Worker {
    /// JSON, JSON Schema, then the diff: `Err` when the whole output is unusable.
    pub(super) fn validate(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        diff: &reviewlane_core::diff::Diff,
        output: &str,
    ) -> Result<Validated, InvalidOutput> {
        let span = tracing::info_span!(
            "validate",
            schema_version = %job.review.schema_version,
            result = Empty,
            findings = Empty,
            quarantined = Empty,
        );
        let _enter = span.enter();
        match findings::validate(&job.review.schema_version, output, diff) {
            Ok(v) => {
                span.record("result", "valid")
                    .record("findings", v.findings.len())
                    .record("quarantined", v.quarantined.len());
                Ok(v)
            }
            Err(invalid) => {
                span.record("result", invalid.as_str());
                tracing::warn!(reason = invalid.as_str(), "invalid provider output");
                self.metrics.invalid_output(&job.review.schema_version, invalid.as_str());
                let left = self.policy.budgets.of(Budget::Schema).saturating_sub(lease.rec.attempts.schema + 1);
                tracing::info!(budget = "schema", budget_remaining = left, "schema retry budget");
                Err(invalid)
            }
        }
    }

    /// Stores the validated result of this lease's generation (`dropped`: findings a
    /// split review's merge left out). `cache`: a fresh result, not one from the result
    /// cache, goes into the cache with the tokens its calls cost.
    pub(super) async fn keep(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        v: Validated,
        dropped: u32,
        cache: Option<Option<reviewlane_core::job::Tokens>>,
    ) -> Decision {
        let (n, q) = (v.findings.len(), v.quarantined.len());
        for reason in v.quarantined.iter().map(|q| q.reason.as_str()) {
            tracing::info!(reason, "finding quarantined");
        }
        let review = job.review;
        let result = FindingsMessage { findings_dropped: dropped, ..self.result_message(job, lease, &v) };
        let span = tracing::info_span!(
            "findings.publish",
            otel.kind = "producer",
            messaging.system = "nats",
            messaging.operation.type = "publish",
            messaging.destination.name = %reviewlane_shared::layout::findings_stream(review.region),
            findings = n,
            quarantined = q,
            stored = Empty,
        );
        let kept = async {
            let mut trace = async_nats::HeaderMap::new();
            reviewlane_shared::telemetry::inject_nats(&mut trace);
            self.keep_paid(job, lease, "keep", || async {
                self.faults.check(point::EXTRACTOR_KEEP)?;
                self.stores.results.keep(&result, &trace).await
            })
            .await
        }
        .instrument(span.clone());
        // A fresh result goes into the cache beside the keep, not after it: done before
        // the job is recorded `validated`, at no extra wait.
        let cached = async {
            if let Some(tokens) = cache
                && let Some(cache) = &self.stores.cache
            {
                cache.put(&job.cache_key, &CacheEntry { validated: v.clone(), tokens }).await;
            }
        };
        match tokio::join!(kept, cached).0 {
            Ok(at) => {
                span.record("stored", if at == reviewlane_shared::results::Kept::Inline { "inline" } else { "object" });
                self.metrics.kept(at);
                self.metrics.validated(n, v.quarantined.iter().map(|q| q.reason.as_str()));
                Decision::Validated { findings: n, quarantined: q, dropped }
            }
            Err(unkept) => unkept,
        }
    }

    /// Stores a paid answer that exists only in this worker: retried with backoff, the
    /// lease kept alive, until the store takes it or the job's deadline passes. `Err` is
    /// what the job comes to when it cannot be kept: `deadline_exceeded` (retried to
    /// the deadline), `store_budget_exhausted` (refused for good), or handed back at
    /// once when a shutdown's grace is over (another replica calls again: paid twice,
    /// lost never).
    pub(super) async fn keep_paid<T, F, Fut>(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        what: &'static str,
        write: F,
    ) -> Result<T, Decision>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let until = lease.rec.deadline_ms.map(|d| {
            tokio::time::Instant::now() + std::time::Duration::from_millis(d.saturating_sub(self.clock.now_ms()))
        });
        let kept = tokio::select! {
            kept = self.policy.store_retry.run_until(until, write, |e, attempt, delay| self.store_retried(job, what, e, attempt, delay)) => kept,
            _ = self.abort.cancelled() => {
                tracing::warn!(what, "shutting down before a paid answer could be kept; the job goes back for another call");
                return Err(Decision::Release(None));
            }
        };
        kept.map_err(|e| {
            self.health.refused(self.region, &e);
            tracing::error!(what, error = %e, kind = e.kind(), "a paid answer could not be kept");
            let reason =
                if e.is_retryable() { TerminalReason::DeadlineExceeded } else { TerminalReason::StoreBudgetExhausted };
            Decision::Terminal { reason, status: Some("2xx".into()) }
        })
    }

    /// The result message of this lease's generation (no part), for `keep` and parts.
    pub(super) fn result_message(&self, job: &Job<'_>, lease: &Lease, v: &Validated) -> FindingsMessage {
        FindingsMessage::of(job.review, lease.generation(), v, self.policy.quarantine_raw_max)
    }

    /// What an answer means for the job (the pure `verdict`). A usable answer is
    /// validated and kept here, before any other write; then the key's quota learns
    /// from it.
    pub(super) async fn decide(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        target: &Target<'_>,
        metering: &Metering,
        answer: Answer,
    ) -> Decision {
        self.note(&answer);
        let (deployment, others, _) = job.callee(metering);
        let meter = match &answer {
            Answer::Upstream { outcome: UpstreamOutcome::Ok { meter, .. }, .. }
            | Answer::Upstream { outcome: UpstreamOutcome::RateLimited { meter, .. }, .. } => meter.clone(),
            _ => Default::default(),
        };
        let used = lease.rec.attempts.congestion;
        let predicted = match &answer {
            Answer::Upstream { outcome: UpstreamOutcome::RateLimited { retry_after: None, .. }, .. } => {
                deployment.quota.budgets().predicted().await
            }
            _ => None,
        };
        // A filtered answer was paid for too: charged and metered like any other.
        if let Answer::Upstream { outcome: UpstreamOutcome::ContentFiltered { usage: Some(u) }, .. } = &answer {
            self.paid(job, metering, *u).await;
        }
        let failover = others.alive();
        let (verdict, effect) =
            verdict(answer, used, self.policy.backoff(job.review.lane), rand::random::<f64>(), predicted, failover);
        let decision = match verdict {
            Verdict::Cached(hit) => self.keep(job, lease, hit, 0, None).await,
            Verdict::Usable { output, usage, status } => {
                if let Some(u) = usage {
                    self.paid(job, metering, u).await;
                }
                match (self.validate(job, lease, target.diff, &output), target.part) {
                    (Ok(validated), None) => self.keep(job, lease, validated, 0, Some(usage)).await,
                    (Ok(validated), Some(index)) => self.keep_part(job, lease, index, validated).await,
                    (Err(invalid), _) => {
                        Decision::Retry { budget: Budget::Schema, hint: None, status, invalid: Some(invalid.as_str()) }
                    }
                }
            }
            Verdict::Decided(decision) => decision,
        };
        // The readings first: the limits they teach decide whether a headroom pause is
        // needed (a bucket paces an empty dimension exactly; a pause would wait for it
        // to be full).
        deployment.quota.budgets().follow_readings(&meter).await;
        self.learn(&deployment.quota, effect, &meter).await;
        decision
    }

    /// A paid answer's usage: counted, charged to the job with the decision's write, and
    /// correcting the call's reservation in the key's budgets (once).
    async fn paid(&self, job: &Job<'_>, metering: &Metering, u: Tokens) {
        let deployment = job.callee(metering).0;
        self.metrics.tokens(&job.review.tenant, &job.scope.model_class, u);
        self.metrics.charged(&deployment.charge(u));
        *metering.tokens.lock().expect("tokens lock") = Some(u);
        if let Some(reserved) = &metering.reserved
            && !metering.corrected.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let used = reviewlane_core::meter::Cost { input: u.input, output: u.output };
            deployment.quota.budgets().correct_call(reserved, used).await;
        }
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
            Answer::Upstream { outcome: UpstreamOutcome::ContentFiltered { .. }, .. } => {
                tracing::warn!("the provider's content filter refused the review");
            }
            _ => {}
        }
    }

    /// Records what the key's shared quota learns (best effort: a failed write is
    /// logged, and the next answer teaches it again).
    async fn learn(&self, quota: &crate::quota::Quota, effect: QuotaEffect, meter: &crate::upstream::Meter) {
        let written = match effect {
            QuotaEffect::None => return,
            QuotaEffect::Succeeded { started_ms, pause } => {
                quota.succeeded(started_ms).await;
                match pause {
                    Some(d) if !quota.budgets().paces_every_empty(meter) => {
                        quota.pause(d).await.map_err(|e| ("recording a headroom pause failed", e))
                    }
                    _ => Ok(()),
                }
            }
            QuotaEffect::RateLimited(limited) => {
                quota.rate_limited(limited).await.map_err(|e| ("recording the scope pause failed", e))
            }
            QuotaEffect::OpenCircuit(cause) => quota
                .open_circuit(cause, self.policy.circuit_open_for)
                .await
                .map_err(|e| ("recording the open circuit failed", e)),
            QuotaEffect::Failed if quota.failed_in_a_row(FAILING_IN_A_ROW) => {
                tracing::warn!(failures = FAILING_IN_A_ROW, "deployment failing; out of routing for a while");
                quota
                    .open_circuit(crate::quota::CircuitCause::Failing, FAILING_OUT_FOR)
                    .await
                    .map_err(|e| ("recording the open circuit failed", e))
            }
            QuotaEffect::Failed => Ok(()),
        };
        if let Err((what, e)) = written {
            tracing::warn!(error = %e, "{what}");
        }
    }
}

/// Transient failures in a row on one replica that take a deployment out of routing.
const FAILING_IN_A_ROW: u32 = 5;
/// How long a failing deployment stays out of routing before a call probes it again.
const FAILING_OUT_FOR: Duration = Duration::from_secs(30);

// What an answer means: the pure table of step 3.

/// What an answer comes to before anything is written.
#[derive(Debug)]
pub(super) enum Verdict {
    /// The same review's validated result, from the cache: keep it as this job's.
    Cached(Validated),
    /// A 2xx: validate the output against the schema and the diff, then keep it (an
    /// invalid one spends the schema budget, with `status`).
    Usable {
        output: String,
        usage: Option<Tokens>,
        status: Option<String>,
    },
    Decided(Decision),
}

/// What the provider key's shared quota learns from an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QuotaEffect {
    None,
    /// A 2xx: the window may grow; `pause` when the answer's headers said a dimension
    /// is empty (the key slows down before a 429).
    Succeeded {
        started_ms: u64,
        pause: Option<Duration>,
    },
    /// A 429: every replica's calls on the key wait its `pause`, as this job does; a
    /// 429 of a metered dimension empties that bucket instead of narrowing the window.
    RateLimited(crate::quota::Limited),
    /// `insufficient_quota` or a refused key: the key's circuit opens for that cause.
    OpenCircuit(crate::quota::CircuitCause),
    /// A transient failure (5xx, timeout): counted; enough in a row open the key's
    /// circuit for a while.
    Failed,
}

/// A 429 without a hint that the answers predicted (the last reading of a limited
/// dimension said none remained): the dimension, and how long until its bucket has room.
pub(super) type Predicted = Option<(reviewlane_core::meter::Dimension, Duration)>;

/// The verdict on `answer` for a lease that has spent `congestion_used` congestion
/// retries: a 429 without the provider's hint waits the lane's `backoff` for the next
/// one (`unit`: uniform in [0, 1), the jitter) — unless the answers `predicted` it: then
/// the key pauses until the bucket has room and the job goes back to wait for it,
/// spending no retry. With `failover` (another deployment of the class is in routing),
/// a 429, `insufficient_quota` or a refused key still pauses the key or opens its
/// circuit, but the review goes back at once, spending nothing, for the other to take
/// (it waits there if the other is paused for a moment).
pub(super) fn verdict(
    answer: Answer,
    congestion_used: u32,
    backoff: &Backoff,
    unit: f64,
    predicted: Predicted,
    failover: bool,
) -> (Verdict, QuotaEffect) {
    let (verdict, effect) = verdict_alone(answer, congestion_used, backoff, unit, predicted);
    let handed_over = matches!(effect, QuotaEffect::RateLimited(_) | QuotaEffect::OpenCircuit(_));
    if failover && handed_over {
        return (Verdict::Decided(Decision::Release(None)), effect);
    }
    (verdict, effect)
}

/// The verdict of a deployment with no other of its class to hand the review to.
fn verdict_alone(
    answer: Answer,
    congestion_used: u32,
    backoff: &Backoff,
    unit: f64,
    predicted: Predicted,
) -> (Verdict, QuotaEffect) {
    let decided = |d| (Verdict::Decided(d), QuotaEffect::None);
    let (upstream, started_ms) = match answer {
        Answer::Cached(hit) => return (Verdict::Cached(hit), QuotaEffect::None),
        Answer::Upstream { outcome, started_ms, in_flight } => (outcome, (started_ms, in_flight)),
        other => return decided(abandoned(&other).unwrap_or(Decision::Release(None))),
    };
    let status = Some(upstream.status_class().to_string());
    match upstream {
        UpstreamOutcome::Ok { output, slow_down, usage, .. } => (
            Verdict::Usable { output, usage, status },
            QuotaEffect::Succeeded { started_ms: started_ms.0, pause: slow_down },
        ),
        UpstreamOutcome::RateLimited { retry_after: None, .. } if predicted.is_some() => {
            let (dimension, wait) = predicted.expect("checked");
            let (started_ms, in_flight) = started_ms;
            let limited =
                crate::quota::Limited { pause: wait, started_ms, in_flight: Some(in_flight), bucket: Some(dimension) };
            (Verdict::Decided(Decision::Release(Some(wait))), QuotaEffect::RateLimited(limited))
        }
        UpstreamOutcome::RateLimited { retry_after, dimension, .. } => {
            let delay = retry_after.unwrap_or_else(|| backoff.delay(congestion_used + 1, unit));
            let retry = Decision::Retry { budget: Budget::Congestion, hint: Some(delay), status, invalid: None };
            let (started_ms, in_flight) = started_ms;
            let limited =
                crate::quota::Limited { pause: delay, started_ms, in_flight: Some(in_flight), bucket: dimension };
            (Verdict::Decided(retry), QuotaEffect::RateLimited(limited))
        }
        UpstreamOutcome::Transient { .. } => (
            Verdict::Decided(Decision::Retry { budget: Budget::Transient, hint: None, status, invalid: None }),
            QuotaEffect::Failed,
        ),
        UpstreamOutcome::QuotaExhausted => (
            Verdict::Decided(Decision::Terminal { reason: TerminalReason::InsufficientQuota, status }),
            QuotaEffect::OpenCircuit(crate::quota::CircuitCause::InsufficientQuota),
        ),
        UpstreamOutcome::Permanent { status: 401 | 403 } => (
            Verdict::Decided(Decision::Terminal { reason: TerminalReason::UpstreamRejected, status }),
            QuotaEffect::OpenCircuit(crate::quota::CircuitCause::KeyRefused),
        ),
        UpstreamOutcome::Permanent { .. } => {
            decided(Decision::Terminal { reason: TerminalReason::UpstreamRejected, status })
        }
        // A completion cut by the filter was an answer (the key's window learns it
        // succeeded); a refused prompt was not.
        UpstreamOutcome::ContentFiltered { usage } => {
            let effect = match usage {
                Some(_) => QuotaEffect::Succeeded { started_ms: started_ms.0, pause: None },
                None => QuotaEffect::None,
            };
            (Verdict::Decided(Decision::Terminal { reason: TerminalReason::ContentFiltered, status }), effect)
        }
    }
}

/// The decision on a call abandoned before its answer: the shutdown grace is over, the
/// lease was taken over, the job ended or its deadline came. `None` for an answer.
pub(super) fn abandoned(answer: &Answer) -> Option<Decision> {
    match answer {
        Answer::Aborted => Some(Decision::Release(None)),
        Answer::LostLease => Some(Decision::Stale),
        Answer::Ended(reason) => Some(Decision::Ended(*reason)),
        Answer::DeadlinePassed => Some(Decision::Terminal { reason: TerminalReason::DeadlineExceeded, status: None }),
        Answer::Upstream { .. } | Answer::Cached(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000;

    fn decided(answer: Answer, used: u32, backoff: &Backoff) -> (Decision, QuotaEffect) {
        match verdict(answer, used, backoff, 0.5, None, false) {
            (Verdict::Decided(d), effect) => (d, effect),
            (other, _) => panic!("{other:?}"),
        }
    }

    fn upstream(outcome: UpstreamOutcome) -> Answer {
        Answer::Upstream { outcome, started_ms: NOW, in_flight: 3 }
    }

    #[test]
    fn a_2xx_is_kept_and_the_key_learns_it_succeeded() {
        let usage = Tokens { input: 10, output: 2 };
        let pause = Some(Duration::from_secs(3));
        let ok = UpstreamOutcome::Ok {
            output: "{}".into(),
            slow_down: pause,
            usage: Some(usage),
            meter: Default::default(),
        };
        let (v, effect) = verdict(upstream(ok), 0, &Backoff::default(), 0.5, None, false);
        assert!(
            matches!(&v, Verdict::Usable { output, usage: Some(u), status: Some(s) } if output == "{}" && *u == usage && s == "2xx"),
            "{v:?}"
        );
        assert_eq!(effect, QuotaEffect::Succeeded { started_ms: NOW, pause });
    }

    #[test]
    fn a_429_retries_on_the_congestion_budget_and_pauses_the_key_for_the_same_delay() {
        let b = Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60), jitter: (1.0, 1.0) };
        let limited = |retry_after, dimension| UpstreamOutcome::RateLimited {
            retry_after,
            capped: false,
            dimension,
            meter: Default::default(),
        };
        let effect_of = |pause, bucket| {
            QuotaEffect::RateLimited(crate::quota::Limited { pause, started_ms: NOW, in_flight: Some(3), bucket })
        };
        let hinted = limited(Some(Duration::from_secs(7)), None);
        let (d, effect) = decided(upstream(hinted), 0, &b);
        let seven = Duration::from_secs(7);
        assert_eq!(
            d,
            Decision::Retry {
                budget: Budget::Congestion,
                hint: Some(seven),
                status: Some("429".into()),
                invalid: None
            }
        );
        assert_eq!(effect, effect_of(seven, None));
        // Without a hint: the backoff of the next congestion retry (the third: 4 s); a
        // 429 of the tokens bucket says so to the quota.
        let bare = limited(None, Some(reviewlane_core::meter::Dimension::Tokens));
        let (d, effect) = decided(upstream(bare), 2, &b);
        let four = Duration::from_secs(4);
        assert!(matches!(d, Decision::Retry { budget: Budget::Congestion, hint: Some(h), .. } if h == four), "{d:?}");
        assert_eq!(effect, effect_of(four, Some(reviewlane_core::meter::Dimension::Tokens)));
        // Predicted by the answers (none left, no hint): the job waits for the bucket,
        // spending no retry, and the key pauses as long, for that bucket.
        let requests = reviewlane_core::meter::Dimension::Requests;
        let wait = Duration::from_secs(41);
        let (v, effect) = verdict(upstream(limited(None, None)), 2, &b, 0.5, Some((requests, wait)), false);
        assert!(matches!(v, Verdict::Decided(Decision::Release(Some(w))) if w == wait), "{v:?}");
        assert_eq!(effect, effect_of(wait, Some(requests)));
        // A hint is the provider's word: it is a congestion retry whatever was predicted.
        let (v, _) = verdict(upstream(limited(Some(seven), None)), 0, &b, 0.5, Some((requests, wait)), false);
        assert!(matches!(v, Verdict::Decided(Decision::Retry { budget: Budget::Congestion, .. })), "{v:?}");
    }

    #[test]
    fn transient_quota_and_permanent_answers_decide_without_keeping() {
        let b = Backoff::default();
        let (d, effect) = decided(upstream(UpstreamOutcome::Transient { status_class: "5xx" }), 0, &b);
        assert_eq!(
            d,
            Decision::Retry { budget: Budget::Transient, hint: None, status: Some("5xx".into()), invalid: None }
        );
        assert_eq!(effect, QuotaEffect::Failed, "counted toward taking a failing deployment out");
        let (d, effect) = decided(upstream(UpstreamOutcome::QuotaExhausted), 0, &b);
        assert_eq!(d, Decision::Terminal { reason: TerminalReason::InsufficientQuota, status: Some("429".into()) });
        assert_eq!(effect, QuotaEffect::OpenCircuit(crate::quota::CircuitCause::InsufficientQuota));
        let (d, effect) = decided(upstream(UpstreamOutcome::Permanent { status: 400 }), 0, &b);
        assert!(matches!(d, Decision::Terminal { reason: TerminalReason::UpstreamRejected, status: Some(_) }), "{d:?}");
        assert_eq!(effect, QuotaEffect::None);
        // The content filter ends the review saying so, never a retry; a filtered
        // completion still counts as a call the key answered.
        let (d, effect) = decided(upstream(UpstreamOutcome::ContentFiltered { usage: None }), 0, &b);
        assert_eq!(d, Decision::Terminal { reason: TerminalReason::ContentFiltered, status: Some("4xx".into()) });
        assert_eq!(effect, QuotaEffect::None);
        let paid = UpstreamOutcome::ContentFiltered { usage: Some(Tokens { input: 40, output: 5 }) };
        let (d, effect) = decided(upstream(paid), 0, &b);
        assert_eq!(d, Decision::Terminal { reason: TerminalReason::ContentFiltered, status: Some("2xx".into()) });
        assert_eq!(effect, QuotaEffect::Succeeded { started_ms: NOW, pause: None });
    }

    #[test]
    fn with_another_deployment_free_a_429_or_an_empty_account_hands_the_review_over_at_once() {
        let b = Backoff::default();
        let limited = UpstreamOutcome::RateLimited {
            retry_after: Some(Duration::from_secs(30)),
            capped: false,
            dimension: None,
            meter: Default::default(),
        };
        // The key still pauses for the hint (every replica's calls on it wait), and the
        // review goes back now, spending no retry, for the other deployment.
        let (v, effect) = verdict(upstream(limited.clone()), 0, &b, 0.5, None, true);
        assert!(matches!(v, Verdict::Decided(Decision::Release(None))), "{v:?}");
        assert!(matches!(effect, QuotaEffect::RateLimited(l) if l.pause == Duration::from_secs(30)), "{effect:?}");
        let (v, effect) = verdict(upstream(UpstreamOutcome::QuotaExhausted), 0, &b, 0.5, None, true);
        assert!(matches!(v, Verdict::Decided(Decision::Release(None))), "{v:?}");
        assert_eq!(
            effect,
            QuotaEffect::OpenCircuit(crate::quota::CircuitCause::InsufficientQuota),
            "the circuit opens for the fleet"
        );
        // A refused key: out of routing too, the review handed over.
        let (v, effect) = verdict(upstream(UpstreamOutcome::Permanent { status: 401 }), 0, &b, 0.5, None, true);
        assert!(matches!(v, Verdict::Decided(Decision::Release(None))), "{v:?}");
        assert_eq!(effect, QuotaEffect::OpenCircuit(crate::quota::CircuitCause::KeyRefused));
        let (v, _) = verdict(upstream(UpstreamOutcome::Permanent { status: 403 }), 0, &b, 0.5, None, false);
        assert!(matches!(v, Verdict::Decided(Decision::Terminal { reason: TerminalReason::UpstreamRejected, .. })));
        // Alone in its class: the retry and the end, as ever.
        let (v, _) = verdict(upstream(limited), 0, &b, 0.5, None, false);
        assert!(matches!(v, Verdict::Decided(Decision::Retry { budget: Budget::Congestion, .. })), "{v:?}");
        let (v, _) = verdict(upstream(UpstreamOutcome::QuotaExhausted), 0, &b, 0.5, None, false);
        assert!(matches!(v, Verdict::Decided(Decision::Terminal { reason: TerminalReason::InsufficientQuota, .. })));
        // Anything else decides the same either way.
        let (v, _) = verdict(upstream(UpstreamOutcome::Transient { status_class: "5xx" }), 0, &b, 0.5, None, true);
        assert!(matches!(v, Verdict::Decided(Decision::Retry { budget: Budget::Transient, .. })), "{v:?}");
    }

    #[test]
    fn an_answer_that_never_came_decides_alone() {
        let b = Backoff::default();
        for (answer, want) in [
            (Answer::Aborted, Decision::Release(None)),
            (Answer::LostLease, Decision::Stale),
            (Answer::Ended(TerminalReason::Cancelled), Decision::Ended(TerminalReason::Cancelled)),
            (Answer::DeadlinePassed, Decision::Terminal { reason: TerminalReason::DeadlineExceeded, status: None }),
        ] {
            assert_eq!(decided(answer, 0, &b), (want, QuotaEffect::None));
        }
    }
}
