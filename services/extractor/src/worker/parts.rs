//! Reviews larger than the model's context: one job, many parts.
//!
//! The first holder splits the diff (`reviewlane_core::parts`) and records the plan
//! in the job record; every later holder splits it alike from the recorded plan. A
//! holder runs the parts not yet recorded concurrently: the first where its delivery
//! was admitted, each other as soon as admission has a place for it at once (a call
//! slot no waiting message is in line for, the scope's window and its tenant's fair
//! share, the key's budgets), so a large review on an idle account takes a few call
//! times, and one among other tenants' reviews takes only what they leave. Each part's
//! validated result is kept on `PARTS_<R>`, then recorded done (fenced, like every
//! write of a lease). A 429 or a schema retry of one part stops new parts; the parts
//! in flight finish and are recorded, and the retry redoes only the parts not
//! recorded. A part kept just before a crash is recorded from what was kept, without
//! a call: a crash re-pays at most the parts in flight. When no part can start and
//! none is in flight, the message goes back to its lane to be admitted again. The
//! holder that records the last part merges the parts' findings
//! (`reviewlane_core::aggregate`) into the job's one result.

use std::borrow::Cow;
use std::collections::VecDeque;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use reviewlane_core::diff;
use reviewlane_core::findings::Validated;
use reviewlane_core::job::{Charge, Event, JobState, Parts, TerminalReason, Tokens, TransitionError};
use reviewlane_core::messages::FindingsMessage;
use reviewlane_core::parts::{self as diff_parts, Part};
use reviewlane_core::{aggregate, job::ReviewDepth};
use reviewlane_shared::faults::point;
use reviewlane_shared::job_store::StoreError;
use tokio_util::sync::CancellationToken;

use super::{Decision, End, Outcome};
use super::{Job, Lease, Metering, Target, Worker};

/// Split reviews whose parts a worker keeps (each about the size of its diff).
pub(super) const SPLIT_CACHE: usize = 4;

/// Recently split reviews: (job id, plan) and their parts.
pub type SplitCache =
    std::sync::Mutex<std::collections::VecDeque<((String, diff_parts::Plan), std::sync::Arc<Vec<Part>>)>>;

/// How often a split review with parts waiting looks for a place for the next one
/// while others are in flight (it also looks whenever a part ends).
const PLACE_RECHECK: std::time::Duration = std::time::Duration::from_millis(250);

/// What running a split review's parts came to.
enum Ran {
    /// Every part is recorded: the merge follows.
    Complete(Parts),
    /// To be settled now that the parts in flight are recorded: a part's retry or end,
    /// or a hand-back when no part could start; with the paid calls whose decision this
    /// is (charged with it).
    Decided(Decision, Option<Charge>),
    /// Recording a part came to this (the lease taken over, the job ended, the store):
    /// the trip ends with it, the message answered with `ack` (`None`: left alone).
    Ended(Outcome, Option<async_nats::jetstream::AckKind>),
}

/// Of two parts' decisions, the one the job comes to: an end before a retry, a retry
/// before a hand-back.
fn graver(first: Decision, other: Decision) -> Decision {
    let rank = |d: &Decision| match d {
        Decision::Stale => 4,
        Decision::Ended(_) => 3,
        Decision::Terminal { .. } => 2,
        Decision::Retry { .. } => 1,
        _ => 0,
    };
    if rank(&other) > rank(&first) { other } else { first }
}

/// Two parts' paid calls as one charge: their tokens and costs added, named after the
/// later's deployment.
fn sum(a: Option<Charge>, b: Option<Charge>) -> Option<Charge> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Charge {
            tokens: Tokens { input: a.tokens.input + b.tokens.input, output: a.tokens.output + b.tokens.output },
            cost_micro_usd: a.cost_micro_usd + b.cost_micro_usd,
            served_by: b.served_by,
        }),
        (a, b) => a.or(b),
    }
}

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
    /// Splits a review that may not fit the model's context in one call (`take` found
    /// its prompt longer than the budget in bytes, or a split under way), and records
    /// the plan (once).
    pub(super) async fn plan_parts(&self, job: &Job<'_>, lease: &Lease) -> Result<Planned, StoreError> {
        let diff = job.diff.as_ref().expect("trip checked the diff");
        let recorded = lease.rec.parts.clone();
        let plan = recorded.as_ref().map_or(self.policy.parts.plan, |p| p.plan);
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
                match lease.apply(&self.stores.jobs, &event, None).await {
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
    fn split(&self, job: &Job<'_>, diff: &diff::Diff, plan: diff_parts::Plan) -> std::sync::Arc<Vec<Part>> {
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
        let parts = std::sync::Arc::new(diff_parts::split(source, &plan.limits, counter.as_ref()));
        if parts.len() > 1 {
            let mut cache = self.split_cache.lock().expect("split cache lock");
            if cache.len() == SPLIT_CACHE {
                cache.pop_front();
            }
            cache.push_back((key, parts.clone()));
        }
        parts
    }

    /// A split review: its parts called concurrently as far as admission allows, each
    /// recorded as it is kept (`run_parts`), with the lease kept alive and watched
    /// meanwhile; then — when every part is recorded — the merge, or else what stopped
    /// the parts (a part's retry or end, or no part able to start: back to the lane).
    pub(super) async fn split_trip(
        &self,
        job: &Job<'_>,
        lease: Box<Lease>,
        parts: std::sync::Arc<Vec<Part>>,
        progress: Parts,
        abort: &CancellationToken,
    ) -> Result<End, StoreError> {
        let ran = self.watched(job, &lease, self.run_parts(job, &lease, &parts, progress), abort).await;
        // Parts abandoned before their call give their reservations back.
        let started = job.part_metering.lock().expect("parts lock").clone();
        for metering in started {
            self.release_unused(job, &metering).await;
        }
        let (decision, charge) = match ran? {
            Ok(Ok(Ran::Complete(progress))) => (self.merge_parts(job, &lease, &progress).await, None),
            Ok(Ok(Ran::Decided(decision, tokens))) => (decision, tokens),
            Ok(Ok(Ran::Ended(outcome, ack))) => return Ok(End::Answered { outcome, ack, dead_letter: None }),
            Ok(Err(e)) => return Err(e),
            Err(end) => (super::keep::abandoned(&end).unwrap_or(Decision::Release(None)), None),
        };
        Ok(End::Decided { lease, decision, charge })
    }

    /// Runs the parts not recorded yet: the first where the delivery was admitted, each
    /// other as soon as admission gives it a place at once (`More::try_take`: never
    /// ahead of a waiting message, within the tenant's fair share, the window and the
    /// key's budgets), more whenever a part ends. Each part answered is recorded at once
    /// (fenced). A part to be retried or ended stops new parts; the parts in flight
    /// finish and are recorded first, so a 429 or a schema retry redoes only its part.
    /// The other parts' reservations go on `job.part_metering`, for the caller to give
    /// back should this be abandoned before they call.
    async fn run_parts(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        parts: &[Part],
        mut progress: Parts,
    ) -> Result<Ran, StoreError> {
        let mut pending: VecDeque<u32> =
            (0..progress.total).filter(|i| !progress.done.iter().any(|d| d.index == *i)).collect();
        let mut flight = FuturesUnordered::new();
        if let Some(index) = pending.pop_front() {
            let place = job.place.lock().expect("place lock").take();
            flight.push(self.run_part(job, lease, parts, index, place, job.metering.clone()));
        }
        let mut stop: Option<(Decision, Option<Charge>)> = None;
        let mut failed: Option<StoreError> = None;
        loop {
            while stop.is_none()
                && failed.is_none()
                && let Some(&index) = pending.front()
                && let Some(more) = &job.more
            {
                let part = &parts[index as usize];
                let cost_on = |d: &crate::pool::Deployment| self.policy.part_cost(part, d.output_reserve);
                let Some((place, reserved, callee)) = more.try_take(job.deployment, cost_on).await else {
                    break;
                };
                pending.pop_front();
                if let Some(c) = &callee {
                    tracing::debug!(part = index, deployment = %c.deployment.id, "part runs on another deployment of the class");
                }
                let metering = Metering::on(reserved, callee);
                job.part_metering.lock().expect("parts lock").push(metering.clone());
                flight.push(self.run_part(job, lease, parts, index, Some(place), metering));
            }
            if flight.is_empty() {
                return match (failed, stop) {
                    (Some(e), _) => Err(e),
                    (None, Some((decision, tokens))) => Ok(Ran::Decided(decision, tokens)),
                    (None, None) if pending.is_empty() => Ok(Ran::Complete(progress)),
                    // No part may start now: back to the lane, admitted like any call.
                    (None, None) => {
                        tracing::debug!(left = pending.len(), "no place for the next part; handed back");
                        Ok(Ran::Decided(Decision::Release(None), None))
                    }
                };
            }
            let may_start = !pending.is_empty() && stop.is_none() && failed.is_none();
            let (index, decided, tokens) = tokio::select! {
                Some(answered) = flight.next() => answered,
                _ = tokio::time::sleep(PLACE_RECHECK), if may_start => continue,
            };
            match decided {
                Err(e) => {
                    tracing::warn!(part = index, kind = e.kind(), "a part's store read failed; no new parts");
                    failed.get_or_insert(e);
                }
                Ok(done @ Decision::PartDone { .. }) => match self.record(job, lease, done, tokens).await? {
                    (Outcome::PartDone { parts }, _) => progress = parts,
                    (other, ack) => return Ok(Ran::Ended(other, ack)),
                },
                Ok(decision) => {
                    tracing::info!(
                        part = index,
                        in_flight = flight.len(),
                        "a part stops the others; those in flight finish"
                    );
                    stop = Some(match stop.take() {
                        None => (decision, tokens),
                        Some((first, spent)) => (graver(first, decision), sum(spent, tokens)),
                    });
                }
            }
        }
    }

    /// One part, with its place held until it is decided: recorded from a result kept
    /// before (a holder died before recording it: no call), or called, validated and
    /// kept. Its index, what it comes to, and the tokens its call used.
    async fn run_part(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        parts: &[Part],
        index: u32,
        place: Option<crate::schedule::Place>,
        metering: std::sync::Arc<Metering>,
    ) -> (u32, Result<Decision, StoreError>, Option<Charge>) {
        let decided = self.answer_part(job, lease, &parts[index as usize], index, &metering).await;
        drop(place);
        self.release_unused(job, &metering).await;
        (index, decided, job.charge_of(&metering))
    }

    async fn answer_part(
        &self,
        job: &Job<'_>,
        lease: &Lease,
        part: &Part,
        index: u32,
        metering: &Metering,
    ) -> Result<Decision, StoreError> {
        if let Some((kept, seq)) = self.stores.results.read_part(&job.review.tenant, job.id(), index).await? {
            tracing::info!(part = index, "part result kept before; recorded without a call");
            let (findings, quarantined) = (kept.findings.len(), kept.quarantined.len());
            return Ok(Decision::PartDone { index, seq, findings, quarantined });
        }
        let Ok(part_diff) = diff::parse(&part.text) else {
            tracing::error!(part = index, "a part does not parse");
            return Ok(Decision::Terminal { reason: TerminalReason::InvalidInput, status: None });
        };
        let target = Target { diff: &part_diff, text: Cow::Borrowed(&part.text), part: Some(index) };
        let answer = self.attempt(job, lease, &target, metering).await;
        Ok(self.decide(job, lease, &target, metering, answer).await)
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
                Decision::PartDone { index, seq, findings: v.findings.len(), quarantined: v.quarantined.len() }
            }
            Err(unkept) => unkept,
        }
    }

    /// Reads every part's result back, merges them and keeps the job's one result.
    async fn merge_parts(&self, job: &Job<'_>, lease: &Lease, progress: &Parts) -> Decision {
        let mut results = Vec::with_capacity(progress.done.len());
        for done in &progress.done {
            let read = || self.stores.results.read_part_at(done.seq);
            let retried = |e: &StoreError, attempt, delay| self.store_retried(job, "read part", e, attempt, delay);
            match self.policy.store_retry.run(read, retried).await {
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
}
