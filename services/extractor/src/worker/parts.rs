//! Reviews larger than the model's context: one job, many parts.
//!
//! The first holder splits the diff (`reviewlane_core::chunk`) and records the plan
//! in the job record; every later holder splits it alike from the recorded plan. Each
//! delivery of the message answers one part — one call, admitted like any other call
//! (call slot, the scope's window and pause) — keeps that part's validated result on
//! `PARTS_<R>`, records the part done (fenced, like every write of a lease) and hands
//! the message straight back for the next part. A crash, a 429 or a schema retry
//! therefore redoes only the part not yet recorded, and a part kept just before a
//! crash is recorded from what was kept, without a call: no part is paid twice. The
//! delivery that records the last part merges the parts' findings
//! (`reviewlane_core::aggregate`) into the job's one result.

use std::borrow::Cow;

use reviewlane_core::chunk::{self, Part};
use reviewlane_core::diff;
use reviewlane_core::findings::Validated;
use reviewlane_core::job::{Event, JobState, Parts, TerminalReason, TransitionError};
use reviewlane_core::messages::FindingsMessage;
use reviewlane_core::{aggregate, job::ReviewDepth};
use reviewlane_shared::faults::point;
use reviewlane_shared::job_store::StoreError;
use tokio_util::sync::CancellationToken;

use super::settle::{Decision, Outcome};
use super::{Job, Lease, Target, Worker};

/// Split reviews whose parts a worker keeps (each about the size of its diff).
pub(super) const SPLIT_CACHE: usize = 4;

/// Recently split reviews: (job id, plan) and their parts.
pub type SplitCache = std::sync::Mutex<std::collections::VecDeque<((String, chunk::Plan), std::sync::Arc<Vec<Part>>)>>;

/// How a review is answered.
pub(super) enum Planned {
    /// In one call.
    Whole,
    /// In parts: the parts, and which are done.
    Split(std::sync::Arc<Vec<Part>>, Parts),
    /// Not at all: the decision says why.
    Decided(Decision),
}

impl Worker {
    /// Splits the review when it does not fit the model's context in one call, and
    /// records the plan (once).
    pub(super) async fn plan(&self, job: &Job<'_>, lease: &Lease) -> Result<Planned, StoreError> {
        let diff = job.diff.as_ref().expect("trip checked the diff");
        let recorded = lease.rec.parts.clone();
        let plan = recorded.as_ref().map_or(self.policy.parts.plan, |p| p.plan);
        if recorded.is_none() {
            // A token is at least one byte: a prompt no longer than the budget in bytes
            // fits without counting.
            let prompt = crate::provider::prompt_diff(job.review, diff);
            if prompt.len() <= plan.limits.budget() {
                return Ok(Planned::Whole);
            }
        }
        let parts = self.split(job, diff, plan);
        let progress = match recorded {
            Some(p) if p.total as usize == parts.len() => p,
            Some(p) => {
                // Splitting is deterministic for a plan; this means the build changed how.
                tracing::error!(recorded = p.total, now = parts.len(), "the review splits differently than recorded");
                let decision = Decision::Terminal { reason: TerminalReason::InvalidInput, status: None };
                return Ok(Planned::Decided(decision));
            }
            None if parts.len() <= 1 => return Ok(Planned::Whole),
            None if parts.len() > self.policy.parts.max_parts as usize => {
                tracing::warn!(parts = parts.len(), max = self.policy.parts.max_parts, "review needs too many parts");
                let decision = Decision::Terminal { reason: TerminalReason::TooLarge, status: None };
                return Ok(Planned::Decided(decision));
            }
            None => {
                let event = Event::Planned { generation: lease.generation(), total: parts.len() as u32, plan };
                match self.apply_leased(job, lease, &event, None).await {
                    Ok(rec) => {
                        tracing::info!(
                            parts = parts.len(),
                            tokenizer = plan.tokenizer.as_str(),
                            budget_tokens = plan.limits.budget(),
                            "review split into parts"
                        );
                        rec.parts.expect("just planned")
                    }
                    Err(StoreError::Transition(TransitionError::Fenced { .. }, _)) => {
                        return Ok(Planned::Decided(Decision::Stale));
                    }
                    Err(StoreError::Transition(_, current)) if current.state == JobState::Terminal => {
                        let reason = current.reason.unwrap_or(TerminalReason::Cancelled);
                        return Ok(Planned::Decided(Decision::Ended(reason)));
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        Ok(Planned::Split(parts, progress))
    }

    /// The review's parts under `plan`. Each part's delivery needs them, so the last few
    /// reviews' are kept: a split costs a pass of the tokenizer over the whole diff.
    fn split(&self, job: &Job<'_>, diff: &diff::Diff, plan: chunk::Plan) -> std::sync::Arc<Vec<Part>> {
        let key = (job.id().to_string(), plan);
        if let Some((_, parts)) = self.split_cache.lock().expect("split cache lock").iter().find(|(k, _)| *k == key) {
            return parts.clone();
        }
        // At degraded depth the parts are cut from what a call would be shown.
        let degraded = match job.review.review_depth {
            ReviewDepth::Full => None,
            ReviewDepth::ChangedHunks => diff::parse(&diff::changed_lines_only(diff, 1)).ok(),
        };
        let source = degraded.as_ref().unwrap_or(diff);
        let counter = crate::tokenizer::counter(plan.tokenizer);
        let parts = std::sync::Arc::new(chunk::split(source, &plan.limits, counter.as_ref()));
        if parts.len() > 1 {
            let mut cache = self.split_cache.lock().expect("split cache lock");
            if cache.len() == SPLIT_CACHE {
                cache.pop_front();
            }
            cache.push_back((key, parts.clone()));
        }
        parts
    }

    /// One delivery of a split review: the next part (resumed from a kept result, or
    /// called), then — when it was the last — the merge.
    pub(super) async fn split_trip(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        parts: std::sync::Arc<Vec<Part>>,
        mut progress: Parts,
        abort: &CancellationToken,
    ) -> Result<Outcome, StoreError> {
        if let Some(index) = progress.next() {
            let release = progress.done.len() + 1 < progress.total as usize;
            let decision = match self.stores.results.read_part(&job.review.tenant, job.id(), index).await? {
                // Kept by a holder that died before recording it: recorded now, unpaid.
                Some((kept, seq)) => {
                    tracing::info!(part = index, "part result kept before; recorded without a call");
                    Decision::PartDone {
                        index,
                        seq,
                        findings: kept.findings.len(),
                        quarantined: kept.quarantined.len(),
                        release,
                    }
                }
                None => {
                    let part = &parts[index as usize];
                    let Ok(part_diff) = diff::parse(&part.text) else {
                        tracing::error!(part = index, "a part does not parse");
                        let decision = Decision::Terminal { reason: TerminalReason::InvalidInput, status: None };
                        return self.settle(job, lease, decision).await;
                    };
                    let target = Target { diff: &part_diff, text: Cow::Borrowed(&part.text), part: Some(index) };
                    let answer = self.call(job, lease, &target, abort).await?;
                    match self.decide(job, lease, &target, answer).await {
                        Decision::PartDone { index, seq, findings, quarantined, .. } => {
                            Decision::PartDone { index, seq, findings, quarantined, release }
                        }
                        other => other,
                    }
                }
            };
            match self.settle(job, lease, decision).await? {
                Outcome::PartDone { parts } if parts.complete() => progress = parts,
                other => return Ok(other),
            }
        }
        let decision = self.merge_parts(job, lease, &progress).await;
        self.settle(job, lease, decision).await
    }

    /// Keeps one part's validated result on `PARTS_<R>` (before any other write).
    pub(super) async fn keep_part(&self, job: &Job<'_>, lease: &Lease, index: u32, v: Validated) -> Decision {
        let result = FindingsMessage { part: Some(index), ..self.result_message(job, lease, &v) };
        let kept = self
            .keep_paid(job, lease, "keep part", || async {
                self.faults.check(point::EXTRACTOR_KEEP)?;
                self.stores.results.keep_part(&result, &async_nats::HeaderMap::new()).await
            })
            .await;
        match kept {
            Ok((at, seq)) => {
                self.metrics.kept(at);
                tracing::info!(part = index, "part result kept");
                Decision::PartDone {
                    index,
                    seq,
                    findings: v.findings.len(),
                    quarantined: v.quarantined.len(),
                    release: true,
                }
            }
            Err(unkept) => unkept,
        }
    }

    /// Reads every part's result back, merges them and keeps the job's one result.
    async fn merge_parts(&self, job: &Job<'_>, lease: &Lease, progress: &Parts) -> Decision {
        let mut results = Vec::with_capacity(progress.done.len());
        for done in &progress.done {
            match self.with_store_retry(job, "read part", || self.stores.results.read_part_at(done.seq)).await {
                Ok(m) => results.push(Validated { findings: m.findings, quarantined: m.quarantined }),
                Err(e) => {
                    tracing::error!(error = %e, kind = e.kind(), part = done.index, "a kept part result is unreadable");
                    return Decision::Terminal { reason: TerminalReason::StoreBudgetExhausted, status: None };
                }
            }
        }
        let merged = aggregate::merge(results, self.policy.parts.findings_cap as usize);
        tracing::info!(
            parts = progress.total,
            findings = merged.validated.findings.len(),
            dropped = merged.dropped,
            "parts merged"
        );
        // The cache remembers what the whole review cost: every part's call.
        let total = progress.done.iter().fold(reviewlane_core::job::Tokens::default(), |mut t, d| {
            t.input += d.tokens.input;
            t.output += d.tokens.output;
            t
        });
        self.keep(job, lease, merged.validated, merged.dropped, Some(Some(total))).await
    }

    /// The result message of this lease's generation (no part), for `keep` and parts.
    pub(super) fn result_message(&self, job: &Job<'_>, lease: &Lease, v: &Validated) -> FindingsMessage {
        let review = job.review;
        FindingsMessage {
            job_id: review.job_id.clone(),
            generation: lease.generation(),
            stored_as: None,
            tenant: review.tenant.clone(),
            region: review.region,
            lane: review.lane,
            schema_version: review.schema_version.clone(),
            review_depth: review.review_depth,
            metadata: review.metadata.clone(),
            findings: v.findings.clone(),
            quarantined: v.quarantined.iter().cloned().map(|q| q.bounded(self.policy.quarantine_raw_max)).collect(),
            submitted_at_ms: review.submitted_at_ms,
            part: None,
            findings_dropped: 0,
        }
    }
}
