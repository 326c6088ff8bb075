//! What a delivery attempt came to, as every sink (webhook, file, GitHub) reports it.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkOutcome {
    Delivered,
    /// Worth another try later: 408, 425, 429, 5xx, timeout, connection error, I/O error.
    Transient(&'static str),
    /// The receiver refused it for good (3xx: redirects are not followed; other 4xx).
    Permanent(u16),
    /// We refused to send it: the target is not allowed for this tenant.
    Refused(&'static str),
    /// The receiver's rate limit: try again after this long (not before).
    RetryAfter(Duration),
    /// Not sent: the receiver's pause is in force, or it is not this delivery's turn
    /// yet (GitHub's pacing). Again after this long, spending no delivery attempt (the
    /// job's deadline bounds the waiting).
    Deferred(Duration),
}

impl SinkOutcome {
    /// Content-free class for spans and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            SinkOutcome::Delivered => "delivered",
            SinkOutcome::Transient(class) => class,
            SinkOutcome::Permanent(_) => "rejected",
            SinkOutcome::Refused(why) => why,
            SinkOutcome::RetryAfter(_) => "rate_limited",
            SinkOutcome::Deferred(_) => "deferred",
        }
    }
}
