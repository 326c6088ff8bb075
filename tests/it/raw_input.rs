//! Requests as raw bytes on the wire: a diff that is not UTF-8, a body that does not
//! decode, a body sent without a key. Each gets a specific status, never `INTERNAL`.

use reviewlane_api::proto::{self, SubmitReviewRequest};
use tonic::Code;
use tonic::codegen::http::uri::PathAndQuery;

use crate::harness::*;

const SUBMIT: &str = "/reviewlane.v1.ReviewService/SubmitReview";

/// `SubmitReviewRequest` with `diff` (field 3) as bytes: what a client that does not
/// check UTF-8 puts on the wire.
#[derive(Clone, PartialEq, prost::Message)]
struct RawSubmit {
    #[prost(string, tag = "1")]
    idempotency_key: String,
    #[prost(int32, tag = "2")]
    lane: i32,
    #[prost(bytes = "vec", tag = "3")]
    diff: Vec<u8>,
    #[prost(string, tag = "4")]
    schema_version: String,
}

/// `SubmitReviewRequest` with `idempotency_key` (field 1) and `diff` (field 3) as
/// bytes, the diff valid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawKey {
    #[prost(bytes = "vec", tag = "1")]
    idempotency_key: Vec<u8>,
    #[prost(int32, tag = "2")]
    lane: i32,
    #[prost(string, tag = "3")]
    diff: String,
}

/// Any bytes as the request message.
#[derive(Clone, PartialEq, prost::Message)]
struct Garbage {
    #[prost(bytes = "vec", tag = "3")]
    diff: Vec<u8>,
}

async fn raw_call<M: prost::Message + Send + Sync + 'static>(
    stack: &Stack,
    key: Option<&str>,
    msg: M,
) -> Result<proto::SubmitReviewResponse, tonic::Status> {
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", stack.ingress)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel).max_encoding_message_size(64 * 1024 * 1024);
    grpc.ready().await.unwrap();
    let mut req = tonic::Request::new(msg);
    if let Some(k) = key {
        req.metadata_mut().insert("authorization", format!("Bearer {k}").parse().unwrap());
    }
    let codec = tonic_prost::ProstCodec::<M, proto::SubmitReviewResponse>::default();
    grpc.unary(req, PathAndQuery::from_static(SUBMIT), codec).await.map(|r| r.into_inner())
}

/// A Rust change whose added line holds a Latin-1 byte (`é` as 0xE9) and a TODO.
fn latin1_diff() -> Vec<u8> {
    let mut d = b"diff --git a/src/names.rs b/src/names.rs\n--- a/src/names.rs\n+++ b/src/names.rs\n@@ -1,2 +1,3 @@\n fn names() {\n+    let n = \"Jos"
        .to_vec();
    d.push(0xe9);
    d.extend_from_slice(b"\"; // TODO: load from config\n }\n");
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diff_that_is_not_utf8_is_refused_in_the_string_field_and_reviewed_in_the_bytes_field() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;

    // In `diff` (a string): INVALID_ARGUMENT pointing to `diff_bytes`, never INTERNAL.
    let raw = RawSubmit {
        idempotency_key: "latin1-string".into(),
        lane: proto::Lane::Interactive as i32,
        diff: latin1_diff(),
        schema_version: "findings.v1".into(),
    };
    let err = raw_call(&stack, Some(US_KEY), raw).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("diff_bytes"), "{}", err.message());
    assert!(!err.message().contains("Jos"), "the message echoes content");

    // Another string field that is not UTF-8: INVALID_ARGUMENT naming it, and no hint
    // about `diff_bytes`, which is about the diff alone.
    let key =
        RawKey { idempotency_key: vec![b'k', 0xff], lane: proto::Lane::Interactive as i32, diff: sample_diff("k") };
    let err = raw_call(&stack, Some(US_KEY), key).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("SubmitReviewRequest.idempotency_key"), "{}", err.message());
    assert!(!err.message().contains("diff_bytes"), "{}", err.message());

    // Both forms at once: INVALID_ARGUMENT.
    let mut both = submit_req(US_KEY, "latin1-both", &sample_diff("a")).into_inner();
    both.diff_bytes = latin1_diff();
    let err = client.submit_review(authed(US_KEY, both)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("not both"), "{}", err.message());

    // In `diff_bytes`: reviewed. The model sees the line decoded with a replacement
    // character, and the finding quoting it validates against that decoded text.
    let req = SubmitReviewRequest {
        idempotency_key: "latin1-bytes".into(),
        lane: proto::Lane::Interactive as i32,
        diff_bytes: latin1_diff(),
        schema_version: "findings.v1".into(),
        ..Default::default()
    };
    let job = client.submit_review(authed(US_KEY, req.clone())).await.unwrap().into_inner().review.unwrap();
    let done = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(done.state, proto::JobState::Published as i32, "{done:?}");
    let todo = done.findings.iter().find(|f| f.path == "src/names.rs").expect("the finding on the line");
    assert_eq!((todo.path.as_str(), todo.line), ("src/names.rs", 2));
    assert!(todo.evidence.contains("Jos\u{fffd}\""), "{:?}", todo.evidence);
    // The same bytes again under the same key are the same job.
    let again = client.submit_review(authed(US_KEY, req)).await.unwrap().into_inner().review.unwrap();
    assert_eq!(again.job_id, job.job_id);

    // UTF-8 sent as bytes is the same request as the string form.
    let text = sample_diff("same");
    let first = submit(&mut client, US_KEY, "either-form", &text).await;
    let as_bytes = SubmitReviewRequest {
        idempotency_key: "either-form".into(),
        lane: proto::Lane::Interactive as i32,
        diff_bytes: text.into_bytes(),
        schema_version: "findings.v1".into(),
        metadata: submit_req(US_KEY, "x", "").into_inner().metadata,
        ..Default::default()
    };
    let second = client.submit_review(authed(US_KEY, as_bytes)).await.expect("same request").into_inner();
    assert_eq!(second.review.unwrap().job_id, first.job_id);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_comes_before_the_body_is_decoded() {
    let stack = Stack::start().await;

    // A body that does not decode (field 3 announces more bytes than follow).
    let broken = Garbage { diff: vec![0x1a, 0x09, b'x'] };
    // With a key: the caller's error, INVALID_ARGUMENT.
    let err = raw_call(&stack, Some(US_KEY), Garbage { diff: broken.diff.clone() }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    // Without one: UNAUTHENTICATED, the body never decoded.
    let err = raw_call(&stack, None, broken).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let err = raw_call(&stack, Some("not-a-key"), Garbage { diff: vec![0xff; 16] }).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    // A body over the decoding limit from a caller without a key is refused for the key,
    // not read to find out it is too large.
    let huge = Garbage { diff: vec![b'x'; 8 * 1024 * 1024] };
    let err = raw_call(&stack, None, huge).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");

    // The refusals are counted like any other outcome.
    let page = http_get(stack.ingress_admin, "/metrics").await;
    let refused: f64 = page
        .lines()
        .filter(|l| l.starts_with("reviewlane_rpc_requests_total{") && l.contains("UNAUTHENTICATED"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(refused, 3.0, "{page}");
    stack.shutdown().await;
}

/// `text` as `git diff --color=always` writes it to a terminal.
fn coloured(text: &str) -> String {
    text.lines()
        .map(|l| match l.as_bytes().first() {
            Some(b'+') if !l.starts_with("+++") => format!("\x1b[32m{l}\x1b[m\n"),
            Some(b'-') if !l.starts_with("---") => format!("\x1b[31m{l}\x1b[m\n"),
            Some(b'@') => format!("\x1b[36m{l}\x1b[m\n"),
            Some(b' ') | None => format!("{l}\n"),
            _ => format!("\x1b[1m{l}\x1b[m\n"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diff_pasted_with_its_colours_is_reviewed_as_the_plain_diff() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let plain = sample_diff("colours");
    let pasted = coloured(&plain);
    assert!(pasted.contains('\x1b') && pasted != plain);
    let job = submit(&mut client, US_KEY, "coloured", &pasted).await;
    let done = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(done.state, proto::JobState::Published as i32, "{done:?}");
    assert!(!done.findings.is_empty());
    assert_eq!(done.quarantined_count, 0);
    assert!(done.findings.iter().all(|f| !f.path.contains('\x1b') && !f.evidence.contains('\x1b')), "{done:?}");
    // The plain diff under the same key is the same request.
    let again = client.submit_review(submit_req(US_KEY, "coloured", &plain)).await.expect("same request");
    assert_eq!(again.into_inner().review.unwrap().job_id, job.job_id);

    // A plain diff whose lines hold escape codes (test data for coloured output): the
    // codes are the file's, kept, and the finding quotes the line as the file has it.
    let line = "\x1b[0m1\x1b[0m:\x1b[0m\x1b[31mSherlock\x1b[0m Holmes";
    let plain = format!(
        "diff --git a/tests/data/colour.txt b/tests/data/colour.txt\n--- a/tests/data/colour.txt\n+++ b/tests/data/colour.txt\n@@ -1 +1,2 @@\n \x1b[0m0\x1b[0m:start\n+{line}\n"
    );
    let job = submit(&mut client, US_KEY, "escape-codes", &plain).await;
    let done = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(done.state, proto::JobState::Published as i32, "{done:?}");
    assert_eq!((done.findings.len(), done.quarantined_count), (1, 0), "{done:?}");
    assert_eq!((done.findings[0].line, done.findings[0].evidence.as_str()), (2, line));
    // The same diff coloured by git is the same request.
    let again =
        client.submit_review(submit_req(US_KEY, "escape-codes", &coloured(&plain))).await.expect("same request");
    assert_eq!(again.into_inner().review.unwrap().job_id, job.job_id);
    stack.shutdown().await;
}
