use async_nats::jetstream;
use futures::StreamExt;
use reviewlane_api::proto::{self, SubmitReviewRequest};
use reviewlane_core::region::{Lane, Region};
use reviewlane_shared::layout;
use tonic::Code;
use tonic_types::StatusExt;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_invalid_argument_and_persist_nothing() {
    let stack = Stack::start_with(StackOptions { max_diff_bytes: 64 * 1024, ..Default::default() }).await;
    let mut client = stack.client().await;
    let canary = "CANARY-invalid-4c1d";
    let cases: Vec<(&str, String, &str, &str)> = vec![
        ("malformed", format!("this is not a diff {canary}\n"), "findings.v1", "no file header"),
        (
            "truncated hunk",
            format!("--- a/x.rs\n+++ b/x.rs\n@@ -1,3 +1,3 @@\n-{canary}\n"),
            "findings.v1",
            "hunk ends early",
        ),
        ("empty", String::new(), "findings.v1", "diff is empty"),
        (
            "hunk header that overflows",
            format!("--- a/x\n+++ b/x\n@@ -1,1 +4294967295,2 @@\n-{canary}\n+b\n+c\n"),
            "findings.v1",
            "line 3: hunk header numbers out of range",
        ),
        (
            "oversized",
            format!("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+{}\n", "x".repeat(70 * 1024)),
            "findings.v1",
            "over the limit of 65536 bytes",
        ),
        ("unknown schema", sample_diff("s"), "findings.v9", "unknown findings schema version"),
        (
            "combined merge diff",
            format!(
                "diff --cc src/x.rs\nindex 1,2..3\n--- a/src/x.rs\n+++ b/src/x.rs\n@@@ -1,1 -1,1 +1,1 @@@\n- {canary}\n -b\n++c\n"
            ),
            "findings.v1",
            "a combined diff of a merge (`git show --cc`, `git diff --cc`: one column per parent); send a two-way diff",
        ),
        (
            "word diff",
            format!(
                "diff --git a/x.rs b/x.rs\n--- a/x.rs\n+++ b/x.rs\n@@ -1,2 +1,2 @@\nfn a() {{}}\nlet x = [-1-]{{+{canary}+}};\n"
            ),
            "findings.v1",
            "word-diff output (`--word-diff`) has no line markers; send a line diff",
        ),
    ];
    for (name, diff, schema, expect) in cases {
        let req = authed(
            US_KEY,
            SubmitReviewRequest {
                idempotency_key: format!("bad-{name}"),
                lane: proto::Lane::Interactive as i32,
                diff,
                schema_version: schema.into(),
                metadata: None,
                ..Default::default()
            },
        );
        let err = client.submit_review(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{name}: {err:?}");
        assert!(err.message().contains(expect), "{name}: message `{}` should say `{expect}`", err.message());
        assert!(!err.message().contains(canary), "{name}: the message echoes content");
        let bad = err.get_details_bad_request().expect("field violation detail");
        assert!(!bad.field_violations.is_empty());
    }

    // Over the server's decoding limit (the diff limit plus 64 KiB): the same shape as
    // every other error, naming the limit — not tonic's bare OUT_OF_RANGE.
    let huge = format!("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+{}\n", "x".repeat(200 * 1024));
    let err = client.submit_review(submit_req(US_KEY, "huge", &huge)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let limit = 64 * 1024 + 64 * 1024;
    assert!(err.message().contains(&format!("over the server's limit of {limit} bytes")), "{}", err.message());
    let info = err.get_details_error_info().expect("ErrorInfo");
    assert_eq!(info.reason, "REQUEST_TOO_LARGE");
    assert_eq!(info.metadata.get("limit_bytes"), Some(&limit.to_string()));
    assert_eq!(err.get_details_bad_request().expect("field violation").field_violations[0].field, "diff");

    // Nothing persisted: no job record, no lane message.
    let js = jetstream::new(async_nats::connect(stack.us.nats.url()).await.unwrap());
    let jobs = js.get_key_value(layout::jobs_bucket(Region::Us)).await.unwrap();
    let keys: Vec<_> = jobs.keys().await.unwrap().collect().await;
    assert!(keys.is_empty(), "{keys:?}");
    for lane in Lane::ALL {
        let mut s = js.get_stream(layout::lane_stream(Region::Us, lane)).await.unwrap();
        assert_eq!(s.info().await.unwrap().state.messages, 0);
    }
    assert_eq!(stack.us.provider.stats().total_calls, 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diff_limit_above_the_grpc_default_takes_effect_and_is_the_limit_callers_meet() {
    // A 6 MiB limit: a 5 MiB diff (over tonic's 4 MiB default) is accepted and reviewed;
    // one over 6 MiB gets our INVALID_ARGUMENT naming the limit, not tonic's OUT_OF_RANGE.
    let limit = 6 * 1024 * 1024;
    let stack = Stack::start_with(StackOptions { max_diff_bytes: limit, ..Default::default() }).await;
    let mut client = stack.client().await;
    let big = |bytes: usize| {
        let line = format!("+{}\n", "x".repeat(99));
        let n = bytes / line.len();
        format!("--- a/big.txt\n+++ b/big.txt\n@@ -0,0 +1,{n} @@\n{}", line.repeat(n))
    };
    let accepted = submit(&mut client, US_KEY, "five-mib", &big(5 * 1024 * 1024)).await;
    assert_eq!(wait_final(&mut client, US_KEY, &accepted.job_id).await.state, proto::JobState::Published as i32);
    let err = client.submit_review(submit_req(US_KEY, "over", &big(limit + 1024))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains(&format!("over the limit of {limit} bytes")), "{}", err.message());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lane_is_resource_exhausted_with_retry_info_and_keeps_nothing() {
    use reviewlane_testkit::simprovider::SimConfig;
    use std::time::Duration;

    // Two messages fit; the one being processed still counts until it is acked.
    let stack = Stack::start_with(StackOptions {
        lane_max_messages: Some(2),
        extractor_concurrency: 1,
        us_provider: SimConfig { latency: Duration::from_millis(1500), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let a = submit(&mut client, US_KEY, "full-a", &sample_diff("a")).await;
    let b = submit(&mut client, US_KEY, "full-b", &sample_diff("b")).await;
    let err = client.submit_review(submit_req(US_KEY, "full-c", &sample_diff("c"))).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let retry = err.get_details_retry_info().expect("RetryInfo detail");
    assert!(retry.retry_delay.is_some_and(|d| d > Duration::ZERO));
    // The lane at its bound shows as a full store to dashboards and alerts.
    let lane = layout::lane_stream(Region::Us, Lane::Interactive);
    let sample = format!(r#"reviewlane_store_used_ratio{{region="us",store="{lane}"}} 1.0"#);
    let admin = stack.extractor_admin[0].1;
    let seen = poll_until(Duration::from_secs(5), || async {
        http_get(admin, "/metrics").await.lines().any(|l| l == sample).then_some(())
    })
    .await;
    assert!(seen.is_some(), "no {sample}");

    // The refused request left no record; the two accepted ones finish, after which the
    // same request goes through.
    let c_id = reviewlane_core::job_id::derive(Region::Us, "acme", "full-c");
    assert_eq!(get(&mut client, US_KEY, &c_id).await.unwrap_err().code(), Code::NotFound);
    for id in [&a.job_id, &b.job_id] {
        assert_eq!(wait_final(&mut client, US_KEY, id).await.state, proto::JobState::Published as i32);
    }
    let c = submit(&mut client, US_KEY, "full-c", &sample_diff("c")).await;
    assert_eq!(c.job_id, c_id);
    assert_eq!(wait_final(&mut client, US_KEY, &c.job_id).await.state, proto::JobState::Published as i32);
    stack.shutdown().await;
}
