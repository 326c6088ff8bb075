//! `ListLanes`: each lane of the operator's region as it stands — depth and bound, the
//! oldest review's age, throughput, the predicted wait; `ListDeployments`: what serves
//! those lanes, each provider deployment of the region's pool as its extractors last
//! saw it.

use super::*;

impl ReviewApi {
    /// Each lane of `region` as it stands.
    pub(super) async fn lanes(&self, region: Region) -> Result<Vec<proto::LaneStatus>, ApiError> {
        let handle = self.region(region)?;
        let mut out = Vec::new();
        for lane in reviewlane_shared::Lane::ALL {
            let mut stream =
                handle.layout.js.get_stream(layout::lane_stream(region, lane)).await.map_err(StoreError::other)?;
            let info = stream.info().await.map_err(StoreError::other)?;
            let depth = info.state.messages;
            let oldest_age = (depth > 0).then(|| {
                let age = time::OffsetDateTime::now_utc() - info.state.first_timestamp;
                let age = Duration::try_from(age).unwrap_or_default();
                prost_types::Duration { seconds: age.as_secs() as i64, nanos: age.subsec_nanos() as i32 }
            });
            let (_, per_sec) = self.sampler.get(region, lane);
            let policy = &self.policies[usize::from(lane == reviewlane_shared::Lane::Batch)];
            let wait = crate::admission::predicted_wait(depth, per_sec, policy.min_waiting);
            out.push(proto::LaneStatus {
                region: region.as_str().to_string(),
                lane: api::lane_to_proto(lane) as i32,
                depth,
                bound: u64::try_from(info.config.max_messages).unwrap_or(u64::MAX),
                oldest_age,
                per_second: per_sec.unwrap_or(0.0),
                predicted_wait: wait
                    .map(|w| prost_types::Duration { seconds: w.as_secs() as i64, nanos: w.subsec_nanos() as i32 }),
            });
        }
        Ok(out)
    }

    /// Each deployment of `region`'s pool, as its extractors last wrote it.
    pub(super) async fn deployments(&self, region: Region) -> Result<Vec<proto::DeploymentStatus>, ApiError> {
        let handle = self.region(region)?;
        let seen = reviewlane_shared::pool_status::list(&handle.layout.quota).await?;
        Ok(seen.into_iter().map(|s| api::deployment_to_proto(region, s)).collect())
    }
}
