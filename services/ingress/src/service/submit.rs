//! `SubmitReview`: validate, admit, and make the job durable — lane message, record
//! and index entry written at once — or end it at once when it is already too late.

use super::*;

impl ReviewApi {
    /// Runs inside the RPC span (see `rpc::span_for`), which it fills in.
    pub(super) async fn submit(&self, tenant: &Tenant, req: SubmitReviewRequest) -> Result<proto::Review, ApiError> {
        let limits = Limits {
            max_diff_bytes: tenant.max_diff_bytes.unwrap_or(self.max_diff_bytes),
            deadlines: [self.policies[0].deadline, self.policies[1].deadline],
        };
        let mut p = check(req, &limits, self.clock.now_ms())?;
        let idempotency_key = p.idempotency_key.take().unwrap_or_else(|| hex::encode(rand::random::<[u8; 16]>()));
        let handle = self.region(tenant.region)?;
        let id = job_id::derive(tenant.region, &tenant.id, &idempotency_key);
        let span = tracing::Span::current();
        span.record("job_id", id.as_str())
            .record("lane", p.lane.as_str())
            .record("schema_version", p.schema_version.as_str());
        // Admission on predicted queue age; a retry of a job we hold is answered anyway.
        let (decision, predicted_wait) = self.admission(tenant, p.lane);
        let depth = match decision {
            Decision::Accept => ReviewDepth::Full,
            Decision::Degrade => ReviewDepth::ChangedHunks,
            Decision::Refuse { retry_after } => return self.refused(handle, &id, &p.request_digest, retry_after).await,
        };
        span.record("review_depth", depth.as_str());
        let wait_ms = predicted_wait.map_or(0, |w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX));
        let late = p.submitted_at_ms.saturating_add(wait_ms) >= p.deadline_ms;
        let msg = review_message(tenant, id, p, depth);
        if late {
            // It ends here: no deeper pass follows it.
            return self.too_late(handle, &ReviewMessage { deeper_review: None, ..msg }).await;
        }
        let rec = match self.write_job(handle, &msg).await? {
            Created::New(rec, _) => rec,
            // A retry of a request we hold, or a worker that created the record from the
            // message first: the job as it stands, with its findings once it has them.
            Created::Exists(existing) if existing.request_digest == msg.request_digest => {
                tracing::debug!(state = existing.state.as_str(), "idempotent retry");
                if existing.deeper_review.is_some() {
                    self.deeper_pass(tenant, handle, &msg).await?;
                }
                return self.view(handle, &existing).await;
            }
            Created::Exists(_) => return Err(ApiError::AlreadyExists),
        };
        // Queued once the degraded review is durable; a failure here fails the submit,
        // and the caller's same-key retry queues it then.
        if rec.deeper_review.is_some() {
            self.deeper_pass(tenant, handle, &msg).await?;
        }
        tracing::info!(state = rec.state.as_str(), "review accepted");
        Ok(api::review(&rec, &[]))
    }

    /// A submit refused by admission: a retry of a job we hold is answered with it, any
    /// other refused with the delay to come back after.
    async fn refused(
        &self,
        handle: &RegionHandle,
        id: &str,
        request_digest: &str,
        retry_after: Duration,
    ) -> Result<proto::Review, ApiError> {
        match handle.jobs.get(id).await? {
            Some((existing, _)) if existing.request_digest == request_digest => self.view(handle, &existing).await,
            _ => {
                tracing::info!(retry_after_ms = retry_after.as_millis() as u64, "refused: lane over its window");
                Err(ApiError::ResourceExhausted {
                    reason: Reason::LaneOverWindow,
                    what: "the tenant's share of the lane is over its service window",
                    retry_after,
                })
            }
        }
    }

    /// Makes a job durable: its lane message, its record and its index entry, written
    /// at once (one round trip of waiting, not three). The answer waits for all three.
    ///
    /// Crash semantics (docs/round-trips.md, "Submit: three writes at once"):
    /// - the lane message without the record (the record write failed, or the ingress
    ///   died first): the extractor creates the record from the message, which carries
    ///   all of it;
    /// - the record without the lane message: when the lane refused (full, or NATS
    ///   failed), the record this request created is removed again, so the refusal
    ///   leaves nothing behind; if the ingress died before that, the record is stranded
    ///   and the reconciler ends it `lost` after its grace — unless the caller retries
    ///   first, which writes the message again and carries on with the same record;
    /// - the index entry without the record: listing skips it; a retry adds it again
    ///   (listing drops repeats).
    ///
    /// A same-key retry always writes the lane message again: the lane drops the copy by
    /// `Nats-Msg-Id` (= job id), and a later copy finds the job's state and is dropped.
    pub(super) async fn write_job(&self, handle: &RegionHandle, msg: &ReviewMessage) -> Result<Created, ApiError> {
        let payload = encode(handle, msg)?;
        let record = msg.record();
        let index = index(handle);
        let lane = async {
            self.faults.check(point::INGRESS_LANE)?;
            enqueue(handle, msg, payload).await
        };
        let create = async {
            self.faults.check(point::INGRESS_RECORD)?;
            handle.jobs.create(&record).await
        };
        let (enqueued, created, indexed) = tokio::join!(lane, create, index.add(&record, &msg.metadata.repository));
        if let Err(refused) = enqueued {
            if let Ok(Created::New(_, revision)) = created {
                self.undo_record(handle, &record.job_id, revision).await;
            }
            return Err(refused);
        }
        let created = created?;
        indexed?;
        Ok(created)
    }

    /// Removes a record this request created, unless anything wrote to it since.
    pub(super) async fn undo_record(&self, handle: &RegionHandle, job_id: &str, revision: u64) {
        let undone = match self.faults.check(point::INGRESS_UNDO_RECORD) {
            Ok(()) => handle.jobs.kv().delete_expect_revision(job_id, Some(revision)).await.map_err(StoreError::other),
            Err(e) => Err(e),
        };
        if let Err(e) = undone {
            tracing::warn!(
                kind = e.kind(),
                "removing the record of a refused submit failed (or something wrote to it since); a same-key retry carries it on, and the reconciler ends it if nothing drives it"
            );
        }
    }

    /// A review that cannot be served before its deadline (it is past, or the lane's
    /// predicted wait passes it) ends `deadline_exceeded` at once: its record says so,
    /// and nothing of its content is kept or sent anywhere.
    pub(super) async fn too_late(&self, handle: &RegionHandle, msg: &ReviewMessage) -> Result<proto::Review, ApiError> {
        let rec = match handle.jobs.create(&msg.record()).await? {
            Created::New(rec, _) => rec,
            Created::Exists(existing) if existing.request_digest == msg.request_digest => {
                return self.view(handle, &existing).await;
            }
            Created::Exists(_) => return Err(ApiError::AlreadyExists),
        };
        index(handle).add(&rec, &msg.metadata.repository).await?;
        let ended = Event::Terminate {
            reason: reviewlane_core::job::TerminalReason::DeadlineExceeded,
            upstream_status: None,
            generation: None,
        };
        let rec = match handle.jobs.apply(&rec.job_id, &ended).await {
            Ok(r) => {
                self.metrics.terminal.inc(r.region, r.lane, reviewlane_core::job::TerminalReason::DeadlineExceeded);
                tracing::info!("deadline before the predicted wait ends: ended at admission");
                r
            }
            Err(StoreError::Transition(_, current)) => *current,
            Err(e) => return Err(e.into()),
        };
        Ok(api::review(&rec, &[]))
    }
}

const MAX_IDEMPOTENCY_KEY: usize = 256;
const MAX_METADATA_FIELD: usize = 1024;
/// How long a client is told to wait when a lane is full.
const LANE_FULL_RETRY: Duration = Duration::from_secs(5);

/// What a tenant may send: its diff limit and each lane's default deadline.
pub(super) struct Limits {
    pub max_diff_bytes: usize,
    /// Interactive, batch.
    pub deadlines: [Duration; 2],
}

/// A submit as checked: every field valid, and what follows from them.
pub(super) struct CheckedSubmit {
    pub lane: reviewlane_shared::Lane,
    pub schema_version: String,
    /// Without terminal colours; parsed once here.
    pub diff: SubmittedDiff,
    pub submitted_at_ms: u64,
    pub deadline_ms: u64,
    /// `None`: the caller sent none (a random one is drawn).
    pub idempotency_key: Option<String>,
    pub metadata: ReviewMetadata,
    /// Of lane, schema, diff and metadata: what makes a same-key request the same one.
    pub request_digest: String,
}

/// The lane message of a submit checked as `p`, reviewed at `depth`, as job `id`.
fn review_message(tenant: &Tenant, id: String, p: CheckedSubmit, depth: ReviewDepth) -> ReviewMessage {
    // Named before it exists: a retry of this submit finds the same one.
    let deeper_review = (depth == ReviewDepth::ChangedHunks && tenant.deeper_pass)
        .then(|| reviewlane_core::sweep::DeeperIds::of(tenant.region, &tenant.id, &id).job_id);
    ReviewMessage {
        job_id: id,
        tenant: tenant.id.clone(),
        region: tenant.region,
        lane: p.lane,
        schema_version: p.schema_version,
        review_depth: depth,
        metadata: p.metadata,
        input_digest: job_id::sha256_hex(&[p.diff.bytes()]),
        diff: p.diff.utf8,
        diff_bytes: p.diff.raw,
        submitted_at_ms: p.submitted_at_ms,
        request_digest: p.request_digest,
        deadline_ms: Some(p.deadline_ms),
        replay_of: None,
        sweep_id: None,
        deeper_of: None,
        deeper_review,
    }
}

/// The pure check of a submit: each `INVALID_ARGUMENT` a caller can meet, from the
/// request, the tenant's limits and the time alone.
pub(super) fn check(mut req: SubmitReviewRequest, limits: &Limits, now_ms: u64) -> Result<CheckedSubmit, ApiError> {
    let lane = api::lane_from_proto(req.lane).ok_or_else(|| ApiError::invalid("lane", "unknown lane"))?;
    let schema_version = if req.schema_version.is_empty() {
        findings::LATEST_SCHEMA.to_string()
    } else if findings::is_known_schema(&req.schema_version) {
        std::mem::take(&mut req.schema_version)
    } else {
        return Err(ApiError::invalid(
            "schema_version",
            format!("unknown findings schema version; known: {}", findings::known_schemas().join(", ")),
        ));
    };
    let diff = SubmittedDiff::from_request(&mut req, limits.max_diff_bytes)?.without_colours();
    diff::parse_bytes(diff.bytes()).map_err(|e| ApiError::invalid("diff", e.to_string()))?;
    let lane_deadline = limits.deadlines[usize::from(lane == reviewlane_shared::Lane::Batch)];
    let deadline_ms = deadline_of(&req, now_ms, lane_deadline)?;
    if req.idempotency_key.len() > MAX_IDEMPOTENCY_KEY {
        return Err(ApiError::invalid("idempotency_key", format!("longer than {MAX_IDEMPOTENCY_KEY} bytes")));
    }
    let metadata = req.metadata.unwrap_or_default();
    for (field, v) in [
        ("metadata.repository", &metadata.repository),
        ("metadata.base_revision", &metadata.base_revision),
        ("metadata.head_revision", &metadata.head_revision),
    ] {
        if v.len() > MAX_METADATA_FIELD {
            return Err(ApiError::invalid(field, format!("longer than {MAX_METADATA_FIELD} bytes")));
        }
    }
    // The pull request counts only when set, so digests of requests without one are
    // what they always were.
    let pull_request = metadata.pull_request.to_be_bytes();
    let mut digested: Vec<&[u8]> = vec![
        lane.as_str().as_bytes(),
        schema_version.as_bytes(),
        diff.bytes(),
        metadata.repository.as_bytes(),
        metadata.base_revision.as_bytes(),
        metadata.head_revision.as_bytes(),
    ];
    if metadata.pull_request != 0 {
        digested.push(&pull_request);
    }
    let request_digest = job_id::sha256_hex(&digested);
    Ok(CheckedSubmit {
        lane,
        schema_version,
        diff,
        submitted_at_ms: now_ms,
        deadline_ms,
        idempotency_key: Some(req.idempotency_key).filter(|k| !k.is_empty()),
        metadata: ReviewMetadata {
            repository: metadata.repository,
            base_revision: metadata.base_revision,
            head_revision: metadata.head_revision,
            pull_request: metadata.pull_request,
        },
        request_digest,
    })
}

#[instrument(skip_all, fields(
    otel.kind = "producer",
    job_id = %msg.job_id,
    tenant = %msg.tenant,
    region = %msg.region,
    lane = msg.lane.as_str(),
    messaging.system = "nats",
    messaging.operation.type = "publish",
    messaging.destination.name = %layout::lane_subject(msg.region, msg.lane, &msg.tenant, msg.review_depth, &msg.job_id),
))]
pub(super) async fn enqueue(handle: &RegionHandle, msg: &ReviewMessage, payload: Vec<u8>) -> Result<(), ApiError> {
    match reviewlane_shared::lanes::put(&handle.layout.js, msg, payload).await {
        Ok(()) => Ok(()),
        Err(e) if is_stream_full(&e) => Err(ApiError::ResourceExhausted {
            reason: Reason::LaneFull,
            what: "lane is full",
            retry_after: LANE_FULL_RETRY,
        }),
        // The server out of space is a full store, not a full lane.
        Err(e) => Err(StoreError::publish(e).into()),
    }
}

/// The lane message's bytes, refused before anything is written when the server would
/// not take it.
pub(super) fn encode(handle: &RegionHandle, msg: &ReviewMessage) -> Result<Vec<u8>, ApiError> {
    let payload = serde_json::to_vec(msg).map_err(|e| ApiError::Internal(e.into()))?;
    if payload.len() > handle.max_payload {
        return Err(ApiError::invalid(
            "diff",
            format!("review is {} bytes once encoded, over the server's {} bytes", payload.len(), handle.max_payload),
        ));
    }
    Ok(payload)
}

/// A lane at its maximum backlog refuses new messages (discard new).
pub(super) fn is_stream_full(e: &jetstream::context::PublishError) -> bool {
    std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>()).is_some_and(|j| {
        j.error_code() == jetstream::ErrorCode::STREAM_STORE_FAILED
            || j.error_code() == jetstream::ErrorCode::STREAM_MAX_STREAM_BYTES_EXCEEDED
    })
}

/// The deadline a submit asks for (a timestamp, or a timeout from now), else the lane's
/// default, in ms since the epoch.
pub(super) fn deadline_of(req: &SubmitReviewRequest, now_ms: u64, lane_default: Duration) -> Result<u64, ApiError> {
    match (&req.deadline, &req.timeout) {
        (Some(_), Some(_)) => Err(ApiError::invalid("deadline", "set one of `deadline` and `timeout`, not both")),
        (Some(t), None) => {
            let ms = i128::from(t.seconds) * 1000 + i128::from(t.nanos) / 1_000_000;
            u64::try_from(ms).map_err(|_| ApiError::invalid("deadline", "before 1970"))
        }
        (None, Some(d)) => {
            let d = Duration::try_from(*d).map_err(|_| ApiError::invalid("timeout", "negative or out of range"))?;
            Ok(now_ms.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
        }
        (None, None) => Ok(now_ms.saturating_add(u64::try_from(lane_default.as_millis()).unwrap_or(u64::MAX))),
    }
}

/// The diff of a submit, in whichever of the two forms the caller used.
pub(super) struct SubmittedDiff {
    /// The diff when it is UTF-8 (sent as `diff`, or as `diff_bytes` that happen to be).
    pub(super) utf8: String,
    /// The bytes of a `diff_bytes` that is not UTF-8, kept exactly as sent.
    pub(super) raw: Option<Vec<u8>>,
}

impl SubmittedDiff {
    /// Takes the diff out of the request: exactly one form, within `limit` bytes.
    pub(super) fn from_request(req: &mut SubmitReviewRequest, limit: usize) -> Result<Self, ApiError> {
        let (field, len) = match (req.diff.is_empty(), req.diff_bytes.is_empty()) {
            (false, false) => return Err(ApiError::invalid("diff", "set one of `diff` and `diff_bytes`, not both")),
            (true, false) => ("diff_bytes", req.diff_bytes.len()),
            _ => ("diff", req.diff.len()),
        };
        if len > limit {
            return Err(ApiError::invalid(field, format!("diff is {len} bytes, over the limit of {limit} bytes")));
        }
        if field == "diff" {
            return Ok(SubmittedDiff { utf8: std::mem::take(&mut req.diff), raw: None });
        }
        // Bytes that are UTF-8 are the same diff as the string form: same digests, same
        // job for the same idempotency key.
        Ok(match String::from_utf8(std::mem::take(&mut req.diff_bytes)) {
            Ok(utf8) => SubmittedDiff { utf8, raw: None },
            Err(e) => SubmittedDiff { utf8: String::new(), raw: Some(e.into_bytes()) },
        })
    }

    /// The diff without git's terminal colours (pasted from `git diff --color=always`):
    /// what is reviewed, stored and digested is the plain diff. A plain diff is kept as
    /// sent, escape codes in its lines included.
    pub(super) fn without_colours(self) -> Self {
        let Some(plain) = diff::strip_colours(self.bytes()) else { return self };
        match String::from_utf8(plain) {
            Ok(utf8) => SubmittedDiff { utf8, raw: None },
            Err(e) => SubmittedDiff { utf8: String::new(), raw: Some(e.into_bytes()) },
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        self.raw.as_deref().unwrap_or(self.utf8.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIFF: &str =
        "diff --git a/src/a.rs b/src/a.rs\n--- a/src/a.rs\n+++ b/src/a.rs\n@@ -1 +1,2 @@\n fn a() {}\n+fn b() {}\n";
    const NOW: u64 = 1_700_000_000_000;

    fn limits() -> Limits {
        Limits { max_diff_bytes: 1024, deadlines: [Duration::from_secs(900), Duration::from_secs(86_400)] }
    }

    fn req(diff: &str) -> SubmitReviewRequest {
        SubmitReviewRequest { lane: proto::Lane::Interactive as i32, diff: diff.into(), ..Default::default() }
    }

    /// The field and description of the `INVALID_ARGUMENT` a request meets.
    fn refused(r: SubmitReviewRequest) -> (&'static str, String) {
        match check(r, &limits(), NOW) {
            Err(ApiError::InvalidArgument { field, description }) => (field, description),
            Err(other) => panic!("not INVALID_ARGUMENT: {other:?}"),
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn every_invalid_argument_of_a_submit_names_its_field() {
        let cases: Vec<(SubmitReviewRequest, &str, &str)> = vec![
            (SubmitReviewRequest { lane: 42, ..req(DIFF) }, "lane", "unknown lane"),
            (SubmitReviewRequest { schema_version: "findings.v9".into(), ..req(DIFF) }, "schema_version", "known: "),
            (SubmitReviewRequest { diff_bytes: DIFF.into(), ..req(DIFF) }, "diff", "not both"),
            (req(&DIFF.repeat(20)), "diff", "over the limit of 1024 bytes"),
            (SubmitReviewRequest { diff_bytes: DIFF.repeat(20).into(), ..req("") }, "diff_bytes", "over the limit"),
            (req(""), "diff", "diff is empty"),
            (req("not a diff\n"), "diff", "no file header"),
            (req("diff --cc a.rs\n@@@ -1,1 -1,1 +1,1 @@@\n- a\n -b\n++c\n"), "diff", "combined diff of a merge"),
            (
                SubmitReviewRequest {
                    deadline: Some(prost_types::Timestamp { seconds: 2_000_000_000, nanos: 0 }),
                    timeout: Some(prost_types::Duration { seconds: 60, nanos: 0 }),
                    ..req(DIFF)
                },
                "deadline",
                "not both",
            ),
            (
                SubmitReviewRequest { timeout: Some(prost_types::Duration { seconds: -5, nanos: 0 }), ..req(DIFF) },
                "timeout",
                "negative",
            ),
            (
                SubmitReviewRequest { deadline: Some(prost_types::Timestamp { seconds: -1, nanos: 0 }), ..req(DIFF) },
                "deadline",
                "before 1970",
            ),
            (
                SubmitReviewRequest { idempotency_key: "k".repeat(257), ..req(DIFF) },
                "idempotency_key",
                "longer than 256",
            ),
            (
                SubmitReviewRequest {
                    metadata: Some(proto::ReviewMetadata { repository: "r".repeat(1025), ..Default::default() }),
                    ..req(DIFF)
                },
                "metadata.repository",
                "longer than 1024",
            ),
        ];
        for (r, want_field, want) in cases {
            let (field, description) = refused(r);
            assert_eq!(field, want_field, "{description}");
            assert!(description.contains(want), "{field}: `{description}` should say `{want}`");
        }
    }

    #[test]
    fn a_valid_submit_is_checked_with_its_defaults_and_digests() {
        let p = check(req(DIFF), &limits(), NOW).unwrap();
        assert_eq!(p.schema_version, findings::LATEST_SCHEMA);
        assert_eq!(p.deadline_ms, NOW + 900_000, "the interactive lane's default deadline");
        assert_eq!((p.idempotency_key, p.submitted_at_ms), (None, NOW));
        let batch =
            check(SubmitReviewRequest { lane: proto::Lane::Batch as i32, ..req(DIFF) }, &limits(), NOW).unwrap();
        assert_eq!(batch.deadline_ms, NOW + 86_400_000);
        // The same diff as bytes, or pasted with its colours, is the same request.
        let bytes = check(SubmitReviewRequest { diff_bytes: DIFF.into(), ..req("") }, &limits(), NOW).unwrap();
        assert_eq!(bytes.request_digest, p.request_digest);
        let coloured = DIFF.replace("+fn b", "\u{1b}[32m+fn b").replace("{}\n", "{}\u{1b}[m\n");
        let pasted = check(req(&coloured), &limits(), NOW).unwrap();
        assert_eq!((pasted.request_digest, pasted.diff.utf8.as_str()), (p.request_digest.clone(), DIFF));
        // Escape codes in the lines of a plain diff are the file's: kept as sent.
        let codes = DIFF.replace("+fn b() {}", "+\u{1b}[0m1\u{1b}[0m:\u{1b}[31mfn b\u{1b}[0m");
        assert_eq!(check(req(&codes), &limits(), NOW).unwrap().diff.utf8, codes);
        // A pull request counts in the digest; a key is kept as sent.
        let meta = proto::ReviewMetadata { pull_request: 7, ..Default::default() };
        let pr = check(
            SubmitReviewRequest { metadata: Some(meta), idempotency_key: "k1".into(), ..req(DIFF) },
            &limits(),
            NOW,
        )
        .unwrap();
        assert_ne!(pr.request_digest, p.request_digest);
        assert_eq!(pr.idempotency_key.as_deref(), Some("k1"));
    }
}
