//! The one place where errors become gRPC statuses. Messages say what is wrong with
//! the request, never what it contained; unknown failures become an opaque INTERNAL
//! (or UNAVAILABLE for NATS) with the cause logged.

use std::time::Duration;

use reviewlane_shared::job_store::StoreError;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Unauthenticated(&'static str),
    #[error("{field}: {description}")]
    InvalidArgument { field: &'static str, description: String },
    #[error("review not found")]
    NotFound,
    #[error("idempotency key already used for a different request")]
    AlreadyExists,
    #[error("{what}; retry later")]
    ResourceExhausted { what: &'static str, retry_after: Duration },
    #[error("region store unavailable")]
    Unavailable(#[source] anyhow::Error),
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
            e if e.is_retryable() => ApiError::Unavailable(anyhow::anyhow!(e)),
            other => ApiError::Internal(anyhow::anyhow!(other)),
        }
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        match e {
            ApiError::Unauthenticated(m) => Status::unauthenticated(m),
            ApiError::InvalidArgument { field, description } => Status::with_error_details(
                Code::InvalidArgument,
                format!("{field}: {description}"),
                ErrorDetails::with_bad_request_violation(field, description),
            ),
            ApiError::NotFound => Status::not_found("review not found"),
            ApiError::AlreadyExists => Status::already_exists("idempotency key already used for a different request"),
            ApiError::ResourceExhausted { what, retry_after } => Status::with_error_details(
                Code::ResourceExhausted,
                format!("{what}; retry later"),
                ErrorDetails::with_retry_info(Some(retry_after)),
            ),
            ApiError::Unavailable(cause) => {
                tracing::warn!(error = %cause, "region store unavailable");
                Status::unavailable("region store unavailable; retry with the same idempotency key")
            }
            ApiError::Internal(cause) => {
                tracing::error!(error = %cause, "internal error");
                Status::internal("internal error")
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
        let s: Status = ApiError::ResourceExhausted { what: "lane full", retry_after: Duration::from_secs(3) }.into();
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.get_details_retry_info().unwrap().retry_delay, Some(Duration::from_secs(3)));
    }

    #[test]
    fn internal_is_opaque() {
        let s: Status = ApiError::Internal(anyhow::anyhow!("secret detail")).into();
        assert_eq!(s.message(), "internal error");
    }
}
