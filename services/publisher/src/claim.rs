//! Delivery claims, kept on the job record. The publisher's `delivering` write is the
//! claim: a compare-and-set that names its owner (a publisher replica), an expiry and
//! the attempt, refused while another publisher's claim is live. A publisher that dies
//! after claiming is taken over once its claim has expired — not never, and not at
//! once. The claim counts delivery attempts: the delivery budget counts deliveries
//! tried, not messages bounced. The decisions are the job state machine's
//! (`reviewlane_core::job::transition`); this module writes them.

use reviewlane_core::clock::SharedClock;
use reviewlane_core::job::{Event, JobRecord, TransitionError};
use reviewlane_shared::job_store::{JobStore, StoreError};

/// A claim this publisher holds.
#[derive(Debug, Clone)]
pub struct Claim {
    /// This delivery's number (1-based).
    pub attempt: u32,
    /// The record as the claim wrote it, with its revision: the next write to it is a
    /// compare-and-set from there (taken by that write).
    pub record: Option<(JobRecord, u64)>,
}

/// What claiming came to.
#[derive(Debug, Clone)]
pub enum Claimed {
    Mine(Box<Claim>),
    /// Another publisher's live claim: come back after it.
    Busy {
        until_ms: u64,
    },
    /// The record moved on before the claim (published, or ended): as it now stands.
    Moved(Box<JobRecord>),
}

#[derive(Clone)]
pub struct Claims {
    /// This publisher replica.
    pub me: String,
    /// How long a claim holds.
    pub lease_ms: u64,
    pub clock: SharedClock,
}

impl Claims {
    /// Claims the delivery of the job whose record was read as `found`, counting the
    /// attempt: one write, from the revision read.
    pub async fn claim(&self, jobs: &JobStore, job_id: &str, found: (JobRecord, u64)) -> Result<Claimed, StoreError> {
        let event = Event::Delivering { owner: self.me.clone(), expires_at_ms: self.clock.now_ms() + self.lease_ms };
        match jobs.apply_tracked(job_id, Some(found), &event, None).await {
            Ok((rec, revision)) => {
                let attempt = rec.delivery.as_ref().map_or(1, |c| c.attempts);
                Ok(Claimed::Mine(Box::new(Claim { attempt, record: Some((rec, revision)) })))
            }
            Err(StoreError::Transition(TransitionError::DeliveryClaimed { until_ms }, _)) => {
                Ok(Claimed::Busy { until_ms })
            }
            Err(StoreError::Transition(_, current)) => Ok(Claimed::Moved(current)),
            Err(e) => Err(e),
        }
    }

    /// Lets a claim go (it expires now), so whoever gets the message next may try at
    /// once: after a failed delivery (`counted`), or a deferred one that sent nothing
    /// (its attempt given back).
    pub async fn release(
        &self,
        jobs: &JobStore,
        job_id: &str,
        claim: &mut Claim,
        counted: bool,
    ) -> Result<(), StoreError> {
        let event = Event::DeliveryReleased { owner: self.me.clone(), attempt: claim.attempt, counted };
        match jobs.apply_tracked(job_id, claim.record.take(), &event, None).await {
            Ok(_) => Ok(()),
            // Taken over meanwhile (this holder overran its claim), or the job moved on:
            // theirs stands.
            Err(StoreError::Transition(..)) => {
                tracing::warn!("delivery claim taken over before it was released");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}
