use async_nats::jetstream;
use futures::StreamExt;
use reviewlane_shared::layout;
use reviewlane_shared::proto::{self, SubmitReviewRequest};
use reviewlane_shared::region::{Lane, Region};
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
            "oversized",
            format!("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+{}\n", "x".repeat(70 * 1024)),
            "findings.v1",
            "over the limit of 65536 bytes",
        ),
        ("unknown schema", sample_diff("s"), "findings.v9", "unknown findings schema version"),
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
            },
        );
        let err = client.submit_review(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{name}: {err:?}");
        assert!(err.message().contains(expect), "{name}: message `{}` should say `{expect}`", err.message());
        assert!(!err.message().contains(canary), "{name}: the message echoes content");
        let bad = err.get_details_bad_request().expect("field violation detail");
        assert!(!bad.field_violations.is_empty());
    }

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
