//! Fault hooks for tests: make the write at a named point fail, as a store outage
//! would. Compiled in only with the `fault-hooks` feature, which release builds do not
//! enable; without it `check` is a no-op the compiler removes.

use crate::store::StoreError;

/// The points services check before the write they name.
pub mod point {
    /// Ingress: creating the job record (written beside the lane message).
    pub const INGRESS_RECORD: &str = "ingress.record";
    /// Ingress: storing the lane message (written beside the job record).
    pub const INGRESS_LANE: &str = "ingress.lane";
    /// Ingress: removing the record of a submit whose lane message was refused (failing
    /// it stands for the ingress dying between the two).
    pub const INGRESS_UNDO_RECORD: &str = "ingress.undo_record";
    /// Extractor: keeping a paid answer on `FINDINGS_<R>`.
    pub const EXTRACTOR_KEEP: &str = "extractor.keep";
    /// Extractor: recording `validated` after the answer is kept.
    pub const EXTRACTOR_RECORD_VALIDATED: &str = "extractor.record_validated";
    /// Publisher: recording a delivery the sink took (the job `published`).
    pub const PUBLISHER_RECORD_DELIVERED: &str = "publisher.record_delivered";
    /// Sweep coordinator: putting an item it handed to the lanes on the batch lane
    /// (failing it stands for the coordinator dying, or the lane refusing, between the
    /// hand-over and the put).
    pub const COORDINATOR_LANE: &str = "coordinator.lane";
}

#[derive(Clone, Default)]
pub struct Faults {
    #[cfg(feature = "fault-hooks")]
    /// Per point: failures left, and whether they say the store is full (else that it
    /// is unavailable).
    armed: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<&'static str, (u32, bool)>>>,
}

impl Faults {
    /// Fails (as `Unavailable`, or `Full`) when a fault is armed at `point`, consuming
    /// one.
    #[inline(always)]
    pub fn check(&self, point: &'static str) -> Result<(), StoreError> {
        #[cfg(feature = "fault-hooks")]
        {
            let mut armed = self.armed.lock().expect("faults");
            if let Some((n, full)) = armed.get_mut(point).filter(|(n, _)| *n > 0) {
                *n -= 1;
                let cause = format!("injected fault at {point}").into();
                return Err(if *full { StoreError::Full(cause) } else { StoreError::Unavailable(cause) });
            }
        }
        let _ = point;
        Ok(())
    }

    /// Makes the next `times` writes at `point` fail.
    #[cfg(feature = "fault-hooks")]
    pub fn fail(&self, point: &'static str, times: u32) {
        self.armed.lock().expect("faults").insert(point, (times, false));
    }

    /// Makes the next `times` writes at `point` fail as a store out of space would.
    #[cfg(feature = "fault-hooks")]
    pub fn fail_full(&self, point: &'static str, times: u32) {
        self.armed.lock().expect("faults").insert(point, (times, true));
    }

    /// How many armed failures at `point` have not fired yet.
    #[cfg(feature = "fault-hooks")]
    pub fn pending(&self, point: &'static str) -> u32 {
        self.armed.lock().expect("faults").get(point).map_or(0, |(n, _)| *n)
    }
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Faults")
    }
}

#[cfg(all(test, feature = "fault-hooks"))]
mod tests {
    use super::*;

    #[test]
    fn an_armed_point_fails_as_often_as_armed_then_passes() {
        let f = Faults::default();
        assert!(f.check(point::EXTRACTOR_KEEP).is_ok());
        f.fail(point::EXTRACTOR_KEEP, 2);
        assert!(f.check(point::EXTRACTOR_KEEP).unwrap_err().is_retryable());
        assert!(f.check(point::INGRESS_RECORD).is_ok());
        assert!(f.check(point::EXTRACTOR_KEEP).is_err());
        assert!(f.check(point::EXTRACTOR_KEEP).is_ok());
    }
}
