//! Dead letters: listed, read and replayed under the job's access rules (a tenant its
//! own, an operator its region's); a replay is a new job linked to the dead one.

use super::*;

impl ReviewApi {
    /// A page of dead letters the caller may see: its own, or an operator's region's.
    pub(super) async fn list_dead(
        &self,
        caller: &Tenant,
        req: ListDeadLettersRequest,
    ) -> Result<ListDeadLettersResponse, ApiError> {
        let limit = page_size(req.page_size, 20, 100)?;
        let start = reviewlane_shared::dead_letters::from_token(&req.page_token)
            .ok_or_else(|| ApiError::invalid("page_token", "not a token this service issued"))?;
        let handle = self.region(caller.region)?;
        let tenant = (caller.role != Role::Operator).then_some(caller.id.as_str());
        let page = dead_letters(handle).page(tenant, start, limit).await?;
        Ok(ListDeadLettersResponse {
            dead_letters: page.dead_letters.iter().map(|d| api::dead_letter(d, false)).collect(),
            next_page_token: page.next.unwrap_or_default(),
        })
    }

    /// A dead letter the caller may see: of its own job, or (operator) of its region.
    pub(super) async fn dead_letter(&self, caller: &Tenant, id: &str) -> Result<(&RegionHandle, DeadLetter), ApiError> {
        tracing::Span::current().record("job_id", span_id(id));
        let region = job_id::region_of(id).map_err(|e| ApiError::invalid("job_id", e.to_string()))?;
        if region != caller.region {
            return Err(ApiError::NotFound);
        }
        let handle = self.region(region)?;
        let rec = match handle.jobs.get(id).await? {
            Some((rec, _)) if rec.tenant == caller.id || caller.role == Role::Operator => rec,
            _ => return Err(ApiError::NotFound),
        };
        let dead = dead_letters(handle).get(&rec.tenant, id).await?.ok_or(ApiError::NotFound)?;
        Ok((handle, dead))
    }

    /// Submits a dead letter's review again as a new job linked to the dead one (see
    /// the proto): idempotent per dead letter.
    pub(super) async fn replay(&self, caller: &Tenant, id: &str) -> Result<proto::Review, ApiError> {
        let (handle, dead) = self.dead_letter(caller, id).await?;
        let new_id = job_id::derive(dead.region, &dead.tenant, &format!("replay:{id}"));
        if let Some((existing, _)) = handle.jobs.get(&new_id).await? {
            // A repeated replay: the new job as it stands, findings and all.
            return self.view(handle, &existing).await;
        }
        let Some(old) = dead_letters(handle).content(&dead).await? else {
            return Err(ApiError::FailedPrecondition {
                reason: Reason::ContentExpired,
                what: "the dead letter's content is no longer kept (its retention ended); submit the review again"
                    .into(),
            });
        };
        let now = self.clock.now_ms();
        let lane_deadline = self.policies[usize::from(old.lane == reviewlane_shared::Lane::Batch)].deadline;
        let msg = ReviewMessage {
            job_id: new_id,
            submitted_at_ms: now,
            deadline_ms: Some(now + lane_deadline.as_millis() as u64),
            request_digest: job_id::sha256_hex(&[b"replay", id.as_bytes(), old.request_digest.as_bytes()]),
            replay_of: Some(id.to_string()),
            // The replay is a review of its own: the links of the dead one stay with it.
            deeper_of: None,
            deeper_review: None,
            ..old
        };
        let rec = match self.write_job(handle, &msg).await? {
            Created::New(rec, _) => rec,
            Created::Exists(existing) => return self.view(handle, &existing).await,
        };
        tracing::info!(replay_of = id, "dead letter replayed as a new job");
        Ok(api::review(&rec, &[]))
    }
}
