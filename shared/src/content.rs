//! Where a job's content (its diff, the model's findings) lives in its region, and
//! dropping all of it: what a cancelled job leaves behind is its record, never its
//! content (a cancel is not a failure: it leaves no dead letter).

use async_nats::jetstream::object_store;

use crate::layout::{self, RegionLayout};
use crate::store::StoreError;
use reviewlane_core::job::JobRecord;

/// Removes the job's review from its lane, its results (inline and as objects, every
/// generation and part) and any dead-letter content. Each removal is idempotent; what is already
/// gone is skipped.
pub async fn drop_content(layout: &RegionLayout, rec: &JobRecord) -> Result<(), StoreError> {
    let (r, tenant, id) = (rec.region, rec.tenant.as_str(), rec.job_id.as_str());
    let lane = crate::lanes::subjects(rec).map(|s| (layout::lane_stream(r, rec.lane), s));
    let purges = lane.chain([
        (layout::findings_stream(r), format!("findings.{}.{tenant}.{id}.>", r.as_str())),
        (layout::parts_stream(r), format!("parts.{}.{tenant}.{id}.>", r.as_str())),
        (layout::deadletter_content_stream(r), layout::deadletter_content_subject(r, tenant, id)),
    ]);
    for (stream, subject) in purges {
        let s = layout.js.get_stream(&stream).await.map_err(StoreError::other)?;
        s.purge().filter(subject).await.map_err(StoreError::other)?;
    }
    let parts = rec.parts.as_ref().map_or(0, |p| p.total);
    let names = (1..=rec.generation()).map(|g| format!("{id}.{g}")).chain((0..parts).map(|i| format!("{id}.part{i}")));
    for name in names {
        match layout.objects.delete(name).await {
            Ok(()) => {}
            Err(e) if e.kind() == object_store::DeleteErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::other(e)),
        }
    }
    Ok(())
}
