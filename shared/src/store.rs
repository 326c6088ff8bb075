//! Errors of the region's stores (KV buckets, streams, object store), by kind, so that
//! each caller decides: retry (conflict, timeout, unavailable), end the job (too large,
//! refused), or ignore (not found where absence is an answer).

use async_nats::jetstream::{self, context, kv, object_store};

use crate::job::{JobRecord, TransitionError};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    #[error("stored record is unreadable")]
    Corrupt,
    /// The state machine refused the event; here is the record as stored.
    #[error("{0}")]
    Transition(TransitionError, Box<JobRecord>),
    /// A compare-and-set kept losing to other writers.
    #[error("compare-and-set kept losing to other writers")]
    Conflict,
    /// Checked before writing: the value can never fit.
    #[error("{size} bytes, over the store's limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    #[error("store timed out")]
    Timeout(#[source] async_nats::Error),
    /// Connection lost, server restarting, no responders: worth another try.
    #[error("store unavailable")]
    Unavailable(#[source] async_nats::Error),
    /// The server refused the write for good (no such stream, invalid key, limits).
    #[error("store refused the write")]
    Refused(#[source] async_nats::Error),
}

impl StoreError {
    /// Worth trying the same write again later.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Conflict | StoreError::Timeout(_) | StoreError::Unavailable(_))
    }

    /// A short class for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::NotFound => "not_found",
            StoreError::Corrupt => "corrupt",
            StoreError::Transition(..) => "transition",
            StoreError::Conflict => "conflict",
            StoreError::TooLarge { .. } => "too_large",
            StoreError::Timeout(_) => "timeout",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Refused(_) => "refused",
        }
    }

    /// A JetStream publish (stream write) failed.
    pub fn publish(e: context::PublishError) -> Self {
        use context::PublishErrorKind as K;
        match e.kind() {
            K::TimedOut => StoreError::Timeout(e.into()),
            K::BrokenPipe | K::MaxAckPending => StoreError::Unavailable(e.into()),
            K::MaxPayloadExceeded => StoreError::TooLarge { size: 0, limit: 0 },
            // "No stream for the subject" is how a publish meets no responders: on a
            // cluster, a stream between leaders during a failover. Retried within the
            // (bounded) store budget; a stream that is really missing still ends there.
            K::StreamNotFound => StoreError::Unavailable(e.into()),
            K::WrongLastMessageId | K::WrongLastSequence => StoreError::Refused(e.into()),
            K::Other => match jetstream_code(&e) {
                Some(c) if is_limit(c) => StoreError::Refused(e.into()),
                Some(jetstream::ErrorCode::STREAM_NOT_FOUND) => StoreError::Refused(e.into()),
                // Without a JetStream answer: the server or the connection is away.
                _ => StoreError::Unavailable(e.into()),
            },
        }
    }

    pub fn kv_update(e: kv::UpdateError) -> Self {
        match e.kind() {
            kv::UpdateErrorKind::WrongLastRevision => StoreError::Conflict,
            kv::UpdateErrorKind::TimedOut => StoreError::Timeout(e.into()),
            kv::UpdateErrorKind::InvalidKey => StoreError::Refused(e.into()),
            kv::UpdateErrorKind::Other => StoreError::Unavailable(e.into()),
        }
    }

    /// A KV `create` failed for another reason than an existing key.
    pub fn kv_create(e: kv::CreateError) -> Self {
        match e.kind() {
            kv::CreateErrorKind::AlreadyExists => StoreError::Conflict,
            kv::CreateErrorKind::InvalidKey => StoreError::Refused(e.into()),
            _ => StoreError::Unavailable(e.into()),
        }
    }

    pub fn kv_put(e: kv::PutError) -> Self {
        match e.kind() {
            kv::PutErrorKind::InvalidKey => StoreError::Refused(e.into()),
            _ => StoreError::Unavailable(e.into()),
        }
    }

    pub fn kv_entry(e: kv::EntryError) -> Self {
        match e.kind() {
            kv::EntryErrorKind::TimedOut => StoreError::Timeout(e.into()),
            kv::EntryErrorKind::InvalidKey => StoreError::Refused(e.into()),
            kv::EntryErrorKind::Other => StoreError::Unavailable(e.into()),
        }
    }

    pub fn object_put(e: object_store::PutError) -> Self {
        match e.kind() {
            object_store::PutErrorKind::TimedOut => StoreError::Timeout(e.into()),
            object_store::PutErrorKind::InvalidName => StoreError::Refused(e.into()),
            _ => StoreError::Unavailable(e.into()),
        }
    }

    pub fn object_get(e: object_store::GetError) -> Self {
        match e.kind() {
            object_store::GetErrorKind::NotFound => StoreError::NotFound,
            object_store::GetErrorKind::TimedOut => StoreError::Timeout(e.into()),
            object_store::GetErrorKind::InvalidName => StoreError::Refused(e.into()),
            _ => StoreError::Unavailable(e.into()),
        }
    }

    /// Any other NATS request (stream info, direct get, subscribe).
    pub fn other(e: impl Into<async_nats::Error>) -> Self {
        StoreError::Unavailable(e.into())
    }
}

fn jetstream_code(e: &context::PublishError) -> Option<jetstream::ErrorCode> {
    std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>()).map(|j| j.error_code())
}

fn is_limit(c: jetstream::ErrorCode) -> bool {
    c == jetstream::ErrorCode::STREAM_STORE_FAILED
        || c == jetstream::ErrorCode::STREAM_MAX_STREAM_BYTES_EXCEEDED
        || c == jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_congestion_and_outages_are_retryable() {
        let nats = || async_nats::Error::from("x");
        assert!(StoreError::Conflict.is_retryable());
        assert!(StoreError::Timeout(nats()).is_retryable());
        assert!(StoreError::Unavailable(nats()).is_retryable());
        assert!(!StoreError::TooLarge { size: 2, limit: 1 }.is_retryable());
        assert!(!StoreError::Refused(nats()).is_retryable());
        assert!(!StoreError::NotFound.is_retryable());
        assert!(!StoreError::Corrupt.is_retryable());
    }

    #[test]
    fn publish_kinds_map_to_store_kinds() {
        let timed_out = context::PublishError::new(context::PublishErrorKind::TimedOut);
        assert_eq!(StoreError::publish(timed_out).kind(), "timeout");
        let too_big = context::PublishError::new(context::PublishErrorKind::MaxPayloadExceeded);
        assert_eq!(StoreError::publish(too_big).kind(), "too_large");
        // No responders: a stream between leaders in a failover, retried (bounded).
        let leaderless = context::PublishError::new(context::PublishErrorKind::StreamNotFound);
        assert_eq!(StoreError::publish(leaderless).kind(), "unavailable");
        let pipe = context::PublishError::new(context::PublishErrorKind::BrokenPipe);
        assert_eq!(StoreError::publish(pipe).kind(), "unavailable");
    }
}

/// Retries of one store write that must not be lost because work was already done for
/// it (a paid answer kept, a delivery made): a bounded number, with backoff. The
/// default (12 tries, 100 ms doubling to 4 s, about 26 s in all) outlasts a JetStream
/// cluster's failover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreRetry {
    /// Tries in all (the first included).
    pub tries: u32,
    pub base: std::time::Duration,
    pub cap: std::time::Duration,
}

impl Default for StoreRetry {
    fn default() -> Self {
        StoreRetry { tries: 12, base: std::time::Duration::from_millis(100), cap: std::time::Duration::from_secs(4) }
    }
}

impl StoreRetry {
    /// Reads `REVIEWLANE_STORE_RETRIES`, `REVIEWLANE_STORE_BACKOFF_BASE_MS` and
    /// `REVIEWLANE_STORE_BACKOFF_CAP_MS`.
    pub fn from_reader(r: &mut crate::config::Reader<'_>) -> StoreRetry {
        let d = StoreRetry::default();
        let ms = |v: std::time::Duration| v.as_millis() as u64;
        let s = StoreRetry {
            tries: r.or("REVIEWLANE_STORE_RETRIES", d.tries, "a count"),
            base: std::time::Duration::from_millis(r.or(
                "REVIEWLANE_STORE_BACKOFF_BASE_MS",
                ms(d.base),
                "milliseconds",
            )),
            cap: std::time::Duration::from_millis(r.or("REVIEWLANE_STORE_BACKOFF_CAP_MS", ms(d.cap), "milliseconds")),
        };
        if s.tries == 0 {
            r.error("REVIEWLANE_STORE_RETRIES must be positive");
        }
        s
    }

    /// Delay after failed try `attempt` (1-based): base doubling, capped.
    pub fn delay(&self, attempt: u32) -> std::time::Duration {
        self.base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20)).min(self.cap)
    }

    /// Runs `write`, retrying retryable failures within the budget; `between` runs
    /// before each wait (to keep a lease alive, count the retry).
    pub async fn run<T, F, Fut, B, BFut>(&self, mut write: F, mut between: B) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
        B: FnMut(&StoreError, u32, std::time::Duration) -> BFut,
        BFut: Future<Output = ()>,
    {
        let mut attempt = 1;
        loop {
            match write().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_retryable() && attempt < self.tries => {
                    let delay = self.delay(attempt);
                    between(&e, attempt, delay).await;
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod retry_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_default_budget_outlasts_a_cluster_failover_and_is_bounded() {
        let r = StoreRetry::default();
        let total: Duration = (1..r.tries).map(|a| r.delay(a)).sum();
        assert!(total >= Duration::from_secs(20) && total <= Duration::from_secs(30), "{total:?}");
        assert_eq!(r.delay(1), Duration::from_millis(100));
        assert_eq!(r.delay(40), r.cap);
    }

    #[tokio::test(start_paused = true)]
    async fn retries_only_retryable_failures_and_stops_at_the_budget() {
        let r = StoreRetry { tries: 3, base: Duration::from_millis(10), cap: Duration::from_millis(10) };
        let mut calls = 0;
        let res: Result<(), _> = r
            .run(
                || {
                    calls += 1;
                    async { Err(StoreError::Conflict) }
                },
                |_: &StoreError, _, _| async {},
            )
            .await;
        assert!(matches!(res, Err(StoreError::Conflict)));
        assert_eq!(calls, 3);
        let mut calls = 0;
        let res: Result<(), _> = r
            .run(
                || {
                    calls += 1;
                    async { Err(StoreError::Corrupt) }
                },
                |_: &StoreError, _, _| async {},
            )
            .await;
        assert!(matches!(res, Err(StoreError::Corrupt)));
        assert_eq!(calls, 1, "not retryable: one try");
    }
}
