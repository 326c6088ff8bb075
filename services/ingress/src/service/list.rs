//! `ListReviews`: the tenant's reviews from the region's job index, newest first, in
//! pages bound to their filters.

use super::*;

impl ReviewApi {
    /// A page of the tenant's reviews from the region's job index.
    pub(super) async fn list(&self, tenant: &Tenant, req: ListReviewsRequest) -> Result<ListReviewsResponse, ApiError> {
        let limit = page_size(req.page_size, 20, 100)?;
        let mut states = Vec::new();
        for s in &req.states {
            let state = proto::JobState::try_from(*s)
                .ok()
                .and_then(api::state_from_proto)
                .ok_or_else(|| ApiError::invalid("states", "unknown job state"))?;
            states.push(state);
        }
        let lane = match proto::Lane::try_from(req.lane) {
            Ok(proto::Lane::Unspecified) => None,
            Ok(_) => api::lane_from_proto(req.lane),
            Err(_) => return Err(ApiError::invalid("lane", "unknown lane")),
        };
        let ms = |t: &prost_types::Timestamp| (t.seconds.max(0) as u64) * 1000 + (t.nanos.max(0) as u64) / 1_000_000;
        let query = job_index::Query {
            states,
            lane,
            repository: (!req.repository.is_empty()).then(|| job_index::repository_digest(&tenant.id, &req.repository)),
            created_after_ms: req.created_after.as_ref().map(ms),
            created_before_ms: req.created_before.as_ref().map(ms),
        };
        let cursor = job_index::Cursor::from_token(&req.page_token, &query)
            .map_err(|e| ApiError::invalid("page_token", e.to_string()))?;
        let handle = self.region(tenant.region)?;
        let index = job_index::JobIndex::new(handle.layout.js.clone(), tenant.region);
        let page = index.page(&handle.jobs, &tenant.id, &query, cursor, limit).await?;
        Ok(ListReviewsResponse {
            reviews: page.records.iter().map(|r| api::review(r, &[])).collect(),
            next_page_token: page.next.map(|c| c.token(&query)).unwrap_or_default(),
        })
    }
}
