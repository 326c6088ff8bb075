//! Exit codes: what a CI job branches on. Pure.

use reviewlane_api::proto::{self, JobState};
use reviewlane_core::findings::severity_rank;
use tonic::Code;

/// Published, nothing at or above `--fail-on`.
pub const CLEAN: u8 = 0;
/// Published with findings at or above `--fail-on`.
pub const FINDINGS: u8 = 1;
/// The review ended without findings (the reason is printed).
pub const FAILED: u8 = 2;
/// The service refused the review for now (the retry delay is printed).
pub const REFUSED: u8 = 3;
/// The review's deadline passed, or `--wait-timeout` or `--request-timeout` ran out.
pub const DEADLINE: u8 = 4;
/// The request failed: authentication, an invalid request, the service unreachable.
pub const REQUEST_FAILED: u8 = 5;
/// The command line is wrong.
pub const USAGE: u8 = 64;

/// No answer to a request within `--request-timeout`.
#[derive(Debug, thiserror::Error)]
#[error("no answer within {} s (--request-timeout)", .0.as_secs_f64())]
pub struct NoAnswer(pub std::time::Duration);

/// The command's wait (`--wait-timeout`) ran out before a request was answered.
#[derive(Debug, thiserror::Error)]
#[error("no answer within the {} s the command waits (--wait-timeout)", .0.as_secs_f64())]
pub struct WaitRanOut(pub std::time::Duration);

/// The code for a review as it stands after waiting (`fail_on`: the lowest severity
/// that fails).
pub fn for_review(review: &proto::Review, fail_on: Option<&str>) -> u8 {
    match JobState::try_from(review.state) {
        Ok(JobState::Published) => {
            let threshold = fail_on.map(severity_rank);
            let failing = threshold.is_some_and(|t| review.findings.iter().any(|f| severity_rank(&f.severity) >= t));
            if failing { FINDINGS } else { CLEAN }
        }
        Ok(JobState::Terminal) if review.terminal_reason == "deadline_exceeded" => DEADLINE,
        Ok(JobState::Terminal) => FAILED,
        // Still under way when the wait ran out.
        _ => DEADLINE,
    }
}

/// The code for a request the service answered with an error.
pub fn for_status(status: &tonic::Status) -> u8 {
    match status.code() {
        Code::ResourceExhausted => REFUSED,
        // The request's deadline ran out (the client reports it as cancelled).
        Code::DeadlineExceeded | Code::Cancelled => DEADLINE,
        _ => REQUEST_FAILED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(state: JobState, reason: &str, severities: &[&str]) -> proto::Review {
        proto::Review {
            state: state as i32,
            terminal_reason: reason.into(),
            findings: severities
                .iter()
                .map(|s| proto::Finding { severity: s.to_string(), ..Default::default() })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn codes_follow_the_review_and_the_threshold() {
        let published = review(JobState::Published, "", &["low", "medium"]);
        assert_eq!(for_review(&published, None), CLEAN);
        assert_eq!(for_review(&published, Some("high")), CLEAN);
        assert_eq!(for_review(&published, Some("medium")), FINDINGS);
        assert_eq!(for_review(&published, Some("info")), FINDINGS);
        assert_eq!(for_review(&review(JobState::Published, "", &[]), Some("info")), CLEAN);
        assert_eq!(for_review(&review(JobState::Terminal, "upstream_rejected", &[]), None), FAILED);
        assert_eq!(for_review(&review(JobState::Terminal, "deadline_exceeded", &[]), None), DEADLINE);
        assert_eq!(for_review(&review(JobState::Running, "", &[]), None), DEADLINE);
    }

    #[test]
    fn refusals_and_request_failures_have_their_own_codes() {
        assert_eq!(for_status(&tonic::Status::resource_exhausted("lane full")), REFUSED);
        assert_eq!(for_status(&tonic::Status::unauthenticated("unknown API key")), REQUEST_FAILED);
        assert_eq!(for_status(&tonic::Status::invalid_argument("diff")), REQUEST_FAILED);
        assert_eq!(for_status(&tonic::Status::deadline_exceeded("late")), DEADLINE);
    }
}
