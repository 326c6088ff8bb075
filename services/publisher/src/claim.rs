//! Delivery claims in `PUBLISHED_<R>`: one record per job, created or taken over by
//! compare-and-set. A claim names its owner (a publisher replica) and expires, so a
//! publisher that dies after claiming is taken over once its claim has expired — not
//! never, and not at once. The record also counts delivery attempts: the delivery
//! budget counts deliveries tried, not messages bounced.

use async_nats::jetstream::kv;
use reviewlane_core::clock::SharedClock;
use reviewlane_shared::job_store::StoreError;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PublicationState {
    Publishing,
    Published,
    Failed,
}

/// A record in `PUBLISHED_<R>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    pub state: PublicationState,
    pub at_ms: u64,
    /// The publisher replica that holds (or last held) the claim.
    #[serde(default)]
    pub owner: String,
    /// Until when the claim holds; past it, another publisher may take over.
    #[serde(default)]
    pub expires_at_ms: u64,
    /// Deliveries tried so far, this one included once claimed.
    #[serde(default)]
    pub attempts: u32,
}

/// What to do about a job's publication record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// No record: create the claim.
    Create,
    /// A claim that expired (its holder died or gave up): take it over.
    TakeOver {
        attempts: u32,
    },
    /// Another publisher's live claim: come back after it.
    Busy {
        until_ms: u64,
    },
    Published,
    Failed,
}

/// The pure decision.
pub fn step(existing: Option<&Publication>, now_ms: u64) -> Step {
    match existing {
        None => Step::Create,
        Some(p) => match p.state {
            PublicationState::Published => Step::Published,
            PublicationState::Failed => Step::Failed,
            PublicationState::Publishing if now_ms < p.expires_at_ms => Step::Busy { until_ms: p.expires_at_ms },
            PublicationState::Publishing => Step::TakeOver { attempts: p.attempts },
        },
    }
}

/// A claim this publisher holds.
#[derive(Debug, Clone)]
pub struct Claim {
    pub revision: u64,
    /// This delivery's number (1-based).
    pub attempt: u32,
}

pub enum Claimed {
    Mine(Claim),
    Busy { until_ms: u64 },
    Published,
    Failed,
}

#[derive(Clone)]
pub struct Claims {
    pub kv: kv::Store,
    pub me: String,
    pub lease_ms: u64,
    pub clock: SharedClock,
}

impl Claims {
    fn record(&self, state: PublicationState, attempts: u32, expires_at_ms: u64) -> bytes::Bytes {
        let p = Publication { state, at_ms: self.clock.now_ms(), owner: self.me.clone(), expires_at_ms, attempts };
        serde_json::to_vec(&p).expect("publication serializes").into()
    }

    /// Claims the job's delivery, counting the attempt. A job's first delivery finds no
    /// record, so the claim is created without reading first; an existing record is
    /// read and judged.
    pub async fn claim(&self, job_id: &str) -> Result<Claimed, StoreError> {
        let expires = self.clock.now_ms() + self.lease_ms;
        match self.kv.create(job_id, self.record(PublicationState::Publishing, 1, expires)).await {
            Ok(revision) => return Ok(Claimed::Mine(Claim { revision, attempt: 1 })),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::kv_create(e)),
        }
        for _ in 0..4 {
            let entry = self.kv.entry(job_id).await.map_err(StoreError::kv_entry)?;
            let existing = match &entry {
                Some(e) if e.operation == kv::Operation::Put => {
                    Some(serde_json::from_slice::<Publication>(&e.value).map_err(|_| StoreError::Corrupt)?)
                }
                _ => None,
            };
            let now = self.clock.now_ms();
            let expires = now + self.lease_ms;
            let written = match step(existing.as_ref(), now) {
                Step::Published => return Ok(Claimed::Published),
                Step::Failed => return Ok(Claimed::Failed),
                Step::Busy { until_ms } => return Ok(Claimed::Busy { until_ms }),
                Step::Create => self
                    .kv
                    .create(job_id, self.record(PublicationState::Publishing, 1, expires))
                    .await
                    .map(|revision| Claim { revision, attempt: 1 })
                    .map_err(StoreError::kv_create),
                Step::TakeOver { attempts } => {
                    let revision = entry.as_ref().map(|e| e.revision).unwrap_or(0);
                    self.kv
                        .update(job_id, self.record(PublicationState::Publishing, attempts + 1, expires), revision)
                        .await
                        .map(|revision| Claim { revision, attempt: attempts + 1 })
                        .map_err(StoreError::kv_update)
                }
            };
            match written {
                Ok(claim) => return Ok(Claimed::Mine(claim)),
                // Another publisher wrote first: look again.
                Err(StoreError::Conflict) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::Conflict)
    }

    /// Ends or releases a claim: `Published`/`Failed` for good, or `Publishing` expiring
    /// now (a failed attempt: whoever gets the message next may try at once).
    pub async fn close(&self, job_id: &str, claim: &Claim, state: PublicationState) -> Result<(), StoreError> {
        self.write(job_id, claim, state, claim.attempt).await
    }

    /// Releases a claim whose delivery sent nothing (deferred): its attempt is not
    /// counted.
    pub async fn give_back(&self, job_id: &str, claim: &Claim) -> Result<(), StoreError> {
        self.write(job_id, claim, PublicationState::Publishing, claim.attempt.saturating_sub(1)).await
    }

    async fn write(
        &self,
        job_id: &str,
        claim: &Claim,
        state: PublicationState,
        attempts: u32,
    ) -> Result<(), StoreError> {
        let expires = if state == PublicationState::Publishing { self.clock.now_ms() } else { 0 };
        match self.kv.update(job_id, self.record(state, attempts, expires), claim.revision).await {
            Ok(_) => Ok(()),
            Err(e) => match StoreError::kv_update(e) {
                // Taken over meanwhile (this holder overran its claim): theirs stands.
                StoreError::Conflict => {
                    tracing::warn!("delivery claim taken over before it was settled");
                    Ok(())
                }
                other => Err(other),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(state: PublicationState, expires_at_ms: u64, attempts: u32) -> Publication {
        Publication { state, at_ms: 0, owner: "a".into(), expires_at_ms, attempts }
    }

    #[test]
    fn a_live_claim_is_waited_for_an_expired_one_taken_over_with_its_count() {
        assert_eq!(step(None, 10), Step::Create);
        let live = claim(PublicationState::Publishing, 1_000, 2);
        assert_eq!(step(Some(&live), 999), Step::Busy { until_ms: 1_000 });
        assert_eq!(step(Some(&live), 1_000), Step::TakeOver { attempts: 2 });
        assert_eq!(step(Some(&claim(PublicationState::Published, 0, 1)), 5), Step::Published);
        assert_eq!(step(Some(&claim(PublicationState::Failed, 0, 8)), 5), Step::Failed);
    }
}
