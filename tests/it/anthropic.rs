//! The Anthropic Messages adapter against the simulated provider in its Anthropic mode:
//! findings through a forced tool call whose schema is Anthropic's dialect, 429 with
//! `retry-after` honoured, 529 (overloaded) retried as transient, 413 never retried.

use std::time::Duration;

use reviewlane_api::proto::JobState;
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_testkit::simprovider::{Scripted, SimConfig};

use crate::harness::*;

async fn anthropic_stack() -> Stack {
    Stack::start_with(StackOptions {
        anthropic: true,
        // A schema Anthropic would refuse is answered 400, as the real API does.
        us_provider: SimConfig { enforce_dialect: Some(SchemaDialect::Anthropic), ..Default::default() },
        ..Default::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn findings_come_back_through_the_forced_tool_call() {
    let stack = anthropic_stack().await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "anthropic", &sample_diff("a")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    assert!(!last.findings.is_empty());
    let t = last.tokens.unwrap();
    assert_eq!((t.input, t.output), (100, 50), "usage.input_tokens / output_tokens");
    let stats = stack.us.provider.stats();
    assert_eq!(stats.schemas_refused, 0);
    let shape = stats.last_request.unwrap();
    assert_eq!(shape.response_format, "tool_choice:tool");
    assert!(shape.schema_has_findings && shape.bearer, "{shape:?}");
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_overload_and_rejections_take_their_own_paths() {
    let stack = anthropic_stack().await;
    let mut client = stack.client().await;
    let err = |t: &str| format!(r#"{{"type":"error","error":{{"type":"{t}","message":"m"}}}}"#);

    // 429 with retry-after 1: the next call waits for it.
    stack.us.provider.script([Scripted::Status {
        status: 429,
        headers: vec![("retry-after".into(), "1".into())],
        body: err("rate_limit_error"),
    }]);
    let job = submit(&mut client, US_KEY, "a-429", &sample_diff("429")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.attempts.unwrap().congestion), (JobState::Published as i32, 1), "{last:?}");
    let times = stack.us.provider.stats().call_times_ms[&job.job_id].clone();
    assert!(times[1] - times[0] >= 1000, "{times:?}");

    // 529 overloaded: transient, retried.
    stack.us.provider.script([Scripted::Status { status: 529, headers: vec![], body: err("overloaded_error") }]);
    let job = submit(&mut client, US_KEY, "a-529", &sample_diff("529")).await;
    let last = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(30)).await;
    assert_eq!((last.state, last.attempts.unwrap().transient), (JobState::Published as i32, 1), "{last:?}");

    // 413 request too large: permanent, one call.
    stack.us.provider.script([Scripted::Status { status: 413, headers: vec![], body: err("request_too_large") }]);
    let job = submit(&mut client, US_KEY, "a-413", &sample_diff("413")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "upstream_rejected"));
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&job.job_id), Some(&1));
    stack.shutdown().await;
}
