//! A review on its lane: put there (one subject per job, `Nats-Msg-Id` = the job id so
//! the lane drops a copy, the trace context in the headers) and looked for. The ingress
//! puts submits and sweep items there; the sweep coordinator puts items it sends through
//! the lanes, and the reconciler and the coordinator look for a job's review there.

use async_nats::jetstream;
use reviewlane_core::job::{JobRecord, ReviewDepth};
use reviewlane_core::messages::ReviewMessage;

use crate::layout;
use crate::store::StoreError;

/// Puts `msg` (encoded as `payload`) on its lane and waits for the server's ack. The
/// error is the server's (a full lane is `is_stream_full` to the caller).
pub async fn put(
    js: &jetstream::Context,
    msg: &ReviewMessage,
    payload: Vec<u8>,
) -> Result<(), jetstream::context::PublishError> {
    let subject = layout::lane_subject(msg.region, msg.lane, &msg.tenant, msg.review_depth, &msg.job_id);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, msg.job_id.as_str());
    crate::telemetry::inject_nats(&mut headers);
    js.publish_with_headers(subject, headers, payload.into()).await?.await?;
    Ok(())
}

/// The subjects the job's review may be on: its depth's, and for a review at depth
/// `changed_hunks` also the full-depth one, where such reviews went before they had a
/// subject of their own.
pub fn subjects(rec: &JobRecord) -> impl Iterator<Item = String> + '_ {
    let own = layout::lane_subject(rec.region, rec.lane, &rec.tenant, rec.review_depth, &rec.job_id);
    let earlier = (rec.review_depth != ReviewDepth::Full)
        .then(|| layout::lane_subject(rec.region, rec.lane, &rec.tenant, ReviewDepth::Full, &rec.job_id));
    std::iter::once(own).chain(earlier)
}

/// Whether the job's review is on its lane.
pub async fn holds(js: &jetstream::Context, rec: &JobRecord) -> Result<bool, StoreError> {
    let stream = js.get_stream_no_info(layout::lane_stream(rec.region, rec.lane)).await.map_err(StoreError::other)?;
    for subject in subjects(rec) {
        match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(_) => return Ok(true),
            Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {}
            Err(e) => return Err(StoreError::other(e)),
        }
    }
    Ok(false)
}
