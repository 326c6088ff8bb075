//! Errors of the region's stores (KV buckets, streams, object store), by kind, so that
//! each caller decides: retry (conflict, timeout, unavailable), end the job (too large,
//! refused), or ignore (not found where absence is an answer).

use async_nats::jetstream::{self, context, kv, object_store};

use reviewlane_core::job::{JobRecord, TransitionError};

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
    /// The server refused the write for good (no such stream, invalid key).
    #[error("store refused the write")]
    Refused(#[source] async_nats::Error),
    /// The store is out of space (the server's storage, the account's, or a stream's
    /// byte or message limit): it takes writes again once room is made.
    #[error("store is full")]
    Full(#[source] async_nats::Error),
}

impl StoreError {
    /// Worth trying the same write again later.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Conflict | StoreError::Timeout(_) | StoreError::Unavailable(_) | StoreError::Full(_))
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
            StoreError::Full(_) => "full",
        }
    }

    /// Kinds that say the store refused a write (counted, and a full store makes a
    /// service unready); a conflict, an absence or a state-machine refusal do not.
    pub const REFUSALS: [&'static str; 5] = ["full", "unavailable", "timeout", "refused", "too_large"];

    /// `e` as `Full` when JetStream said it is out of space (its answer anywhere in the
    /// error's sources); otherwise as `other` makes it.
    fn or_full(e: impl std::error::Error + Send + Sync + 'static, other: fn(async_nats::Error) -> StoreError) -> Self {
        if is_full(&e) { StoreError::Full(e.into()) } else { other(e.into()) }
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
                Some(jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => {
                    StoreError::TooLarge { size: 0, limit: 0 }
                }
                Some(c) if is_out_of_space(c) => StoreError::Full(e.into()),
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
            kv::UpdateErrorKind::Other => StoreError::or_full(e, StoreError::Unavailable),
        }
    }

    /// A KV `create` failed for another reason than an existing key.
    pub fn kv_create(e: kv::CreateError) -> Self {
        match e.kind() {
            kv::CreateErrorKind::AlreadyExists => StoreError::Conflict,
            kv::CreateErrorKind::InvalidKey => StoreError::Refused(e.into()),
            _ => StoreError::or_full(e, StoreError::Unavailable),
        }
    }

    pub fn kv_put(e: kv::PutError) -> Self {
        match e.kind() {
            kv::PutErrorKind::InvalidKey => StoreError::Refused(e.into()),
            _ => StoreError::or_full(e, StoreError::Unavailable),
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
            _ => StoreError::or_full(e, StoreError::Unavailable),
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

/// JetStream's answers for a store out of space: the server's or the account's storage
/// (insufficient resources), or a stream's own limit with `discard: new` (its store
/// failed: maximum bytes or messages).
fn is_out_of_space(c: jetstream::ErrorCode) -> bool {
    use jetstream::ErrorCode as C;
    [
        C::INSUFFICIENT_RESOURCES,
        C::STORAGE_RESOURCES_EXCEEDED,
        C::MEMORY_RESOURCES_EXCEEDED,
        C::ACCOUNT_RESOURCES_EXCEEDED,
        C::STREAM_STORE_FAILED,
        C::STREAM_MAX_STREAM_BYTES_EXCEEDED,
    ]
    .contains(&c)
}

/// Whether JetStream's answer somewhere in `e`'s sources says the store is out of space.
fn is_full(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(j) = err.downcast_ref::<jetstream::Error>()
            && is_out_of_space(j.error_code())
        {
            return true;
        }
        if let Some(p) = err.downcast_ref::<context::PublishError>()
            && jetstream_code(p).is_some_and(is_out_of_space)
        {
            return true;
        }
        cur = err.source();
    }
    false
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
        assert!(StoreError::Full(nats()).is_retryable(), "a full store takes writes again once room is made");
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

    /// A publish answered by JetStream with `err_code`.
    fn answered(err_code: u64) -> context::PublishError {
        let answer: jetstream::Error =
            serde_json::from_value(serde_json::json!({"code": 503, "err_code": err_code, "description": "x"})).unwrap();
        context::PublishError::with_source(context::PublishErrorKind::Other, answer)
    }

    #[test]
    fn a_store_out_of_space_is_full_and_retryable() {
        // Insufficient resources (the server's storage), a stream at its byte limit.
        for code in [10023, 10047, 10077] {
            let e = StoreError::publish(answered(code));
            assert_eq!(e.kind(), "full", "{code}");
            assert!(e.is_retryable());
        }
        assert_eq!(StoreError::publish(answered(10054)).kind(), "too_large", "never fits");
        assert_eq!(StoreError::publish(answered(10059)).kind(), "refused", "no such stream");
        // A KV write whose publish was answered so.
        let kv_full = kv::UpdateError::with_source(kv::UpdateErrorKind::Other, answered(10023));
        assert_eq!(StoreError::kv_update(kv_full).kind(), "full");
        let kv_down = kv::UpdateError::new(kv::UpdateErrorKind::Other);
        assert_eq!(StoreError::kv_update(kv_down).kind(), "unavailable");
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
    /// Reads `REVIEWLANE_STORE_RETRIES`; the backoff between tries is fixed (100 ms
    /// doubling to 4 s: twelve tries take about 26 s, longer than a cluster's failover).
    pub fn from_reader(r: &mut reviewlane_core::config::Reader<'_>) -> StoreRetry {
        let s = StoreRetry {
            tries: r.or(reviewlane_core::env::STORE_RETRIES, StoreRetry::default().tries, "a count"),
            ..StoreRetry::default()
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
    pub async fn run<T, F, Fut, B, BFut>(&self, write: F, between: B) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
        B: FnMut(&StoreError, u32, std::time::Duration) -> BFut,
        BFut: Future<Output = ()>,
    {
        self.run_until(None, write, between).await
    }

    /// As [`run`](Self::run), but for a write whose work exists nowhere else (a paid
    /// answer not yet kept, a delivery made but not recorded): retryable failures —
    /// a full store, an outage — are retried with backoff for as long as it takes,
    /// until a try would start after `until` (the job's deadline). Without `until`, the
    /// budget of tries bounds it.
    pub async fn run_until<T, F, Fut, B, BFut>(
        &self,
        until: Option<tokio::time::Instant>,
        mut write: F,
        mut between: B,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
        B: FnMut(&StoreError, u32, std::time::Duration) -> BFut,
        BFut: Future<Output = ()>,
    {
        let mut attempt = 1;
        loop {
            let more = |attempt: u32, delay: std::time::Duration| match until {
                Some(until) => tokio::time::Instant::now() + delay < until,
                None => attempt < self.tries,
            };
            match write().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_retryable() && more(attempt, self.delay(attempt)) => {
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

    #[tokio::test(start_paused = true)]
    async fn a_write_with_a_deadline_is_retried_past_the_budget_until_the_deadline() {
        let r = StoreRetry { tries: 3, base: Duration::from_millis(10), cap: Duration::from_millis(100) };
        let full = || StoreError::Full(async_nats::Error::from("full"));
        // The store takes the write on the 20th try: far past the budget of 3.
        let mut calls = 0;
        let until = tokio::time::Instant::now() + Duration::from_secs(60);
        let res = r
            .run_until(
                Some(until),
                || {
                    calls += 1;
                    let n = calls;
                    async move { if n < 20 { Err(full()) } else { Ok(n) } }
                },
                |_: &StoreError, _, _| async {},
            )
            .await;
        assert_eq!(res.unwrap(), 20);
        // Never taken: tries stop at the deadline, not before, not after.
        let started = tokio::time::Instant::now();
        let until = started + Duration::from_secs(2);
        let res: Result<(), _> =
            r.run_until(Some(until), || async { Err(full()) }, |_: &StoreError, _, _| async {}).await;
        assert_eq!(res.unwrap_err().kind(), "full");
        let waited = tokio::time::Instant::now() - started;
        assert!(waited <= Duration::from_secs(2) && waited >= Duration::from_millis(1900), "{waited:?}");
    }
}
