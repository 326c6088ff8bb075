//! The extractor's unit of work: one lane message -> at most one provider call -> one
//! decision, recorded in the job record by compare-and-set before the message is
//! settled. No worker sleeps holding a lease: a retry is a nak with a delay.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use reviewlane_shared::diff;
use reviewlane_shared::findings::{self, Validated};
use reviewlane_shared::job::{Budget, Event, JobRecord, JobState, TerminalReason};
use reviewlane_shared::job_store::{JobStore, StoreError};
use reviewlane_shared::layout::{self, RegionLayout};
use reviewlane_shared::messages::{FindingsMessage, ReviewMessage};
use reviewlane_shared::region::Region;
use reviewlane_shared::telemetry::now_ms;
use tokio_util::sync::CancellationToken;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::config::Budgets;
use crate::metrics::Metrics;
use crate::provider::{Provider, ProviderRequest};
use crate::quota::{Quota, Scope};
use crate::schedule::Admitted;
use crate::upstream::{Backoff, UpstreamOutcome};

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
    /// Handed back without delay (shutdown) or after an infrastructure error.
    Released,
}

pub struct Worker {
    pub region: Region,
    pub layout: RegionLayout,
    pub jobs: JobStore,
    pub provider: Arc<dyn Provider>,
    pub quota: Quota,
    pub metrics: Metrics,
    /// How long an `insufficient_quota` answer closes a scope to calls.
    pub circuit_open_for: Duration,
    pub budgets: Budgets,
    /// Backoff without a hint: interactive, batch.
    pub backoff: [Backoff; 2],
    pub lease: Duration,
    pub provider_timeout: Duration,
    /// `CACHE_<R>`: validated results by (tenant, diff, schema, depth, provider,
    /// model, prompt version); `None` when the cache is off.
    pub cache: Option<async_nats::jetstream::kv::Store>,
}

enum CallEnd {
    Answered(UpstreamOutcome),
    /// Shutdown grace over.
    Aborted,
    /// The job ended (cancelled) while the call ran.
    Ended(TerminalReason),
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
    pub async fn process_one(&self, admitted: Admitted, abort: &CancellationToken) -> Outcome {
        let delivered = admitted.msg.info().map(|i| i.delivered).unwrap_or(1);
        let span = tracing::info_span!(
            parent: None,
            "process",
            otel.name = "process review",
            otel.kind = "consumer",
            messaging.system = "nats",
            messaging.operation.type = "process",
            messaging.destination.name = %admitted.msg.subject,
            messaging.nats.delivered = delivered,
            job_id = Empty,
            tenant = %admitted.scope.tenant,
            region = %self.region,
            lane = Empty,
            schema_version = Empty,
            review_depth = Empty,
            provider = self.provider.name(),
            outcome = Empty,
        );
        reviewlane_shared::telemetry::set_remote_parent(
            &span,
            reviewlane_shared::telemetry::parent_from_nats(admitted.msg.headers.as_ref()),
        );
        let outcome = self.process(admitted, abort).instrument(span.clone()).await;
        span.record("outcome", outcome.as_str());
        outcome
    }

    async fn process(&self, admitted: Admitted, abort: &CancellationToken) -> Outcome {
        let Admitted { msg, scope, slot: _slot, running: _running } = admitted;
        let review: ReviewMessage = match serde_json::from_slice(&msg.payload) {
            Ok(r) => r,
            Err(_) => {
                tracing::error!("undecodable review message; terminating it");
                settle(&msg, AckKind::Term).await;
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
            settle(&msg, AckKind::Term).await;
            return Outcome::Skipped;
        }
        match self.run(&msg, &review, &scope, abort).await {
            Ok(outcome) => outcome,
            Err(e) => {
                tracing::warn!(error = %e, "infrastructure error; handing the message back");
                settle(&msg, AckKind::Nak(Some(INFRA_RETRY))).await;
                Outcome::Released
            }
        }
    }

    async fn run(
        &self,
        msg: &jetstream::Message,
        review: &ReviewMessage,
        scope: &Scope,
        abort: &CancellationToken,
    ) -> Result<Outcome, StoreError> {
        let id = review.job_id.as_str();
        let Some((rec, revision)) = self.jobs.get(id).await? else {
            tracing::warn!("no job record for message; terminating it");
            settle(msg, AckKind::Term).await;
            return Ok(Outcome::Skipped);
        };
        match rec.state {
            s if s.is_final() => {
                if rec.state == JobState::Terminal {
                    self.dead_letter(msg, review, rec.reason.unwrap_or(TerminalReason::Cancelled)).await?;
                }
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Skipped);
            }
            JobState::Validated => {
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Skipped);
            }
            // A previous holder may have published the result and died before
            // recording it: record it instead of paying for a second call.
            JobState::Running => {
                if let Some(found) = self.published_result(review).await? {
                    self.record_validated(msg, review, found.findings.len(), found.quarantined.len()).await?;
                    return Ok(Outcome::Skipped);
                }
            }
            _ => {}
        }

        // The same review was answered before: no call, no cost.
        let cache_key = self.cache_key(&rec.input_digest, review, scope);
        if let Some(hit) = self.cached(&cache_key).await {
            let leased = Event::Leased { lease_expires_at_ms: now_ms() + self.lease.as_millis() as u64 };
            match self.jobs.apply(id, &leased).await {
                Ok(rec) => {
                    tracing::info!("result cache hit");
                    let outcome = self.complete(msg, review, hit).await?;
                    self.metrics.finished(review.lane, rec.attempts.leases.saturating_sub(1), None);
                    return Ok(outcome);
                }
                Err(StoreError::Transition(..)) => {
                    settle(msg, AckKind::Ack).await;
                    return Ok(Outcome::Skipped);
                }
                Err(e) => return Err(e),
            }
        }
        // The provider account is out of money: end the job without paying for a call.
        if self.quota.circuit_open(scope) {
            return self.terminate(msg, review, TerminalReason::InsufficientQuota, None).await;
        }
        // Time the job waited while eligible: since submit, or since its retry delay ended.
        let eligible_at_ms = rec.next_eligible_at_ms.unwrap_or(rec.created_at_ms);
        let lease = Event::Leased { lease_expires_at_ms: now_ms() + self.lease.as_millis() as u64 };
        let leased = self.jobs.apply_from(id, Some((rec, revision)), &lease).await;
        let rec = match leased {
            Ok(r) => r,
            Err(StoreError::Transition(_, current)) => {
                tracing::info!(state = current.state.as_str(), "job moved on before lease");
                if current.state == JobState::Terminal {
                    self.dead_letter(msg, review, current.reason.unwrap_or(TerminalReason::Cancelled)).await?;
                }
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Skipped);
            }
            Err(e) => return Err(e),
        };

        let Ok(parsed) = diff::parse(&review.diff) else {
            return self.terminate(msg, review, TerminalReason::InvalidInput, None).await;
        };
        let req = ProviderRequest {
            job_id: id,
            region: review.region,
            schema_version: &review.schema_version,
            diff_text: &review.diff,
            diff: &parsed,
            review_depth: review.review_depth,
        };
        let call_started_ms = now_ms();
        let attempt = tracing::info_span!(
            "provider.attempt",
            otel.kind = "client",
            attempt = rec.attempts.leases,
            provider = self.provider.name(),
            model_class = %scope.model_class,
            queue_wait_ms = call_started_ms.saturating_sub(eligible_at_ms),
            outcome = Empty,
            status_class = Empty,
            budget = Empty,
            budget_remaining = Empty,
            duration_ms = Empty,
        );
        let started = std::time::Instant::now();
        let call = self.call_with_lease(msg, &req, abort).instrument(attempt.clone()).await?;
        let took = started.elapsed();
        attempt.record("duration_ms", took.as_millis() as u64);
        let upstream = match call {
            CallEnd::Answered(u) => u,
            CallEnd::Aborted => {
                tracing::info!("shutdown grace over; handing the message back");
                settle(msg, AckKind::Nak(None)).await;
                return Ok(Outcome::Released);
            }
            CallEnd::Ended(reason) => {
                tracing::info!(reason = reason.as_str(), "job ended during the provider call; call abandoned");
                self.dead_letter(msg, review, reason).await?;
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Terminal(reason));
            }
        };
        let status = Some(upstream.status_class().to_string());
        let outcome_class = match &upstream {
            UpstreamOutcome::Ok { .. } => "ok",
            UpstreamOutcome::RateLimited { .. } => "rate_limited",
            UpstreamOutcome::QuotaExhausted => "insufficient_quota",
            UpstreamOutcome::Transient { .. } => "transient",
            UpstreamOutcome::Permanent { .. } => "rejected",
        };
        self.metrics.upstream(scope, outcome_class, upstream.status_class(), took);
        attempt.record("outcome", outcome_class).record("status_class", upstream.status_class());
        attempt.in_scope(|| {
            tracing::info!(outcome = outcome_class, status_class = upstream.status_class(), "provider answered")
        });
        let budget_of = |b: Budget| (b, self.allowed(b).saturating_sub(rec.attempts.get(b) + 1));
        let charged = match &upstream {
            UpstreamOutcome::RateLimited { .. } => Some(budget_of(Budget::Congestion)),
            UpstreamOutcome::Transient { .. } => Some(budget_of(Budget::Transient)),
            _ => None,
        };
        if let Some((b, left)) = charged {
            attempt.record("budget", b.as_str()).record("budget_remaining", left);
        }
        match upstream {
            UpstreamOutcome::Ok { output, slow_down, usage } => {
                self.quota.succeeded(scope, call_started_ms);
                if let Some(u) = usage {
                    self.metrics.tokens(&review.tenant, u);
                }
                if let Some(d) = slow_down
                    && let Err(e) = self.quota.pause(scope, d).await
                {
                    tracing::warn!(error = %e, "recording a headroom pause failed");
                }
                let checked = {
                    let span = tracing::info_span!(
                        "validate",
                        schema_version = %review.schema_version,
                        result = Empty,
                        findings = Empty,
                        quarantined = Empty,
                    );
                    let _enter = span.enter();
                    let checked = findings::validate(&review.schema_version, &output, &parsed);
                    match &checked {
                        Ok(v) => {
                            span.record("result", "valid")
                                .record("findings", v.findings.len())
                                .record("quarantined", v.quarantined.len());
                        }
                        Err(invalid) => {
                            span.record("result", invalid.as_str());
                            tracing::warn!(reason = invalid.as_str(), "invalid provider output");
                        }
                    }
                    checked
                };
                match checked {
                    Ok(validated) => {
                        self.store_in_cache(&cache_key, &validated).await;
                        let outcome = self.complete(msg, review, validated).await?;
                        self.metrics.finished(review.lane, rec.attempts.leases, None);
                        Ok(outcome)
                    }
                    Err(invalid) => {
                        self.metrics.invalid_output(&review.schema_version, invalid.as_str());
                        let (b, left) = budget_of(Budget::Schema);
                        attempt.record("budget", b.as_str()).record("budget_remaining", left);
                        self.retry_or_terminate(msg, review, &rec, Budget::Schema, None, status).await
                    }
                }
            }
            UpstreamOutcome::RateLimited { retry_after, capped } => {
                if capped {
                    self.metrics.hint_capped();
                    tracing::warn!("provider retry hint above the ceiling; rescheduled at the ceiling");
                }
                // The whole scope waits, on every replica, for as long as this job does.
                let delay = retry_after
                    .unwrap_or_else(|| self.backoff(review).delay(rec.attempts.congestion + 1, rand::random::<f64>()));
                if let Err(e) = self.quota.rate_limited(scope, delay, call_started_ms).await {
                    tracing::warn!(error = %e, "recording the scope pause failed");
                }
                self.retry_or_terminate(msg, review, &rec, Budget::Congestion, Some(delay), status).await
            }
            UpstreamOutcome::Transient { .. } => {
                self.retry_or_terminate(msg, review, &rec, Budget::Transient, None, status).await
            }
            UpstreamOutcome::QuotaExhausted => {
                tracing::error!("provider account out of quota; circuit open for the scope");
                if let Err(e) = self.quota.open_circuit(scope, self.circuit_open_for).await {
                    tracing::warn!(error = %e, "recording the open circuit failed");
                }
                self.terminate(msg, review, TerminalReason::InsufficientQuota, status).await
            }
            UpstreamOutcome::Permanent { status: code } => {
                tracing::warn!(status = code, "provider rejected the request");
                self.terminate(msg, review, TerminalReason::UpstreamRejected, status).await
            }
        }
    }

    fn allowed(&self, budget: Budget) -> u32 {
        match budget {
            Budget::Congestion => self.budgets.congestion,
            Budget::Transient => self.budgets.transient,
            Budget::Schema => self.budgets.schema,
        }
    }

    /// Same tenant, diff (its digest, computed once by the ingress), schema, depth,
    /// provider, model and prompt: same answer. Per tenant, so no tenant can learn what
    /// another submitted.
    fn cache_key(&self, input_digest: &str, review: &ReviewMessage, scope: &Scope) -> String {
        reviewlane_shared::job_id::sha256_hex(&[
            review.tenant.as_bytes(),
            input_digest.as_bytes(),
            review.schema_version.as_bytes(),
            review.review_depth.as_str().as_bytes(),
            scope.provider.as_bytes(),
            scope.model_class.as_bytes(),
            crate::provider::PROMPT_VERSION.as_bytes(),
        ])
    }

    async fn cached(&self, key: &str) -> Option<Validated> {
        let cache = self.cache.as_ref()?;
        let hit = match cache.get(key).await {
            Ok(Some(v)) => serde_json::from_slice::<Validated>(&v).ok(),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, "result cache read failed");
                None
            }
        };
        self.metrics.cache(hit.is_some());
        hit
    }

    async fn store_in_cache(&self, key: &str, v: &Validated) {
        let Some(cache) = &self.cache else { return };
        let value = serde_json::to_vec(v).expect("validated findings serialize");
        if let Err(e) = cache.put(key, value.into()).await {
            tracing::warn!(error = %e, "result cache write failed");
        }
    }

    fn backoff(&self, review: &ReviewMessage) -> &Backoff {
        &self.backoff[usize::from(review.lane == reviewlane_shared::Lane::Batch)]
    }

    /// Runs the provider call, extending the lease with progress acks while it is alive,
    /// and abandoning it when the job ends meanwhile (cancelled) or `abort` fires.
    async fn call_with_lease(
        &self,
        msg: &jetstream::Message,
        req: &ProviderRequest<'_>,
        abort: &CancellationToken,
    ) -> Result<CallEnd, StoreError> {
        let mut changes = self.jobs.changes(req.job_id).await?;
        let call = tokio::time::timeout(self.provider_timeout, self.provider.review(req));
        tokio::pin!(call);
        let mut heartbeat = tokio::time::interval(self.lease / 3);
        heartbeat.tick().await; // the first tick is immediate
        loop {
            tokio::select! {
                res = &mut call => {
                    return Ok(CallEnd::Answered(res.unwrap_or(UpstreamOutcome::Transient { status_class: "timeout" })));
                }
                _ = heartbeat.tick() => {
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        tracing::warn!(error = %e, "progress ack failed");
                    }
                }
                Some(()) = changes.next() => {
                    // The signal can precede the stored update: read again shortly if
                    // the record has not moved yet.
                    for _ in 0..3 {
                        match self.jobs.get(req.job_id).await? {
                            Some((rec, _)) if rec.state == JobState::Terminal => {
                                return Ok(CallEnd::Ended(rec.reason.unwrap_or(TerminalReason::Cancelled)));
                            }
                            Some((rec, _)) if rec.state != JobState::Running => break,
                            _ => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
                        }
                    }
                }
                _ = abort.cancelled() => return Ok(CallEnd::Aborted),
            }
        }
    }

    async fn complete(
        &self,
        msg: &jetstream::Message,
        review: &ReviewMessage,
        v: Validated,
    ) -> Result<Outcome, StoreError> {
        let (n, q) = (v.findings.len(), v.quarantined.len());
        for reason in v.quarantined.iter().map(|q| q.reason.as_str()) {
            tracing::info!(reason, "finding quarantined");
        }
        self.metrics.validated(n, v.quarantined.iter().map(|q| q.reason.as_str()));
        let out = FindingsMessage {
            job_id: review.job_id.clone(),
            tenant: review.tenant.clone(),
            region: review.region,
            lane: review.lane,
            schema_version: review.schema_version.clone(),
            review_depth: review.review_depth,
            metadata: review.metadata.clone(),
            findings: v.findings,
            quarantined: v.quarantined,
            submitted_at_ms: review.submitted_at_ms,
        };
        let payload = serde_json::to_vec(&out).expect("findings serialize");
        let subject = layout::findings_subject(review.region, &review.tenant, &review.job_id);
        let span = tracing::info_span!(
            "findings.publish",
            otel.kind = "producer",
            messaging.system = "nats",
            messaging.operation.type = "publish",
            messaging.destination.name = %subject,
            findings = n,
            quarantined = q,
        );
        async {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, review.job_id.as_str());
            reviewlane_shared::telemetry::inject_nats(&mut headers);
            self.layout
                .js
                .publish_with_headers(subject, headers, payload.into())
                .await
                .map_err(|e| StoreError::Nats(e.into()))?
                .await
                .map_err(|e| StoreError::Nats(e.into()))
        }
        .instrument(span)
        .await?;
        self.record_validated(msg, review, n, q).await?;
        tracing::info!(findings = n, quarantined = q, "validated");
        Ok(Outcome::Validated { findings: n, quarantined: q })
    }

    async fn record_validated(
        &self,
        msg: &jetstream::Message,
        review: &ReviewMessage,
        n: usize,
        q: usize,
    ) -> Result<(), StoreError> {
        let event = Event::Validated { findings: n as u32, quarantined: q as u32 };
        match self.jobs.apply(&review.job_id, &event).await {
            Ok(_) => {}
            // Cancelled meanwhile: the publisher sees the terminal state and delivers nothing.
            Err(StoreError::Transition(_, current)) => {
                tracing::info!(state = current.state.as_str(), "job moved on before validation was recorded");
            }
            Err(e) => return Err(e),
        }
        settle(msg, AckKind::Ack).await;
        Ok(())
    }

    async fn published_result(&self, review: &ReviewMessage) -> Result<Option<FindingsMessage>, StoreError> {
        let stream = self
            .layout
            .js
            .get_stream_no_info(layout::findings_stream(review.region))
            .await
            .map_err(|e| StoreError::Nats(e.into()))?;
        let subject = layout::findings_subject(review.region, &review.tenant, &review.job_id);
        match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => Ok(serde_json::from_slice(&m.payload).ok()),
            Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(StoreError::Nats(e.into())),
        }
    }

    async fn retry_or_terminate(
        &self,
        msg: &jetstream::Message,
        review: &ReviewMessage,
        rec: &JobRecord,
        budget: Budget,
        hint: Option<Duration>,
        status: Option<String>,
    ) -> Result<Outcome, StoreError> {
        let used = rec.attempts.get(budget);
        if used >= self.allowed(budget) {
            let reason = match budget {
                Budget::Congestion => TerminalReason::RateLimitBudgetExhausted,
                Budget::Transient => TerminalReason::TransientBudgetExhausted,
                Budget::Schema => TerminalReason::InvalidOutput,
            };
            return self.terminate(msg, review, reason, status).await;
        }
        let delay = hint.unwrap_or_else(|| self.backoff(review).delay(used + 1, rand::random::<f64>()));
        let event = Event::RetryScheduled {
            budget,
            next_eligible_at_ms: now_ms() + delay.as_millis() as u64,
            upstream_status: status,
        };
        match self.jobs.apply(&review.job_id, &event).await {
            Ok(_) => {}
            Err(StoreError::Transition(_, current)) if current.state == JobState::Terminal => {
                self.dead_letter(msg, review, current.reason.unwrap_or(TerminalReason::Cancelled)).await?;
                settle(msg, AckKind::Ack).await;
                return Ok(Outcome::Skipped);
            }
            Err(e) => return Err(e),
        }
        tracing::info!(
            budget = budget.as_str(),
            attempt = used + 1,
            delay_ms = delay.as_millis() as u64,
            "retry scheduled"
        );
        self.metrics.retry(budget, delay);
        settle(msg, AckKind::Nak(Some(delay))).await;
        Ok(Outcome::RetryScheduled { budget, delay })
    }

    async fn terminate(
        &self,
        msg: &jetstream::Message,
        review: &ReviewMessage,
        reason: TerminalReason,
        status: Option<String>,
    ) -> Result<Outcome, StoreError> {
        match self.jobs.apply(&review.job_id, &Event::Terminate { reason, upstream_status: status }).await {
            Ok(rec) => self.metrics.finished(review.lane, rec.attempts.leases, Some(reason)),
            Err(StoreError::Transition(..)) => {}
            Err(e) => return Err(e),
        }
        self.dead_letter(msg, review, reason).await?;
        settle(msg, AckKind::Ack).await;
        tracing::warn!(reason = reason.as_str(), "job terminal");
        Ok(Outcome::Terminal(reason))
    }

    /// Moves the review to `DEADLETTER_<R>` (same region, same access policy as the
    /// diff) so it leaves the lane and stops skewing its queue age.
    async fn dead_letter(
        &self,
        msg: &jetstream::Message,
        review: &ReviewMessage,
        reason: TerminalReason,
    ) -> Result<(), StoreError> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, review.job_id.as_str());
        headers.insert("Reviewlane-Reason", reason.as_str());
        let subject = layout::deadletter_subject(review.region, &review.tenant, &review.job_id);
        self.layout
            .js
            .publish_with_headers(subject, headers, msg.payload.clone())
            .await
            .map_err(|e| StoreError::Nats(e.into()))?
            .await
            .map_err(|e| StoreError::Nats(e.into()))?;
        Ok(())
    }
}

impl Outcome {
    /// The outcome's class, for the `process` span.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Validated { .. } => "validated",
            Outcome::RetryScheduled { .. } => "retry_scheduled",
            Outcome::Terminal(_) => "terminal",
            Outcome::Skipped => "skipped",
            Outcome::Released => "released",
        }
    }
}

async fn settle(msg: &jetstream::Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::warn!(error = %e, "settling the message failed; it will be redelivered after its lease");
    }
}
