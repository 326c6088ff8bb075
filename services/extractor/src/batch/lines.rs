//! One result line of a provider batch, read into its custom id and what it says for
//! the item (`reviewlane_core::batch::LineResult`). A line's response is classified by
//! the same rules as a synchronous answer of that provider (`upstream::classify`,
//! `classify_anthropic`), so a batch answer is validated, rejected or retried exactly
//! as a lane answer would be. A line that cannot be read names no item: its item has no
//! line and counts as missing.

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use reviewlane_core::batch::{LineResult, Retryable};

use crate::upstream::{UpstreamOutcome, classify, classify_anthropic};

/// What a synchronous answer's class means for a batch line.
fn of_outcome(outcome: UpstreamOutcome) -> LineResult {
    match outcome {
        UpstreamOutcome::Ok { output, usage, .. } => LineResult::Succeeded { output, usage },
        UpstreamOutcome::RateLimited { .. } => LineResult::Retryable(Retryable::RateLimited),
        UpstreamOutcome::QuotaExhausted => LineResult::OutOfQuota,
        UpstreamOutcome::Transient { .. } => LineResult::Retryable(Retryable::Transient),
        UpstreamOutcome::Permanent { status } => LineResult::Rejected { status: Some(status) },
        UpstreamOutcome::ContentFiltered { .. } => LineResult::Rejected { status: None },
    }
}

/// A line of an OpenAI batch's output or error file:
/// `{"custom_id", "response": {"status_code", "body"} | null, "error": {"code"} | null}`.
/// A line without a response carries an error code instead, classified by kind
/// (`batch::line_error`): did not run, refused, or unknown (taken as not run).
pub fn openai(line: &[u8]) -> Option<(String, LineResult)> {
    openai_shaped(line, classify)
}

/// A line of an Azure OpenAI global batch's output or error file: OpenAI's shape (no
/// line `id`), its response read as a synchronous Azure answer is (a line the content
/// filter refused is refused for good).
pub fn azure(line: &[u8]) -> Option<(String, LineResult)> {
    openai_shaped(line, crate::upstream::classify_azure)
}

fn openai_shaped(line: &[u8], classify: crate::provider::Classify) -> Option<(String, LineResult)> {
    let v: serde_json::Value = serde_json::from_slice(line).ok()?;
    let id = v["custom_id"].as_str()?.to_string();
    let response = &v["response"];
    if let Some(status) = response["status_code"].as_u64().and_then(|s| u16::try_from(s).ok()) {
        let body = serde_json::to_vec(&response["body"]).unwrap_or_default();
        let outcome = classify(status, &HeaderMap::new(), &body, SystemTime::UNIX_EPOCH, Duration::ZERO);
        return Some((id, of_outcome(outcome)));
    }
    let code = v["error"]["code"].as_str()?;
    Some((id, reviewlane_core::batch::line_error(code)))
}

/// A line of an Anthropic batch's results:
/// `{"custom_id", "result": {"type": "succeeded", "message"} | {"type": "errored",
/// "error": {"error": {"type"}}} | {"type": "canceled"} | {"type": "expired"}}`. Only
/// `succeeded` lines are billed; an errored line is classified by its error type
/// (`batch::line_error`): refused for good as an `invalid_request_error` (or another
/// 4xx type), run again when the API failed, was overloaded or timed out.
pub fn anthropic(line: &[u8]) -> Option<(String, LineResult)> {
    let v: serde_json::Value = serde_json::from_slice(line).ok()?;
    let id = v["custom_id"].as_str()?.to_string();
    let r = &v["result"];
    let result = match r["type"].as_str()? {
        "succeeded" => {
            let body = serde_json::to_vec(&r["message"]).unwrap_or_default();
            of_outcome(classify_anthropic(200, &HeaderMap::new(), &body, SystemTime::UNIX_EPOCH, Duration::ZERO))
        }
        "errored" => match r["error"]["error"]["type"].as_str().or(r["error"]["type"].as_str()) {
            Some(kind) => reviewlane_core::batch::line_error(kind),
            None => LineResult::Retryable(Retryable::Unrecognised),
        },
        "canceled" => LineResult::Retryable(Retryable::Cancelled),
        "expired" => LineResult::Retryable(Retryable::Expired),
        _ => return None,
    };
    Some((id, result))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reviewlane_core::job::Tokens;

    const FINDINGS: &str = r#"{\"findings\":[]}"#;

    #[test]
    fn openai_lines_of_both_files_are_read_as_lane_answers_would_be() {
        let ok = format!(
            r#"{{"id":"batch_req_1","custom_id":"us_a","response":{{"status_code":200,"request_id":"r","body":{{"choices":[{{"message":{{"content":"{FINDINGS}"}}}}],"usage":{{"prompt_tokens":120,"completion_tokens":7}}}}}},"error":null}}"#
        );
        assert_eq!(
            openai(ok.as_bytes()),
            Some((
                "us_a".into(),
                LineResult::Succeeded {
                    output: r#"{"findings":[]}"#.into(),
                    usage: Some(Tokens { input: 120, output: 7 })
                }
            ))
        );
        let line = |status: u16, body: &str| {
            let l = format!(
                r#"{{"id":"batch_req_2","custom_id":"us_b","response":{{"status_code":{status},"body":{body}}},"error":null}}"#
            );
            openai(l.as_bytes()).map(|(_, r)| r)
        };
        let invalid = r#"{"error":{"type":"invalid_request_error","message":"bad"}}"#;
        assert_eq!(line(400, invalid), Some(LineResult::Rejected { status: Some(400) }));
        assert_eq!(line(500, "{}"), Some(LineResult::Retryable(Retryable::Transient)));
        assert_eq!(line(429, r#"{"error":{"type":"tokens"}}"#), Some(LineResult::Retryable(Retryable::RateLimited)));
        assert_eq!(line(429, r#"{"error":{"code":"insufficient_quota"}}"#), Some(LineResult::OutOfQuota));
        let never_ran = |code: &str| {
            let l = format!(
                r#"{{"id":"batch_req_3","custom_id":"us_c","response":null,"error":{{"code":"{code}","message":"m"}}}}"#
            );
            openai(l.as_bytes()).map(|(_, r)| r)
        };
        assert_eq!(never_ran("batch_expired"), Some(LineResult::Retryable(Retryable::Expired)));
        assert_eq!(never_ran("batch_cancelled"), Some(LineResult::Retryable(Retryable::Cancelled)));
        assert_eq!(never_ran("invalid_url"), Some(LineResult::Rejected { status: None }));
        assert_eq!(never_ran("request_timeout"), Some(LineResult::Retryable(Retryable::Transient)));
        assert_eq!(never_ran("brand_new_code"), Some(LineResult::Retryable(Retryable::Unrecognised)));
        // A malformed line names no item.
        assert_eq!(openai(b"{\"custom_id\": \"us_d\", \"respo"), None);
        assert_eq!(openai(br#"{"response":{"status_code":200,"body":{}}}"#), None);
    }

    #[test]
    fn anthropic_lines_are_read_by_result_type() {
        let ok = r#"{"custom_id":"us_a","result":{"type":"succeeded","message":{"content":[{"type":"tool_use","name":"report_findings","input":{"findings":[]}}],"usage":{"input_tokens":90,"output_tokens":11}}}}"#;
        assert_eq!(
            anthropic(ok.as_bytes()),
            Some((
                "us_a".into(),
                LineResult::Succeeded {
                    output: r#"{"findings":[]}"#.into(),
                    usage: Some(Tokens { input: 90, output: 11 })
                }
            ))
        );
        let errored = |kind: &str| {
            let l = format!(
                r#"{{"custom_id":"us_b","result":{{"type":"errored","error":{{"type":"error","error":{{"type":"{kind}","message":"m"}}}}}}}}"#
            );
            anthropic(l.as_bytes()).map(|(_, r)| r)
        };
        assert_eq!(errored("invalid_request_error"), Some(LineResult::Rejected { status: None }));
        assert_eq!(errored("api_error"), Some(LineResult::Retryable(Retryable::Transient)));
        assert_eq!(errored("overloaded_error"), Some(LineResult::Retryable(Retryable::Transient)));
        let typed = |t: &str| {
            let l = format!(r#"{{"custom_id":"us_c","result":{{"type":"{t}"}}}}"#);
            anthropic(l.as_bytes()).map(|(_, r)| r)
        };
        assert_eq!(typed("canceled"), Some(LineResult::Retryable(Retryable::Cancelled)));
        assert_eq!(typed("expired"), Some(LineResult::Retryable(Retryable::Expired)));
        assert_eq!(typed("unheard_of"), None);
        assert_eq!(anthropic(b"not json"), None);
    }
}
