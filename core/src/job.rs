//! The job record (metadata only, never content) and its state machine.
//!
//! `transition` is pure: the store reads a record with its KV revision, applies an
//! event here, and writes the result with a compare-and-set on that revision. A
//! conflict means someone else moved the job; the caller re-reads and decides again.

use serde::{Deserialize, Serialize};

use crate::region::{Lane, Region};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Accepted,
    Waiting,
    Running,
    RetryScheduled,
    Validated,
    Published,
    Terminal,
}

impl JobState {
    pub fn is_final(self) -> bool {
        matches!(self, JobState::Published | JobState::Terminal)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Accepted => "accepted",
            JobState::Waiting => "waiting",
            JobState::Running => "running",
            JobState::RetryScheduled => "retry_scheduled",
            JobState::Validated => "validated",
            JobState::Published => "published",
            JobState::Terminal => "terminal",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalReason {
    RateLimitBudgetExhausted,
    TransientBudgetExhausted,
    InvalidOutput,
    UpstreamRejected,
    Cancelled,
    DeadlineExceeded,
    /// The provider account is out of quota (429 `insufficient_quota`): money, not load.
    InsufficientQuota,
    /// The message on the lane could not be read back (should never happen: the ingress
    /// validated it).
    InvalidInput,
    /// The tenant's sink refused the delivery permanently (4xx other than 408/429).
    DeliveryRejected,
    /// The tenant's sink kept failing transiently until the delivery budget ran out.
    DeliveryBudgetExhausted,
    /// A paid answer could not be kept: the region's store kept failing until the store
    /// budget ran out, or refused the write for good.
    StoreBudgetExhausted,
    /// The reconciler found the job with no message, no live lease and no kept result.
    Lost,
    /// The review needs more parts than the extractor's limit (`REVIEWLANE_MAX_PARTS`).
    TooLarge,
    /// A sweep item's provider batch kept being refused for the model's enqueued-token
    /// limit (`token_limit_exceeded`), even alone, for longer than the coordinator waits.
    BatchTokenLimit,
    /// The provider's content filter refused the prompt or cut the answer (Azure
    /// OpenAI's `content_filter`): sending it again gets the same refusal.
    ContentFiltered,
}

impl TerminalReason {
    pub const ALL: [TerminalReason; 15] = [
        TerminalReason::RateLimitBudgetExhausted,
        TerminalReason::TransientBudgetExhausted,
        TerminalReason::InvalidOutput,
        TerminalReason::UpstreamRejected,
        TerminalReason::Cancelled,
        TerminalReason::DeadlineExceeded,
        TerminalReason::InsufficientQuota,
        TerminalReason::InvalidInput,
        TerminalReason::DeliveryRejected,
        TerminalReason::DeliveryBudgetExhausted,
        TerminalReason::StoreBudgetExhausted,
        TerminalReason::Lost,
        TerminalReason::TooLarge,
        TerminalReason::BatchTokenLimit,
        TerminalReason::ContentFiltered,
    ];

    /// The reason named `s` (as `as_str` writes it).
    pub fn parse(s: &str) -> Option<TerminalReason> {
        TerminalReason::ALL.into_iter().find(|r| r.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TerminalReason::RateLimitBudgetExhausted => "rate_limit_budget_exhausted",
            TerminalReason::TransientBudgetExhausted => "transient_budget_exhausted",
            TerminalReason::InvalidOutput => "invalid_output",
            TerminalReason::UpstreamRejected => "upstream_rejected",
            TerminalReason::Cancelled => "cancelled",
            TerminalReason::DeadlineExceeded => "deadline_exceeded",
            TerminalReason::InsufficientQuota => "insufficient_quota",
            TerminalReason::InvalidInput => "invalid_input",
            TerminalReason::DeliveryRejected => "delivery_rejected",
            TerminalReason::DeliveryBudgetExhausted => "delivery_budget_exhausted",
            TerminalReason::StoreBudgetExhausted => "store_budget_exhausted",
            TerminalReason::Lost => "lost",
            TerminalReason::TooLarge => "too_large",
            TerminalReason::BatchTokenLimit => "batch_token_limit",
            TerminalReason::ContentFiltered => "content_filtered",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReviewDepth {
    #[default]
    Full,
    ChangedHunks,
}

impl ReviewDepth {
    pub fn as_str(self) -> &'static str {
        match self {
            ReviewDepth::Full => "full",
            ReviewDepth::ChangedHunks => "changed_hunks",
        }
    }
}

/// Which retry budget an attempt spends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    Congestion,
    Transient,
    Schema,
}

impl Budget {
    pub fn as_str(self) -> &'static str {
        match self {
            Budget::Congestion => "congestion",
            Budget::Transient => "transient",
            Budget::Schema => "schema",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Attempts {
    pub congestion: u32,
    pub transient: u32,
    pub schema: u32,
    /// Leases taken (provider calls started or about to start). Also the generation of
    /// the newest lease: every write of a running job names it, so a holder whose lease
    /// was taken over cannot overwrite the record (fencing).
    pub leases: u32,
}

impl Attempts {
    pub fn get(&self, b: Budget) -> u32 {
        match b {
            Budget::Congestion => self.congestion,
            Budget::Transient => self.transient,
            Budget::Schema => self.schema,
        }
    }

    fn bump(&mut self, b: Budget) {
        match b {
            Budget::Congestion => self.congestion += 1,
            Budget::Transient => self.transient += 1,
            Budget::Schema => self.schema += 1,
        }
    }
}

/// Who holds a job. Stored as one string, as it always was: a provider batch's id
/// starts with `batch-` (`batch::chunk_id`), the lanes are `lanes`, anything else is a
/// replica.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum Owner {
    /// A replica's lease (its id).
    Replica(String),
    /// A provider batch (its chunk id): the item counts as submitted to the provider.
    ProviderBatch(String),
    /// An item of a provider-batch sweep handed to the batch lane, until a lane worker
    /// leases it (`Event::ToLanes`).
    Lanes,
}

/// How a provider batch's id starts.
pub const PROVIDER_BATCH_PREFIX: &str = "batch-";
const LANES: &str = "lanes";

impl From<String> for Owner {
    fn from(s: String) -> Owner {
        match s.as_str() {
            LANES => Owner::Lanes,
            _ if s.starts_with(PROVIDER_BATCH_PREFIX) => Owner::ProviderBatch(s),
            _ => Owner::Replica(s),
        }
    }
}

impl From<&str> for Owner {
    fn from(s: &str) -> Owner {
        Owner::from(s.to_string())
    }
}

impl From<Owner> for String {
    fn from(o: Owner) -> String {
        match o {
            Owner::Replica(s) | Owner::ProviderBatch(s) => s,
            Owner::Lanes => LANES.to_string(),
        }
    }
}

impl Owner {
    pub fn is_provider_batch(&self) -> bool {
        matches!(self, Owner::ProviderBatch(_))
    }
}

/// One job, as stored in KV `JOBS_<R>` under its job id. Metadata only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: String,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    pub state: JobState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<TerminalReason>,
    #[serde(default)]
    pub attempts: Attempts,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_eligible_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_expires_at_ms: Option<u64>,
    /// Who holds (or last held) the job: a replica's lease, a provider batch, or the
    /// lanes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
    /// Why the last output was invalid (`not_json`, `shape`, `all_findings_invalid`):
    /// the schema budget's summary, without content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_invalid_output: Option<String>,
    /// When a publisher first claimed the delivery: from then on a cancel no longer
    /// applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery_started_at_ms: Option<u64>,
    /// The delivery claim: who delivers, until when, and the deliveries tried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<DeliveryClaim>,
    /// Status class of the last upstream answer: `2xx`, `4xx`, `429`, `5xx`, `timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_upstream_status: Option<String>,
    pub schema_version: String,
    /// sha256 of the diff: for caching and support, not reversible to content.
    pub input_digest: String,
    /// sha256 over everything the request asked for; tells a retry from a reuse.
    pub request_digest: String,
    pub review_depth: ReviewDepth,
    #[serde(default)]
    pub findings_count: u32,
    #[serde(default)]
    pub quarantined_count: u32,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// When the job is useless to its caller: not published by then, it ends
    /// `deadline_exceeded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// Tokens of every paid call of the job, from the provider's usage fields.
    #[serde(default)]
    pub tokens: Tokens,
    /// Estimated cost of those calls in millionths of a US dollar, from the configured
    /// price of the model (0 when no price is configured).
    #[serde(default)]
    pub cost_micro_usd: u64,
    /// A review larger than the model's context is split into parts (see `parts`): the
    /// plan and the parts done. `None` for a review of one part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts: Option<Parts>,
    /// Findings over the configured cap, left out of the result.
    #[serde(default)]
    pub findings_dropped: u32,
    /// The dead-lettered job this one replays (`ReplayDeadLetter`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_of: Option<String>,
    /// The sweep this job is an item of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep_id: Option<String>,
    /// The review admitted at depth `changed_hunks` that this full-depth one deepens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deeper_of: Option<String>,
    /// The full-depth review that follows this degraded one (tenant option `deeper_pass`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deeper_review: Option<String>,
    /// The deployment and model class that answered the job's last paid call (none
    /// before one is paid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_by: Option<ServedBy>,
}

/// Which deployment of the region's pool answered a call, and its model class: both
/// configured names, never content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedBy {
    pub deployment: String,
    pub model_class: String,
}

/// One paid call as charged to its job: the tokens the provider counted, their
/// estimated cost at the deployment's price, and who answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    pub tokens: Tokens,
    pub cost_micro_usd: u64,
    pub served_by: ServedBy,
}

/// A publisher's claim on a job's delivery: one holder at a time until it expires (a
/// publisher that dies after claiming is taken over then), and the deliveries tried,
/// which the delivery budget counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryClaim {
    /// The publisher replica that holds (or last held) it.
    pub owner: String,
    /// Until when it holds; from then on another publisher may take over.
    pub expires_at_ms: u64,
    /// Deliveries tried so far, the holder's included.
    pub attempts: u32,
}

/// How a review was split and which parts are done: the checkpoint that lets a crash, a
/// 429 or a schema retry redo only the parts not done, and no part be paid twice.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parts {
    pub total: u32,
    /// What the review was split with: every later holder splits it alike.
    pub plan: crate::parts::Plan,
    /// Done parts, by index.
    #[serde(default)]
    pub done: Vec<PartDone>,
}

impl Parts {
    /// The first part not done yet.
    pub fn next(&self) -> Option<u32> {
        (0..self.total).find(|i| !self.done.iter().any(|d| d.index == *i))
    }

    pub fn complete(&self) -> bool {
        self.next().is_none()
    }
}

/// A part whose answer is validated and kept (on `PARTS_<R>` at `seq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartDone {
    pub index: u32,
    /// Stream sequence of the kept part result: the findings reference.
    pub seq: u64,
    pub findings: u32,
    pub quarantined: u32,
    /// Tokens of the call that answered this part (zero when it was resumed from a
    /// result kept before a crash).
    #[serde(default)]
    pub tokens: Tokens,
}

/// Input and output tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
}

impl JobRecord {
    /// Whether a provider batch holds it.
    pub fn in_provider_batch(&self) -> bool {
        self.owner.as_ref().is_some_and(Owner::is_provider_batch)
    }

    /// Whether `owner` holds it (or last held it).
    pub fn owned_by(&self, owner: &Owner) -> bool {
        self.owner.as_ref() == Some(owner)
    }

    /// Adds one call's tokens and their estimated cost, and names who answered it.
    pub fn charge(&mut self, charge: &Charge) {
        self.tokens.input = self.tokens.input.saturating_add(charge.tokens.input);
        self.tokens.output = self.tokens.output.saturating_add(charge.tokens.output);
        self.cost_micro_usd = self.cost_micro_usd.saturating_add(charge.cost_micro_usd);
        self.served_by = Some(charge.served_by.clone());
    }
}

/// What happened to a job. Events of a running job name the lease generation they
/// come from (`generation`); the state machine refuses them once another lease exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A worker took the message; its lease (generation = leases + 1) ends at the given
    /// time unless extended.
    Leased { owner: Owner, lease_expires_at_ms: u64 },
    /// The holder is alive: its lease ends later.
    Extended { generation: u32, lease_expires_at_ms: u64 },
    /// The attempt failed in a retryable way; the message was handed back with a delay.
    RetryScheduled {
        generation: u32,
        budget: Budget,
        next_eligible_at_ms: u64,
        upstream_status: Option<String>,
        /// Why the output was invalid (schema budget): a class, never content.
        invalid_output: Option<String>,
    },
    /// The review is split into parts (once; the plan every later holder follows).
    Planned { generation: u32, total: u32, plan: crate::parts::Plan },
    /// One part's answer is validated and kept (the holder goes on with the others).
    PartDone { generation: u32, part: PartDone },
    /// The output passed validation (for a split review: every part's, merged) and the
    /// findings of this generation are kept on `FINDINGS_<R>`; `dropped` findings were
    /// over the cap.
    Validated { generation: u32, findings: u32, quarantined: u32, dropped: u32 },
    /// A publisher claims the delivery of the validated result until `expires_at_ms`,
    /// counting one attempt; refused while another publisher's claim is live.
    Delivering { owner: String, expires_at_ms: u64 },
    /// The holder of delivery attempt `attempt` lets its claim go (it expires now) after
    /// a failed delivery (`counted`), or after one that sent nothing (the attempt given
    /// back). Refused once another publisher has taken the claim over.
    DeliveryReleased { owner: String, attempt: u32, counted: bool },
    /// The findings were delivered.
    Published,
    /// The caller cancels: the job ends `cancelled` unless its delivery has started
    /// (then it is delivered, and the cancel answers the state as it stands).
    Cancel,
    /// An item of a provider batch whose line did not run goes to the batch lane (its
    /// sweep's coordinator has put its review there): the chunk's lease ends, one unit of
    /// the transient budget is spent, and a lane worker may lease it at once. Owned by
    /// `Owner::Lanes` until then, so no later provider batch takes it.
    ToLanes { generation: u32 },
    /// The job ends without a result. `generation: Some(g)` when the lease holder ends
    /// it (fenced like its other writes); `None` for cancel, reconciler, publisher.
    Terminate { reason: TerminalReason, upstream_status: Option<String>, generation: Option<u32> },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("job is already final ({})", .0.as_str())]
    AlreadyFinal(JobState),
    #[error("event not allowed in state {}", .0.as_str())]
    NotAllowed(JobState),
    /// The writer's lease is not the newest: another replica took the job over.
    #[error("lease generation {writer} is stale (newest is {newest})")]
    Fenced { writer: u32, newest: u32 },
    /// Another holder's lease is still live.
    #[error("the job is leased until {until_ms}")]
    LeaseHeld { until_ms: u64 },
    /// The job waits out a retry delay.
    #[error("the job is not eligible before {at_ms}")]
    NotEligible { at_ms: u64 },
    /// Its delivery has started: too late to cancel.
    #[error("the job's delivery has started")]
    Delivering,
    /// Another publisher holds the delivery claim.
    #[error("the delivery is claimed until {until_ms}")]
    DeliveryClaimed { until_ms: u64 },
    /// The claim being released is not the record's any more (taken over).
    #[error("the delivery claim was taken over")]
    DeliveryTakenOver,
}

/// What a new job record is made of: the review as submitted (`JobRecord::waiting`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewJob {
    pub job_id: String,
    pub tenant: String,
    pub region: Region,
    pub lane: Lane,
    pub schema_version: String,
    /// Of the diff: what makes two reviews the same for the result cache.
    pub input_digest: String,
    /// Of lane, schema, diff and metadata: what makes a same-key request the same one.
    pub request_digest: String,
    pub review_depth: ReviewDepth,
    pub created_at_ms: u64,
}

impl JobRecord {
    /// The lease generation that owns the job (the newest lease taken).
    pub fn generation(&self) -> u32 {
        self.attempts.leases
    }

    /// A new record of a review whose message is already on its lane.
    pub fn waiting(new: NewJob) -> Self {
        let NewJob {
            job_id,
            tenant,
            region,
            lane,
            schema_version,
            input_digest,
            request_digest,
            review_depth,
            created_at_ms: now_ms,
        } = new;
        JobRecord {
            job_id,
            tenant,
            region,
            lane,
            state: JobState::Waiting,
            reason: None,
            attempts: Attempts::default(),
            next_eligible_at_ms: None,
            lease_expires_at_ms: None,
            owner: None,
            last_invalid_output: None,
            delivery_started_at_ms: None,
            delivery: None,
            last_upstream_status: None,
            schema_version,
            input_digest,
            request_digest,
            review_depth,
            findings_count: 0,
            quarantined_count: 0,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
            deadline_ms: None,
            tokens: Tokens::default(),
            cost_micro_usd: 0,
            parts: None,
            findings_dropped: 0,
            replay_of: None,
            sweep_id: None,
            deeper_of: None,
            deeper_review: None,
            served_by: None,
        }
    }
}

/// The state machine:
/// `waiting -> running -> (retry_scheduled -> running)* -> validated -> published`,
/// and `terminal(reason)` from any non-final state. (`accepted` is read from records
/// written before the ingress stored the message first; it behaves as `waiting`.)
///
/// Leases fence: `running -> running` (a new lease) is allowed only once the previous
/// lease has expired, and every later event of the running job must name the newest
/// generation. A holder that was paused past its lease can neither overwrite the record
/// nor have its result recorded.
pub fn transition(rec: &JobRecord, event: &Event, now_ms: u64) -> Result<JobRecord, TransitionError> {
    use JobState::*;
    // A lease holder's write of an older generation is fenced whatever has happened
    // since (even a final state): its caller learns it lost the lease.
    let writer = match event {
        Event::Extended { generation, .. }
        | Event::RetryScheduled { generation, .. }
        | Event::Validated { generation, .. }
        | Event::Planned { generation, .. }
        | Event::PartDone { generation, .. }
        | Event::ToLanes { generation }
        | Event::Terminate { generation: Some(generation), .. } => Some(*generation),
        _ => None,
    };
    if let Some(writer) = writer.filter(|w| *w != rec.generation()) {
        return Err(TransitionError::Fenced { writer, newest: rec.generation() });
    }
    if rec.state.is_final() {
        return Err(TransitionError::AlreadyFinal(rec.state));
    }
    // A lease holder writes only while its job runs.
    let running = || if rec.state != Running { Err(TransitionError::NotAllowed(rec.state)) } else { Ok(()) };
    let mut next = rec.clone();
    next.updated_at_ms = now_ms;
    match (rec.state, event) {
        (Accepted | Waiting | RetryScheduled | Running, Event::Leased { owner, lease_expires_at_ms }) => {
            if rec.state == Running
                && let Some(until_ms) = rec.lease_expires_at_ms.filter(|until| now_ms < *until)
            {
                return Err(TransitionError::LeaseHeld { until_ms });
            }
            if let Some(at_ms) = rec.next_eligible_at_ms.filter(|at| now_ms < *at) {
                return Err(TransitionError::NotEligible { at_ms });
            }
            next.state = Running;
            next.lease_expires_at_ms = Some(*lease_expires_at_ms);
            next.owner = Some(owner.clone());
            next.next_eligible_at_ms = None;
            next.attempts.leases += 1;
        }
        (_, Event::Extended { lease_expires_at_ms, .. }) => {
            running()?;
            next.lease_expires_at_ms = Some(*lease_expires_at_ms);
        }
        (_, Event::RetryScheduled { budget, next_eligible_at_ms, upstream_status, invalid_output, .. }) => {
            running()?;
            next.state = RetryScheduled;
            next.attempts.bump(*budget);
            next.next_eligible_at_ms = Some(*next_eligible_at_ms);
            next.lease_expires_at_ms = None;
            if upstream_status.is_some() {
                next.last_upstream_status = upstream_status.clone();
            }
            if invalid_output.is_some() {
                next.last_invalid_output = invalid_output.clone();
            }
        }
        (_, Event::ToLanes { .. }) => {
            running()?;
            next.state = RetryScheduled;
            next.attempts.bump(Budget::Transient);
            next.next_eligible_at_ms = Some(now_ms);
            next.lease_expires_at_ms = None;
            next.owner = Some(Owner::Lanes);
            next.last_upstream_status = Some("batch".into());
        }
        (_, Event::Planned { total, plan, .. }) => {
            running()?;
            match &rec.parts {
                None => next.parts = Some(Parts { total: *total, plan: *plan, done: Vec::new() }),
                Some(p) if p.total == *total && p.plan == *plan => {}
                Some(_) => return Err(TransitionError::NotAllowed(rec.state)),
            }
        }
        (_, Event::PartDone { part, .. }) => {
            running()?;
            let parts = next.parts.as_mut().ok_or(TransitionError::NotAllowed(rec.state))?;
            if part.index >= parts.total {
                return Err(TransitionError::NotAllowed(rec.state));
            }
            if !parts.done.iter().any(|d| d.index == part.index) {
                parts.done.push(*part);
                parts.done.sort_by_key(|d| d.index);
            }
        }
        (_, Event::Validated { findings, quarantined, dropped, .. }) => {
            running()?;
            // A split review is validated only once every part is.
            if rec.parts.as_ref().is_some_and(|p| !p.complete()) {
                return Err(TransitionError::NotAllowed(rec.state));
            }
            next.state = Validated;
            next.findings_count = *findings;
            next.quarantined_count = *quarantined;
            next.findings_dropped = *dropped;
            next.lease_expires_at_ms = None;
            next.last_upstream_status = Some("2xx".into());
        }
        (Validated, Event::Delivering { owner, expires_at_ms }) => {
            let (until_ms, attempts) = claimed(rec, expires_at_ms.saturating_sub(now_ms));
            if now_ms < until_ms {
                return Err(TransitionError::DeliveryClaimed { until_ms });
            }
            next.delivery =
                Some(DeliveryClaim { owner: owner.clone(), expires_at_ms: *expires_at_ms, attempts: attempts + 1 });
            next.delivery_started_at_ms.get_or_insert(now_ms);
        }
        (Validated, Event::DeliveryReleased { owner, attempt, counted }) => {
            let claim = next
                .delivery
                .as_mut()
                .filter(|c| c.owner == *owner && c.attempts == *attempt)
                .ok_or(TransitionError::DeliveryTakenOver)?;
            claim.expires_at_ms = now_ms;
            if !counted {
                claim.attempts = claim.attempts.saturating_sub(1);
            }
        }
        (Validated, Event::Published) => next.state = Published,
        (Validated, Event::Cancel) if rec.delivery_started_at_ms.is_some() => {
            return Err(TransitionError::Delivering);
        }
        (_, Event::Cancel) => {
            next.state = Terminal;
            next.reason = Some(TerminalReason::Cancelled);
            next.lease_expires_at_ms = None;
            next.next_eligible_at_ms = None;
        }
        (_, Event::Terminate { reason, upstream_status, generation }) => {
            if generation.is_some() {
                running()?;
            }
            next.state = Terminal;
            next.reason = Some(*reason);
            next.lease_expires_at_ms = None;
            next.next_eligible_at_ms = None;
            if upstream_status.is_some() {
                next.last_upstream_status = upstream_status.clone();
            }
        }
        (state, _) => return Err(TransitionError::NotAllowed(state)),
    }
    Ok(next)
}

/// Until when a validated record's delivery is claimed, and the deliveries tried. A
/// record marked delivering without a claim of its own was marked by a publisher that
/// kept its claims in `PUBLISHED_<R>` (earlier releases): it counts as claimed for one
/// claim period (`claim_ms`) from that write, with one delivery tried.
fn claimed(rec: &JobRecord, claim_ms: u64) -> (u64, u32) {
    match (&rec.delivery, rec.delivery_started_at_ms) {
        (Some(c), _) => (c.expires_at_ms, c.attempts),
        (None, Some(_)) => (rec.updated_at_ms.saturating_add(claim_ms), 1),
        (None, None) => (0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> JobRecord {
        JobRecord { created_at_ms: 1, updated_at_ms: 1, ..crate::testing::record("us_ab", JobState::Waiting) }
    }

    fn apply(r: &JobRecord, e: Event) -> JobRecord {
        transition(r, &e, 100).unwrap()
    }

    #[test]
    fn a_charge_adds_up_and_names_the_deployment_of_the_last_paid_call() {
        let mut r = rec();
        let by = |d: &str, c: &str| ServedBy { deployment: d.into(), model_class: c.into() };
        r.charge(&Charge { tokens: Tokens { input: 100, output: 10 }, cost_micro_usd: 7, served_by: by("a", "fast") });
        r.charge(&Charge { tokens: Tokens { input: 50, output: 5 }, cost_micro_usd: 3, served_by: by("b", "fast") });
        assert_eq!((r.tokens, r.cost_micro_usd), (Tokens { input: 150, output: 15 }, 10));
        assert_eq!(r.served_by, Some(by("b", "fast")));
        // Records written before the field read back without it, and it round-trips.
        let mut old = serde_json::to_value(rec()).unwrap();
        assert!(old.get("served_by").is_none());
        old["served_by"] = serde_json::json!({"deployment": "b", "model_class": "fast"});
        assert_eq!(serde_json::from_value::<JobRecord>(old).unwrap().served_by, Some(by("b", "fast")));
    }

    fn lease(owner: &str, until: u64) -> Event {
        Event::Leased { owner: Owner::from(owner.to_string()), lease_expires_at_ms: until }
    }

    fn retry(generation: u32, budget: Budget, at: u64) -> Event {
        Event::RetryScheduled {
            generation,
            budget,
            next_eligible_at_ms: at,
            upstream_status: Some("429".into()),
            invalid_output: None,
        }
    }

    fn cancel() -> Event {
        Event::Terminate { reason: TerminalReason::Cancelled, upstream_status: None, generation: None }
    }

    #[test]
    fn an_item_handed_from_its_provider_batch_to_the_lanes_is_leased_by_a_lane_worker_only() {
        let chunk = crate::batch::chunk_id("us_s", 1);
        let r = apply(&rec(), lease(&chunk, 1_000_000));
        let handed = apply(&r, Event::ToLanes { generation: 1 });
        assert_eq!(handed.state, JobState::RetryScheduled);
        assert_eq!(handed.owner, Some(Owner::Lanes));
        assert!(!handed.in_provider_batch(), "no later provider batch takes it");
        assert_eq!(
            (handed.attempts.transient, handed.next_eligible_at_ms, handed.lease_expires_at_ms),
            (1, Some(100), None)
        );
        // A lane worker leases it at once; the chunk's write after that is fenced.
        let leased = apply(&handed, lease("replica-1", 30_100));
        assert_eq!((leased.state, leased.generation()), (JobState::Running, 2));
        assert_eq!(
            transition(&leased, &Event::ToLanes { generation: 1 }, 200),
            Err(TransitionError::Fenced { writer: 1, newest: 2 })
        );
        // Only a running job is handed over.
        assert_eq!(
            transition(&handed, &Event::ToLanes { generation: 1 }, 200),
            Err(TransitionError::NotAllowed(JobState::RetryScheduled))
        );
    }

    #[test]
    fn happy_path() {
        let r = rec();
        assert_eq!(r.state, JobState::Waiting);
        let r = apply(&r, lease("a", 30_100));
        assert_eq!(r.state, JobState::Running);
        assert_eq!(
            (r.lease_expires_at_ms, r.owner.clone(), r.generation()),
            (Some(30_100), Some(Owner::Replica("a".into())), 1)
        );
        let r = apply(&r, Event::Validated { generation: 1, findings: 3, quarantined: 2, dropped: 0 });
        assert_eq!((r.state, r.findings_count, r.quarantined_count), (JobState::Validated, 3, 2));
        assert_eq!(r.lease_expires_at_ms, None);
        let r = apply(&r, Event::Published);
        assert_eq!(r.state, JobState::Published);
        assert_eq!(r.updated_at_ms, 100);
        assert_eq!(r.created_at_ms, 1);
    }

    #[test]
    fn retries_count_per_budget() {
        let mut r = apply(&rec(), lease("a", 5));
        for (budget, n) in [(Budget::Congestion, 2), (Budget::Transient, 1), (Budget::Schema, 1)] {
            for _ in 0..n {
                r = apply(&r, retry(r.generation(), budget, 9));
                assert_eq!(r.state, JobState::RetryScheduled);
                assert_eq!(r.next_eligible_at_ms, Some(9));
                r = apply(&r, lease("a", 500));
                assert_eq!(r.next_eligible_at_ms, None);
            }
        }
        assert_eq!((r.attempts.congestion, r.attempts.transient, r.attempts.schema), (2, 1, 1));
        assert_eq!(r.attempts.leases, 5);
    }

    #[test]
    fn a_live_lease_cannot_be_taken_over_an_expired_one_can() {
        let r = apply(&rec(), lease("a", 500));
        assert_eq!(transition(&r, &lease("b", 900), 499), Err(TransitionError::LeaseHeld { until_ms: 500 }));
        let r = transition(&r, &lease("b", 900), 500).unwrap();
        assert_eq!(
            (r.state, r.owner.clone(), r.generation()),
            (JobState::Running, Some(Owner::Replica("b".into())), 2)
        );
    }

    #[test]
    fn a_stale_holder_can_neither_record_nor_retry_nor_end_the_job() {
        let a = apply(&rec(), lease("a", 50));
        let b = apply(&a, lease("b", 500));
        let stale = Event::Validated { generation: 1, findings: 1, quarantined: 0, dropped: 0 };
        assert_eq!(transition(&b, &stale, 100), Err(TransitionError::Fenced { writer: 1, newest: 2 }));
        assert_eq!(
            transition(&b, &retry(1, Budget::Transient, 9), 100),
            Err(TransitionError::Fenced { writer: 1, newest: 2 })
        );
        let end =
            Event::Terminate { reason: TerminalReason::UpstreamRejected, upstream_status: None, generation: Some(1) };
        assert_eq!(transition(&b, &end, 100), Err(TransitionError::Fenced { writer: 1, newest: 2 }));
        let extend = Event::Extended { generation: 1, lease_expires_at_ms: 900 };
        assert_eq!(transition(&b, &extend, 100), Err(TransitionError::Fenced { writer: 1, newest: 2 }));
        // The newest holder's writes go through.
        let extended = apply(&b, Event::Extended { generation: 2, lease_expires_at_ms: 900 });
        assert_eq!(extended.lease_expires_at_ms, Some(900));
        let done = apply(&extended, Event::Validated { generation: 2, findings: 1, quarantined: 0, dropped: 0 });
        assert_eq!(done.state, JobState::Validated);
        // Once validated, nothing of a lease holder applies any more.
        assert_eq!(
            transition(&done, &Event::Validated { generation: 2, findings: 1, quarantined: 0, dropped: 0 }, 100),
            Err(TransitionError::NotAllowed(JobState::Validated))
        );
        // A stale holder is told it lost its lease even after the job is final.
        let published = apply(&done, Event::Published);
        assert_eq!(transition(&published, &stale, 100), Err(TransitionError::Fenced { writer: 1, newest: 2 }));
    }

    #[test]
    fn a_job_waiting_out_a_retry_delay_is_not_leased_early() {
        let r = apply(&apply(&rec(), lease("a", 5)), retry(1, Budget::Congestion, 1_000));
        assert_eq!(transition(&r, &lease("a", 2_000), 999), Err(TransitionError::NotEligible { at_ms: 1_000 }));
        assert_eq!(transition(&r, &lease("a", 2_000), 1_000).unwrap().state, JobState::Running);
    }

    #[test]
    fn terminal_from_every_non_final_state_and_nothing_after_final() {
        let waiting = rec();
        let running = apply(&waiting, lease("a", 5));
        let validated = apply(&running, Event::Validated { generation: 1, findings: 0, quarantined: 0, dropped: 0 });
        for r in [waiting, running.clone(), validated.clone()] {
            let t = apply(&r, cancel());
            assert_eq!((t.state, t.reason), (JobState::Terminal, Some(TerminalReason::Cancelled)));
            for e in [Event::Published, lease("a", 1)] {
                assert_eq!(transition(&t, &e, 1), Err(TransitionError::AlreadyFinal(JobState::Terminal)));
            }
        }
        let published = apply(&validated, Event::Published);
        assert_eq!(transition(&published, &cancel(), 1), Err(TransitionError::AlreadyFinal(JobState::Published)));
    }

    fn claim(owner: &str, expires_at_ms: u64) -> Event {
        Event::Delivering { owner: owner.into(), expires_at_ms }
    }

    fn release(owner: &str, attempt: u32, counted: bool) -> Event {
        Event::DeliveryReleased { owner: owner.into(), attempt, counted }
    }

    fn validated() -> JobRecord {
        apply(
            &apply(&rec(), lease("x", 5)),
            Event::Validated { generation: 1, findings: 1, quarantined: 0, dropped: 0 },
        )
    }

    #[test]
    fn one_publisher_holds_a_delivery_until_its_claim_expires_and_attempts_are_counted() {
        let a = transition(&validated(), &claim("a", 1_100), 100).unwrap();
        let held = a.delivery.clone().unwrap();
        assert_eq!((held.owner.as_str(), held.expires_at_ms, held.attempts), ("a", 1_100, 1));
        // Another publisher (or another copy of the message) waits while it is live.
        assert_eq!(transition(&a, &claim("b", 1_600), 600), Err(TransitionError::DeliveryClaimed { until_ms: 1_100 }));
        // Past it, the claim is taken over, the attempt counted.
        let b = transition(&a, &claim("b", 2_100), 1_100).unwrap();
        assert_eq!(b.delivery.as_ref().map(|c| (c.owner.as_str(), c.attempts)), Some(("b", 2)));
        // The overrun holder cannot release what is no longer its claim.
        assert_eq!(transition(&b, &release("a", 1, true), 1_200), Err(TransitionError::DeliveryTakenOver));
        // A failed delivery lets the claim go at once, counted; a deferred one gives the
        // attempt back.
        let failed = transition(&b, &release("b", 2, true), 1_200).unwrap();
        assert_eq!(failed.delivery.as_ref().map(|c| (c.expires_at_ms, c.attempts)), Some((1_200, 2)));
        let c = transition(&failed, &claim("c", 2_200), 1_200).unwrap();
        assert_eq!(c.delivery.as_ref().map(|c| c.attempts), Some(3));
        let deferred = transition(&c, &release("c", 3, false), 1_300).unwrap();
        assert_eq!(deferred.delivery.as_ref().map(|c| (c.expires_at_ms, c.attempts)), Some((1_300, 2)));
        // A published job is claimed no more.
        let published = transition(&c, &Event::Published, 1_400).unwrap();
        assert_eq!(
            transition(&published, &claim("d", 9_000), 5_000),
            Err(TransitionError::AlreadyFinal(JobState::Published))
        );
    }

    #[test]
    fn a_record_marked_delivering_by_an_earlier_release_counts_as_claimed_for_one_period() {
        // Earlier publishers kept the claim in `PUBLISHED_<R>` and marked the record only.
        let legacy = JobRecord { delivery_started_at_ms: Some(1_000), updated_at_ms: 1_000, ..validated() };
        assert_eq!(
            transition(&legacy, &claim("new", 1_500 + 30_000), 1_500),
            Err(TransitionError::DeliveryClaimed { until_ms: 31_000 })
        );
        let taken = transition(&legacy, &claim("new", 31_000 + 30_000), 31_000).unwrap();
        assert_eq!(taken.delivery.as_ref().map(|c| (c.owner.as_str(), c.attempts)), Some(("new", 2)));
        assert_eq!(taken.delivery_started_at_ms, Some(1_000));
    }

    #[test]
    fn a_cancel_ends_the_job_until_its_delivery_has_started() {
        let validated = apply(
            &apply(&rec(), lease("a", 5)),
            Event::Validated { generation: 1, findings: 1, quarantined: 0, dropped: 0 },
        );
        let cancelled = apply(&validated, Event::Cancel);
        assert_eq!((cancelled.state, cancelled.reason), (JobState::Terminal, Some(TerminalReason::Cancelled)));
        let delivering = apply(&validated, claim("a", 150));
        assert_eq!((delivering.state, delivering.delivery_started_at_ms), (JobState::Validated, Some(100)));
        assert_eq!(transition(&delivering, &Event::Cancel, 200), Err(TransitionError::Delivering));
        // A second claim (a take-over) keeps the first start time.
        assert_eq!(transition(&delivering, &claim("b", 400), 300).unwrap().delivery_started_at_ms, Some(100));
        // The publisher's own failure still ends it.
        let failed =
            Event::Terminate { reason: TerminalReason::DeliveryRejected, upstream_status: None, generation: None };
        assert_eq!(apply(&delivering, failed).state, JobState::Terminal);
        assert_eq!(apply(&delivering, Event::Published).state, JobState::Published);
        // Before validation a cancel always applies.
        assert_eq!(apply(&rec(), Event::Cancel).state, JobState::Terminal);
    }

    #[test]
    fn a_split_review_is_validated_only_once_every_part_is_done() {
        let plan = crate::parts::Plan {
            limits: crate::parts::PartLimits::default(),
            tokenizer: crate::parts::Tokenizer::Estimate { milli_bytes_per_token: 3500 },
        };
        let r = apply(&rec(), lease("a", 500));
        let r = apply(&r, Event::Planned { generation: 1, total: 2, plan });
        assert_eq!(r.parts.as_ref().map(|p| (p.total, p.next())), Some((2, Some(0))));
        let part = |index, seq| PartDone { index, seq, findings: 1, quarantined: 0, tokens: Tokens::default() };
        let validated = Event::Validated { generation: 1, findings: 2, quarantined: 0, dropped: 0 };
        assert_eq!(transition(&r, &validated, 100), Err(TransitionError::NotAllowed(JobState::Running)));
        // A part recorded keeps the lease: its holder goes on with the others.
        let r = apply(&r, Event::PartDone { generation: 1, part: part(0, 7) });
        assert_eq!((r.state, r.lease_expires_at_ms), (JobState::Running, Some(500)));
        assert!(matches!(transition(&r, &lease("b", 900), 100), Err(TransitionError::LeaseHeld { until_ms: 500 })));
        let r = transition(&r, &lease("b", 900), 500).unwrap();
        // A repeat of a done part changes nothing; a part beyond the plan is refused.
        let again = apply(&r, Event::PartDone { generation: 2, part: part(0, 9) });
        assert_eq!(again.parts.as_ref().unwrap().done, vec![part(0, 7)]);
        let beyond = Event::PartDone { generation: 2, part: part(2, 9) };
        assert!(matches!(transition(&r, &beyond, 100), Err(TransitionError::NotAllowed(_))));
        // A stale holder's part is fenced like any of its writes.
        let stale = Event::PartDone { generation: 1, part: part(1, 8) };
        assert_eq!(transition(&r, &stale, 100), Err(TransitionError::Fenced { writer: 1, newest: 2 }));
        // Another plan for the same job is refused; the same one is a no-op.
        let other = Event::Planned { generation: 2, total: 3, plan };
        assert!(matches!(transition(&r, &other, 100), Err(TransitionError::NotAllowed(_))));
        let r = apply(&r, Event::Planned { generation: 2, total: 2, plan });
        let r = apply(&r, Event::PartDone { generation: 2, part: part(1, 8) });
        assert!(r.parts.as_ref().unwrap().complete());
        let done = apply(&r, Event::Validated { generation: 2, findings: 2, quarantined: 0, dropped: 3 });
        assert_eq!((done.state, done.findings_dropped), (JobState::Validated, 3));
    }

    #[test]
    fn out_of_order_events_are_refused() {
        let r = rec();
        assert!(matches!(transition(&r, &Event::Published, 1), Err(TransitionError::NotAllowed(_))));
        assert!(matches!(
            transition(&r, &Event::Validated { generation: 0, findings: 1, quarantined: 0, dropped: 0 }, 1),
            Err(TransitionError::NotAllowed(_))
        ));
        let running = apply(&r, lease("a", 5));
        assert!(matches!(transition(&running, &Event::Published, 1), Err(TransitionError::NotAllowed(_))));
    }

    #[test]
    fn record_serializes_without_content_fields() {
        let json = serde_json::to_value(rec()).unwrap();
        let keys: Vec<_> = json.as_object().unwrap().keys().cloned().collect();
        for k in &keys {
            assert!(!["diff", "repository", "path", "findings", "evidence"].contains(&k.as_str()), "{k}");
        }
    }
}
