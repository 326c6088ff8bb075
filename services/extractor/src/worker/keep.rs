//! Step 3, keep: validate a 200's output (pure), then store the result before anything
//! else can fail. From here on a store failure retries the store, never the provider
//! call: while the answer exists only in this worker, the write is retried with backoff
//! — the lease kept alive — until the store takes it (a full store, an outage) or the
//! job's deadline passes (`deadline_exceeded`). A store that refuses the write for good
//! ends the job `store_budget_exhausted`. Should the process die meanwhile, the message
//! returns after its lease and the job is called again: a second paid call, not a lost
//! review.

use reviewlane_core::findings::{self, InvalidOutput, Validated};
use reviewlane_core::job::Budget;
use reviewlane_core::messages::FindingsMessage;
use reviewlane_shared::faults::point;
use tracing::Instrument;
use tracing::field::Empty;

use super::call::Answer;
use super::plan::Decision;
use super::{Job, Lease, Metering, Target, Worker, plan};
use crate::upstream::UpstreamOutcome;

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
            if let Some(tokens) = cache {
                self.store_in_cache(job, &v, tokens).await;
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

    /// The result message of this lease's generation (no part), for `keep` and parts.
    pub(super) fn result_message(&self, job: &Job<'_>, lease: &Lease, v: &Validated) -> FindingsMessage {
        FindingsMessage::of(job.review, lease.generation(), v, self.policy.quarantine_raw_max)
    }

    /// What an answer means for the job (the pure `plan::verdict`). A usable answer is
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
        let meter = match &answer {
            Answer::Upstream { outcome: UpstreamOutcome::Ok { meter, .. }, .. }
            | Answer::Upstream { outcome: UpstreamOutcome::RateLimited { meter, .. }, .. } => meter.clone(),
            _ => Default::default(),
        };
        let used = lease.rec.attempts.congestion;
        let predicted = match &answer {
            Answer::Upstream { outcome: UpstreamOutcome::RateLimited { retry_after: None, .. }, .. } => {
                self.quota.budgets().predicted().await
            }
            _ => None,
        };
        let (verdict, effect) =
            plan::verdict(answer, used, self.policy.backoff(job.review.lane), rand::random::<f64>(), predicted);
        let decision = match verdict {
            plan::Verdict::Cached(hit) => self.keep(job, lease, hit, 0, None).await,
            plan::Verdict::Usable { output, usage, status } => {
                if let Some(u) = usage {
                    self.metrics.tokens(&job.review.tenant, &job.scope.model_class, u);
                    *metering.tokens.lock().expect("tokens lock") = Some(u);
                    if let Some(reserved) = &metering.reserved
                        && !metering.corrected.swap(true, std::sync::atomic::Ordering::Relaxed)
                    {
                        let used = reviewlane_core::meter::Cost { input: u.input, output: u.output };
                        self.quota.budgets().correct_call(reserved, used).await;
                    }
                }
                match (self.validate(job, lease, target.diff, &output), target.part) {
                    (Ok(validated), None) => self.keep(job, lease, validated, 0, Some(usage)).await,
                    (Ok(validated), Some(index)) => self.keep_part(job, lease, index, validated).await,
                    (Err(invalid), _) => {
                        Decision::Retry { budget: Budget::Schema, hint: None, status, invalid: Some(invalid.as_str()) }
                    }
                }
            }
            plan::Verdict::Decided(decision) => decision,
        };
        // The readings first: the limits they teach decide whether a headroom pause is
        // needed (a bucket paces an empty dimension exactly; a pause would wait for it
        // to be full).
        self.quota.budgets().follow_readings(&meter).await;
        self.learn(effect, &meter).await;
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
    async fn learn(&self, effect: plan::QuotaEffect, meter: &crate::upstream::Meter) {
        let written = match effect {
            plan::QuotaEffect::None => return,
            plan::QuotaEffect::Succeeded { started_ms, pause } => {
                self.quota.succeeded(started_ms).await;
                match pause {
                    Some(d) if !self.quota.budgets().paces_every_empty(meter) => {
                        self.quota.pause(d).await.map_err(|e| ("recording a headroom pause failed", e))
                    }
                    _ => Ok(()),
                }
            }
            plan::QuotaEffect::RateLimited(limited) => {
                self.quota.rate_limited(limited).await.map_err(|e| ("recording the scope pause failed", e))
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
}
