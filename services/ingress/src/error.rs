//! The one place where errors become gRPC statuses. Messages say what is wrong with
//! the request, never what it contained; unknown failures become an opaque INTERNAL
//! (or UNAVAILABLE for NATS) with the cause logged.

use std::time::Duration;

use reviewlane_shared::job_store::StoreError;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use reviewlane_shared::api::ERROR_DOMAIN as DOMAIN;

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

    fn reason(self) -> &'static str {
        match self {
            AuthFailure::Missing => "API_KEY_MISSING",
            AuthFailure::Malformed => "API_KEY_MALFORMED",
            AuthFailure::Unknown => "API_KEY_INVALID",
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
    #[error("idempotency key already used for a different request")]
    AlreadyExists,
    /// `reason`: the `ErrorInfo` reason (`LANE_FULL`, `LANE_OVER_WINDOW`, ...).
    #[error("{what}; retry later")]
    ResourceExhausted { reason: &'static str, what: &'static str, retry_after: Duration },
    #[error("region store unavailable")]
    Unavailable(#[source] anyhow::Error),
    /// The region's store is out of space: nothing can be accepted until room is made.
    #[error("region store full")]
    StoreFull,
    /// The server cannot go on with a stream (shutting down, store connection lost).
    #[error("{what}")]
    StreamInterrupted { reason: &'static str, what: &'static str },
    /// The caller's key may not do this (`reason`: the `ErrorInfo` reason).
    #[error("{what}")]
    PermissionDenied { reason: &'static str, what: &'static str },
    /// The request cannot be served as things stand (`reason`: the `ErrorInfo` reason).
    #[error("{what}")]
    FailedPrecondition { reason: &'static str, what: &'static str },
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
            StoreError::Full(_) => ApiError::StoreFull,
            e if e.is_retryable() => ApiError::Unavailable(anyhow::anyhow!(e)),
            other => ApiError::Internal(anyhow::anyhow!(other)),
        }
    }
}

/// A status with `ErrorInfo` (reason, domain, content-free metadata) and, when set,
/// `RetryInfo`.
fn status(
    code: Code,
    message: impl Into<String>,
    reason: &str,
    metadata: &[(&str, &str)],
    retry: Option<Duration>,
    mut details: ErrorDetails,
) -> Status {
    let metadata: std::collections::HashMap<String, String> =
        metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    details.set_error_info(reason, DOMAIN, metadata);
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
                "INVALID_FIELD",
                &[("field", field)],
                None,
                ErrorDetails::with_bad_request_violation(field, description),
            ),
            ApiError::NotFound => status(Code::NotFound, "review not found", "REVIEW_NOT_FOUND", &[], None, none()),
            ApiError::AlreadyExists => status(
                Code::AlreadyExists,
                "idempotency key already used for a different request",
                "IDEMPOTENCY_KEY_REUSED",
                &[],
                None,
                none(),
            ),
            ApiError::ResourceExhausted { reason, what, retry_after } => {
                status(Code::ResourceExhausted, format!("{what}; retry later"), reason, &[], Some(retry_after), none())
            }
            ApiError::Unavailable(cause) => {
                tracing::warn!(error = %cause, "region store unavailable");
                status(
                    Code::Unavailable,
                    "region store unavailable; retry with the same idempotency key",
                    "REGION_STORE_UNAVAILABLE",
                    &[],
                    Some(UNAVAILABLE_RETRY),
                    none(),
                )
            }
            ApiError::StoreFull => {
                tracing::warn!("region store full");
                status(
                    Code::Unavailable,
                    "the region's store is full; retry later with the same idempotency key",
                    "REGION_STORE_FULL",
                    &[],
                    Some(STORE_FULL_RETRY),
                    none(),
                )
            }
            ApiError::StreamInterrupted { reason, what } => {
                status(Code::Unavailable, what, reason, &[], Some(UNAVAILABLE_RETRY), none())
            }
            ApiError::PermissionDenied { reason, what } => {
                status(Code::PermissionDenied, what, reason, &[], None, none())
            }
            ApiError::FailedPrecondition { reason, what } => {
                status(Code::FailedPrecondition, what, reason, &[], None, none())
            }
            ApiError::RequestTooLarge { limit } => {
                let description = format!(
                    "the request is over the server's limit of {limit} bytes; send a smaller diff (a large change can be split into several reviews)"
                );
                status(
                    Code::InvalidArgument,
                    description.clone(),
                    "REQUEST_TOO_LARGE",
                    &[("field", "diff"), ("limit_bytes", &limit.to_string())],
                    None,
                    ErrorDetails::with_bad_request_violation("diff", description),
                )
            }
            ApiError::Internal(cause) => {
                tracing::error!(error = %cause, "internal error");
                status(Code::Internal, "internal error", "INTERNAL", &[], None, none())
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
        let s: Status =
            ApiError::ResourceExhausted { reason: "LANE_FULL", what: "lane full", retry_after: Duration::from_secs(3) }
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
            ApiError::AlreadyExists,
            ApiError::ResourceExhausted {
                reason: "LANE_FULL",
                what: "lane is full",
                retry_after: Duration::from_secs(1),
            },
            ApiError::Unavailable(anyhow::anyhow!("timed out")),
            ApiError::StoreFull,
            ApiError::StreamInterrupted { reason: "SHUTTING_DOWN", what: "server shutting down; watch again" },
            ApiError::FailedPrecondition { reason: "CONTENT_EXPIRED", what: "content expired" },
            ApiError::PermissionDenied { reason: "OPERATOR_ROLE_REQUIRED", what: "operators only" },
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
