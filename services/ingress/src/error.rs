//! The one place where errors become gRPC statuses. Messages say what is wrong with
//! the request, never what it contained; unknown failures become an opaque INTERNAL
//! (or UNAVAILABLE for NATS) with the cause logged.

use std::time::Duration;

use reviewlane_shared::job_store::StoreError;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use reviewlane_api::ERROR_DOMAIN as DOMAIN;
pub use reviewlane_api::Reason;

/// How long a caller should wait before retrying after `UNAVAILABLE`.
const UNAVAILABLE_RETRY: Duration = Duration::from_secs(1);
/// After `UNAVAILABLE` for a full store: room is made in seconds, not at once.
const STORE_FULL_RETRY: Duration = Duration::from_secs(5);

/// Why a caller is not authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    Missing,
    Malformed,
    Unknown,
}

impl AuthFailure {
    fn message(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing bearer API key",
            AuthFailure::Malformed => "malformed authorization header (expected `Bearer <key>`)",
            AuthFailure::Unknown => "unknown API key",
        }
    }

    fn reason(self) -> Reason {
        match self {
            AuthFailure::Missing => Reason::ApiKeyMissing,
            AuthFailure::Malformed => Reason::ApiKeyMalformed,
            AuthFailure::Unknown => Reason::ApiKeyInvalid,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{}", .0.message())]
    Unauthenticated(AuthFailure),
    #[error("{field}: {description}")]
    InvalidArgument { field: &'static str, description: String },
    #[error("review not found")]
    NotFound,
    #[error("sweep not found")]
    SweepNotFound,
    #[error("idempotency key already used for a different request")]
    AlreadyExists,
    /// `reason`: the `ErrorInfo` reason (`LANE_FULL`, `LANE_OVER_WINDOW`, ...).
    #[error("{what}; retry later")]
    ResourceExhausted { reason: Reason, what: &'static str, retry_after: Duration },
    /// The region's store failed the call: unavailable or full (`UNAVAILABLE`, retried
    /// with the same idempotency key), or refused it for good (`INTERNAL`).
    #[error("region store: {0}")]
    Store(#[source] StoreError),
    /// The server cannot go on with a stream (shutting down, store connection lost).
    #[error("{what}")]
    StreamInterrupted { reason: Reason, what: &'static str },
    /// The caller's key may not do this (`reason`: the `ErrorInfo` reason).
    #[error("{what}")]
    PermissionDenied { reason: Reason, what: &'static str },
    /// The request cannot be served as things stand (`reason`: the `ErrorInfo` reason).
    #[error("{what}")]
    FailedPrecondition { reason: Reason, what: std::borrow::Cow<'static, str> },
    /// The request is larger than the server decodes (`limit` bytes, the largest diff
    /// limit with room for the rest of the request).
    #[error("the request is over the server's limit of {limit} bytes")]
    RequestTooLarge { limit: usize },
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

impl ApiError {
    pub fn invalid(field: &'static str, description: impl Into<String>) -> Self {
        ApiError::InvalidArgument { field, description: description.into() }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound => ApiError::NotFound,
            e => ApiError::Store(e),
        }
    }
}

/// A status with `ErrorInfo` (reason, domain, content-free metadata) and, when set,
/// `RetryInfo`.
fn status(
    code: Code,
    message: impl Into<String>,
    reason: Reason,
    metadata: &[(&str, &str)],
    retry: Option<Duration>,
    mut details: ErrorDetails,
) -> Status {
    let metadata: std::collections::HashMap<String, String> =
        metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    details.set_error_info(reason.as_str(), DOMAIN, metadata);
    if let Some(delay) = retry {
        details.set_retry_info(Some(delay));
    }
    Status::with_error_details(code, message, details)
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let none = ErrorDetails::new;
        match e {
            ApiError::Unauthenticated(f) => status(Code::Unauthenticated, f.message(), f.reason(), &[], None, none()),
            ApiError::InvalidArgument { field, description } => status(
                Code::InvalidArgument,
                format!("{field}: {description}"),
                Reason::InvalidField,
                &[("field", field)],
                None,
                ErrorDetails::with_bad_request_violation(field, description),
            ),
            ApiError::NotFound => status(Code::NotFound, "review not found", Reason::ReviewNotFound, &[], None, none()),
            ApiError::SweepNotFound => {
                status(Code::NotFound, "sweep not found", Reason::SweepNotFound, &[], None, none())
            }
            ApiError::AlreadyExists => status(
                Code::AlreadyExists,
                "idempotency key already used for a different request",
                Reason::IdempotencyKeyReused,
                &[],
                None,
                none(),
            ),
            ApiError::ResourceExhausted { reason, what, retry_after } => {
                status(Code::ResourceExhausted, format!("{what}; retry later"), reason, &[], Some(retry_after), none())
            }
            ApiError::Store(e @ StoreError::Full(_)) => {
                tracing::warn!(error = %e, "region store full");
                status(
                    Code::Unavailable,
                    "the region's store is full; retry later with the same idempotency key",
                    Reason::RegionStoreFull,
                    &[],
                    Some(STORE_FULL_RETRY),
                    none(),
                )
            }
            ApiError::Store(e) if e.is_retryable() => {
                tracing::warn!(error = %e, kind = e.kind(), "region store unavailable");
                status(
                    Code::Unavailable,
                    "region store unavailable; retry with the same idempotency key",
                    Reason::RegionStoreUnavailable,
                    &[],
                    Some(UNAVAILABLE_RETRY),
                    none(),
                )
            }
            ApiError::Store(e) => {
                tracing::error!(error = %e, kind = e.kind(), "region store refused the call");
                status(Code::Internal, "internal error", Reason::Internal, &[], None, none())
            }
            ApiError::StreamInterrupted { reason, what } => {
                status(Code::Unavailable, what, reason, &[], Some(UNAVAILABLE_RETRY), none())
            }
            ApiError::PermissionDenied { reason, what } => {
                status(Code::PermissionDenied, what, reason, &[], None, none())
            }
            ApiError::FailedPrecondition { reason, what } => {
                status(Code::FailedPrecondition, what.into_owned(), reason, &[], None, none())
            }
            ApiError::RequestTooLarge { limit } => {
                let description = format!(
                    "the request is over the server's limit of {limit} bytes; send a smaller diff (a large change can be split into several reviews)"
                );
                status(
                    Code::InvalidArgument,
                    description.clone(),
                    Reason::RequestTooLarge,
                    &[("field", "diff"), ("limit_bytes", &limit.to_string())],
                    None,
                    ErrorDetails::with_bad_request_violation("diff", description),
                )
            }
            ApiError::Internal(cause) => {
                tracing::error!(error = %cause, "internal error");
                status(Code::Internal, "internal error", Reason::Internal, &[], None, none())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_argument_carries_a_field_violation() {
        let s: Status = ApiError::invalid("diff", "diff is empty").into();
        assert_eq!(s.code(), Code::InvalidArgument);
        let d = s.get_details_bad_request().unwrap();
        assert_eq!(d.field_violations[0].field, "diff");
    }

    #[test]
    fn resource_exhausted_carries_retry_info() {
        let s: Status = ApiError::ResourceExhausted {
            reason: Reason::LaneFull,
            what: "lane full",
            retry_after: Duration::from_secs(3),
        }
        .into();
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.get_details_retry_info().unwrap().retry_delay, Some(Duration::from_secs(3)));
        let info = s.get_details_error_info().unwrap();
        assert_eq!((info.reason.as_str(), info.domain.as_str()), ("LANE_FULL", DOMAIN));
    }

    #[test]
    fn internal_is_opaque() {
        let s: Status = ApiError::Internal(anyhow::anyhow!("secret detail")).into();
        assert_eq!(s.message(), "internal error");
        assert_eq!(s.get_details_error_info().unwrap().reason, "INTERNAL");
    }

    #[test]
    fn every_error_carries_error_info_and_every_unavailable_retry_info() {
        let all: Vec<ApiError> = vec![
            ApiError::Unauthenticated(AuthFailure::Unknown),
            ApiError::invalid("diff", "diff is empty"),
            ApiError::NotFound,
            ApiError::SweepNotFound,
            ApiError::AlreadyExists,
            ApiError::ResourceExhausted {
                reason: Reason::LaneFull,
                what: "lane is full",
                retry_after: Duration::from_secs(1),
            },
            ApiError::Store(StoreError::Timeout(async_nats::Error::from("timed out"))),
            ApiError::Store(StoreError::Full(async_nats::Error::from("full"))),
            ApiError::Store(StoreError::Corrupt),
            ApiError::StreamInterrupted { reason: Reason::ShuttingDown, what: "server shutting down; watch again" },
            ApiError::FailedPrecondition { reason: Reason::ContentExpired, what: "content expired".into() },
            ApiError::PermissionDenied { reason: Reason::OperatorRoleRequired, what: "operators only" },
            ApiError::RequestTooLarge { limit: 1024 },
            ApiError::Internal(anyhow::anyhow!("x")),
        ];
        for e in all {
            let s: Status = e.into();
            let info = s.get_details_error_info().unwrap_or_else(|| panic!("{s:?}"));
            assert!(!info.reason.is_empty() && info.domain == DOMAIN, "{s:?}");
            if matches!(s.code(), Code::Unavailable | Code::ResourceExhausted) {
                assert!(s.get_details_retry_info().is_some(), "{s:?}");
            }
        }
        let s: Status = ApiError::invalid("diff", "diff is empty").into();
        assert_eq!(s.get_details_error_info().unwrap().metadata.get("field").map(String::as_str), Some("diff"));
    }
}
