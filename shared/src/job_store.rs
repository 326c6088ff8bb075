//! The job store: job records in KV `JOBS_<R>`, every change a compare-and-set on the
//! record's revision through `job::transition`.

use async_nats::jetstream::kv;

pub use crate::store::StoreError;
use reviewlane_core::clock::SharedClock;
use reviewlane_core::job::{Event, JobRecord, transition};

/// Result of `create`.
pub enum Created {
    /// Created now, at this revision.
    New(JobRecord, u64),
    /// A record already had this id; here it is, as stored.
    Exists(JobRecord),
}

#[derive(Clone)]
pub struct JobStore {
    kv: kv::Store,
    client: async_nats::Client,
    clock: SharedClock,
}

/// Every revision of one job record after a given one, in order: a KV watch that
/// starts at the revision after the one the caller read, so no update between the read
/// and the watch is missed, and no update is seen twice.
pub struct JobChanges {
    watch: kv::Watch,
}

impl JobChanges {
    /// The next revision: `Some(None)` when the record was deleted, `None` when the
    /// watch ended (the connection closed).
    pub async fn next(&mut self) -> Option<Result<Option<(JobRecord, u64)>, StoreError>> {
        let entry = match futures::StreamExt::next(&mut self.watch).await? {
            Ok(e) => e,
            Err(e) => return Some(Err(StoreError::other(e))),
        };
        if entry.operation != kv::Operation::Put {
            return Some(Ok(None));
        }
        Some(
            serde_json::from_slice(&entry.value)
                .map(|rec| Some((rec, entry.revision)))
                .map_err(|_| StoreError::Corrupt),
        )
    }
}

/// How often `apply` re-reads after losing a compare-and-set before giving up.
const CAS_TRIES: usize = 16;

impl JobStore {
    pub fn new(kv: kv::Store, client: async_nats::Client) -> Self {
        JobStore { kv, client, clock: reviewlane_core::clock::system() }
    }

    /// The same store, stamping and judging leases with `clock`.
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// Signals that one record may have changed: a core subscription on its KV subject,
    /// no JetStream consumer, so it costs no round trip. A signal can come before the
    /// write is stored, and failed compare-and-set writes signal too: for waiters that
    /// re-read on a schedule of their own (a worker's lease heartbeat).
    pub async fn signals(&self, job_id: &str) -> Result<async_nats::Subscriber, StoreError> {
        let subject = format!("{}{}", self.kv.prefix, job_id);
        self.client.subscribe(subject).await.map_err(StoreError::other)
    }

    /// Signals of every record of the region: each subject ends in its job id (for a
    /// watcher of many jobs, which re-reads those it follows).
    pub async fn all_signals(&self) -> Result<async_nats::Subscriber, StoreError> {
        self.client.subscribe(format!("{}>", self.kv.prefix)).await.map_err(StoreError::other)
    }

    /// The job id a signal's subject names.
    pub fn signalled<'s>(&self, subject: &'s str) -> Option<&'s str> {
        subject.strip_prefix(self.kv.prefix.as_str())
    }

    /// The revisions of one record after `revision` (the one the caller read).
    pub async fn changes_after(&self, job_id: &str, revision: u64) -> Result<JobChanges, StoreError> {
        let watch = self.kv.watch_from_revision(job_id, revision + 1).await.map_err(StoreError::other)?;
        Ok(JobChanges { watch })
    }

    pub fn kv(&self) -> &kv::Store {
        &self.kv
    }

    /// Creates the record unless the id exists (KV `create`: exactly one creator wins).
    pub async fn create(&self, rec: &JobRecord) -> Result<Created, StoreError> {
        let bytes = serde_json::to_vec(rec).expect("job record serializes");
        match self.kv.create(&rec.job_id, bytes.into()).await {
            Ok(revision) => Ok(Created::New(rec.clone(), revision)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                let (existing, _) = self.get(&rec.job_id).await?.ok_or(StoreError::NotFound)?;
                Ok(Created::Exists(existing))
            }
            Err(e) => Err(StoreError::kv_create(e)),
        }
    }

    pub async fn get(&self, job_id: &str) -> Result<Option<(JobRecord, u64)>, StoreError> {
        let Some(entry) = self.kv.entry(job_id).await.map_err(StoreError::kv_entry)? else {
            return Ok(None);
        };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let rec = serde_json::from_slice(&entry.value).map_err(|_| StoreError::Corrupt)?;
        Ok(Some((rec, entry.revision)))
    }

    /// Applies `event` with compare-and-set, re-reading on conflict. A refused
    /// transition returns the current record with the reason.
    pub async fn apply(&self, job_id: &str, event: &Event) -> Result<JobRecord, StoreError> {
        self.apply_from(job_id, None, event).await
    }

    /// One compare-and-set from exactly the record and revision the caller read:
    /// `Conflict` if anything wrote in between (the caller's decision is then stale).
    pub async fn apply_once(
        &self,
        job_id: &str,
        read: (JobRecord, u64),
        event: &Event,
    ) -> Result<JobRecord, StoreError> {
        let (rec, revision) = read;
        let next =
            transition(&rec, event, self.clock.now_ms()).map_err(|e| StoreError::Transition(e, Box::new(rec)))?;
        let bytes = serde_json::to_vec(&next).expect("job record serializes");
        self.kv.update(job_id, bytes.into(), revision).await.map_err(StoreError::kv_update)?;
        Ok(next)
    }

    /// As `apply`, starting from a record and revision the caller holds (saving a
    /// read when nobody wrote in between).
    pub async fn apply_from(
        &self,
        job_id: &str,
        known: Option<(JobRecord, u64)>,
        event: &Event,
    ) -> Result<JobRecord, StoreError> {
        self.apply_charging(job_id, known, event, None).await
    }

    /// `apply_from`, adding a call's tokens and cost to the record in the same write.
    pub async fn apply_charging(
        &self,
        job_id: &str,
        known: Option<(JobRecord, u64)>,
        event: &Event,
        charge: Option<&reviewlane_core::job::Charge>,
    ) -> Result<JobRecord, StoreError> {
        self.apply_tracked(job_id, known, event, charge).await.map(|(rec, _)| rec)
    }

    /// `apply_charging`, returning the revision written too, so that the writer's next
    /// change of the same record needs no read. `known` may be out of date: the
    /// compare-and-set then fails, and the record is read and the event applied again
    /// (a refused transition is judged only against a record read from the store).
    pub async fn apply_tracked(
        &self,
        job_id: &str,
        mut known: Option<(JobRecord, u64)>,
        event: &Event,
        charge: Option<&reviewlane_core::job::Charge>,
    ) -> Result<(JobRecord, u64), StoreError> {
        for _ in 0..CAS_TRIES {
            let (from_known, (rec, revision)) = match known.take() {
                Some(k) => (true, k),
                None => (false, self.get(job_id).await?.ok_or(StoreError::NotFound)?),
            };
            let mut next = match transition(&rec, event, self.clock.now_ms()) {
                Ok(n) => n,
                Err(_) if from_known => continue,
                Err(e) => return Err(StoreError::Transition(e, Box::new(rec))),
            };
            if let Some(charge) = charge {
                next.charge(charge);
            }
            let bytes = serde_json::to_vec(&next).expect("job record serializes");
            match self.kv.update(job_id, bytes.into(), revision).await {
                Ok(written) => return Ok((next, written)),
                Err(e) => match StoreError::kv_update(e) {
                    StoreError::Conflict => continue,
                    other => return Err(other),
                },
            }
        }
        Err(StoreError::Conflict)
    }
}
