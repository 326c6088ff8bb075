//! Fixtures for tests of the crates above core (the `testing` feature) and of core's
//! own: one job record, built the way the ingress builds one.

use crate::job::{JobRecord, JobState, NewJob, ReviewDepth};
use crate::region::{Lane, Region};

/// The record of job `job_id` in `state`: tenant `t`, region us, the interactive lane,
/// schema `findings.v1`, created at 1,000 ms. Only its state is moved: what a state
/// implies besides (a lease, a reason) is the test's to set.
pub fn record(job_id: &str, state: JobState) -> JobRecord {
    let mut rec = JobRecord::waiting(NewJob {
        job_id: job_id.into(),
        tenant: "t".into(),
        region: Region::Us,
        lane: Lane::Interactive,
        schema_version: "findings.v1".into(),
        input_digest: "d".into(),
        request_digest: "r".into(),
        review_depth: ReviewDepth::Full,
        created_at_ms: 1_000,
    });
    rec.state = state;
    rec
}
