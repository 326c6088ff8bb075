//! Telemetry a user relies on: one trace per job across the three services, with the
//! documented spans and attributes; and no content — diff text, model output, file
//! paths, repository names — in any span, span event, log line or metric sample, on
//! the success, 429, invalid-output and terminal paths.
//!
//! The services run in this process, so the process's subscriber (installed once by
//! `capture()`) sees their logs and spans; trace context still travels between them
//! only through gRPC metadata and NATS headers.

use std::collections::HashMap;
use std::time::Duration;

use opentelemetry::trace::SpanId;
use opentelemetry_sdk::trace::SpanData;
use reviewlane_api::proto::{self, JobState, SubmitReviewRequest};
use reviewlane_shared::testing::capture;
use reviewlane_testkit::simprovider::Scripted;

use crate::harness::*;

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.to_string())
}

/// Finished spans of one trace, waiting until `names` have all ended.
async fn trace_spans(trace_id: opentelemetry::trace::TraceId, names: &[&str]) -> Vec<SpanData> {
    let of_trace = || -> Vec<SpanData> {
        let finished = capture().spans.get_finished_spans().unwrap();
        finished.into_iter().filter(|s| s.span_context.trace_id() == trace_id).collect()
    };
    let all = poll_until(Duration::from_secs(10), || {
        let spans = of_trace();
        async move { names.iter().all(|n| spans.iter().any(|s| s.name == *n)).then_some(spans) }
    });
    all.await.unwrap_or_else(|| {
        let seen: Vec<_> = of_trace().iter().map(|s| s.name.to_string()).collect();
        panic!("missing spans; seen {seen:?}")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_follows_a_job_through_ingress_extractor_and_publisher() {
    capture();
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    // The caller's own trace: ours continues it.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut req = submit_req(US_KEY, "traced", &sample_diff("traced"));
    req.metadata_mut().insert("traceparent", format!("00-{caller_trace}-00f067aa0ba902b7-01").parse().unwrap());
    let job = client.submit_review(req).await.unwrap().into_inner().review.unwrap();
    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);

    let trace_id = opentelemetry::trace::TraceId::from_hex(caller_trace).unwrap();
    let names = [
        "reviewlane.v1.ReviewService/SubmitReview",
        "enqueue",
        "process review",
        "provider.attempt",
        "validate",
        "findings.publish",
        "publish findings",
        "sink.deliver",
    ];
    let spans = trace_spans(trace_id, &names).await;
    let by_name: HashMap<&str, &SpanData> = spans.iter().map(|s| (s.name.as_ref(), s)).collect();
    let span = |n: &str| *by_name.get(n).unwrap();

    // Parented across the process boundaries: gRPC -> enqueue -> (NATS) process ->
    // findings.publish -> (NATS) publish.
    let rpc = span("reviewlane.v1.ReviewService/SubmitReview");
    assert_eq!(rpc.parent_span_id, SpanId::from_hex("00f067aa0ba902b7").unwrap());
    assert_eq!(span("enqueue").parent_span_id, rpc.span_context.span_id());
    assert_eq!(span("process review").parent_span_id, span("enqueue").span_context.span_id());
    assert!(span("process review").parent_span_is_remote);
    assert_eq!(span("provider.attempt").parent_span_id, span("process review").span_context.span_id());
    assert_eq!(span("findings.publish").parent_span_id, span("process review").span_context.span_id());
    assert_eq!(span("publish findings").parent_span_id, span("findings.publish").span_context.span_id());
    assert_eq!(span("sink.deliver").parent_span_id, span("publish findings").span_context.span_id());

    let expect = |name: &str, pairs: &[(&str, &str)]| {
        let s = span(name);
        for (k, v) in pairs {
            assert_eq!(attr(s, k).as_deref(), Some(*v), "{name}.{k}: {:?}", s.attributes);
        }
    };
    let id = job.job_id.as_str();
    let job_attrs = [
        ("job_id", id),
        ("tenant", "acme"),
        ("region", "us"),
        ("lane", "interactive"),
        ("schema_version", "findings.v1"),
    ];
    expect("reviewlane.v1.ReviewService/SubmitReview", &job_attrs);
    expect(
        "reviewlane.v1.ReviewService/SubmitReview",
        &[
            ("rpc.system", "grpc"),
            ("rpc.method", "SubmitReview"),
            ("rpc.grpc.status_code", "0"),
            ("review_depth", "full"),
        ],
    );
    let lane_subject = format!("reviews.us.interactive.acme.{id}");
    expect(
        "enqueue",
        &[("messaging.system", "nats"), ("messaging.destination.name", lane_subject.as_str()), ("job_id", id)],
    );
    expect("process review", &job_attrs);
    expect(
        "process review",
        &[("messaging.system", "nats"), ("review_depth", "full"), ("outcome", "validated"), ("provider", "openai")],
    );
    expect("provider.attempt", &[("attempt", "1"), ("outcome", "ok"), ("status_class", "2xx")]);
    for key in ["queue_wait_ms", "duration_ms"] {
        assert!(attr(span("provider.attempt"), key).is_some(), "provider.attempt.{key}");
    }
    expect("validate", &[("result", "valid"), ("schema_version", "findings.v1")]);
    assert!(attr(span("validate"), "findings").is_some());
    expect("publish findings", &job_attrs);
    expect("publish findings", &[("outcome", "published"), ("messaging.system", "nats")]);
    expect("sink.deliver", &[("sink", "webhook"), ("result", "delivered")]);

    // JSON log lines of the job carry its trace id.
    let logs = capture().log_text();
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["job_id"] == id)
        .collect();
    assert!(lines.iter().any(|l| l["message"] == "provider answered"), "extractor logs for the job");
    assert!(lines.iter().any(|l| l["message"] == "delivered"), "publisher logs for the job");
    assert!(lines.iter().all(|l| l["trace_id"] == caller_trace), "{lines:#?}");
    stack.shutdown().await;
}

const CANARY: &str = "CANARY-7d1f3c9e-content-must-not-leak";
const CANARY_PATH: &str = "services/zebra_canary_path_91c2/ledger_q7.rs";
const CANARY_REPO: &str = "canary-org-5e8a/repo-name-b3f1";

fn canary_diff(tag: &str) -> String {
    format!(
        "diff --git a/{CANARY_PATH} b/{CANARY_PATH}\nindex 1111111..2222222 100644\n--- a/{CANARY_PATH}\n+++ b/{CANARY_PATH}\n@@ -1,3 +1,5 @@\n fn handle(req: Request) -> Response {{\n+    let user = lookup(req.id).unwrap(); // {CANARY} {tag}\n+    // TODO: {CANARY}\n     respond(user)\n }}\n"
    )
}

fn canary_req(idem: &str, diff: String) -> tonic::Request<SubmitReviewRequest> {
    authed(
        US_KEY,
        SubmitReviewRequest {
            idempotency_key: idem.into(),
            lane: proto::Lane::Interactive as i32,
            diff,
            schema_version: "findings.v1".into(),
            metadata: Some(proto::ReviewMetadata {
                repository: CANARY_REPO.into(),
                base_revision: format!("base-{CANARY}"),
                head_revision: format!("head-{CANARY}"),
                ..Default::default()
            }),
            ..Default::default()
        },
    )
}

fn needles(text: &str) -> Vec<&'static str> {
    [CANARY, CANARY_PATH, CANARY_REPO, "zebra_canary_path", "canary-org-5e8a"]
        .into_iter()
        .filter(|n| text.contains(n))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_content_reaches_spans_logs_or_metrics_on_any_path() {
    capture();
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let mut jobs = Vec::new();

    // Success (the findings name the canary path and are delivered).
    let ok =
        client.submit_review(canary_req("canary-ok", canary_diff("ok"))).await.unwrap().into_inner().review.unwrap();
    let last = wait_final(&mut client, US_KEY, &ok.job_id).await;
    assert_eq!(last.state, JobState::Published as i32);
    let delivered = stack.webhook.for_job(&ok.job_id);
    assert!(String::from_utf8_lossy(&delivered[0].body).contains(CANARY_PATH), "content did flow to the sink");
    jobs.push(ok.job_id);

    // 429 with a hint, then an output that is not JSON and echoes the diff, then one
    // naming a file outside the diff (quarantined), then success.
    stack.us.provider.script([
        Scripted::Status {
            status: 429,
            headers: vec![("retry-after".into(), "1".into())],
            body: format!(r#"{{"error":{{"code":"rate_limit_exceeded","message":"{CANARY}"}}}}"#),
        },
        Scripted::Output(format!("not json at all: {CANARY} {CANARY_PATH}")),
    ]);
    let diff = canary_diff("second");
    let retried = client.submit_review(canary_req("canary-429", diff)).await.unwrap().into_inner().review.unwrap();
    let last = wait_final(&mut client, US_KEY, &retried.job_id).await;
    assert_eq!(last.state, JobState::Published as i32);
    let a = last.attempts.unwrap();
    assert_eq!((a.congestion, a.schema), (1, 1), "went through the 429 and invalid-output paths");
    jobs.push(retried.job_id);

    // Invalid output until the schema budget is spent: terminal.
    let garbage = Scripted::Output(format!("{{\"findings\": \"{CANARY}\"}}"));
    stack.us.provider.script([garbage.clone(), garbage.clone(), garbage]);
    let diff = canary_diff("third");
    let invalid = client.submit_review(canary_req("canary-invalid", diff)).await.unwrap().into_inner().review.unwrap();
    let last = wait_final(&mut client, US_KEY, &invalid.job_id).await;
    assert_eq!(last.terminal_reason, "invalid_output");
    jobs.push(invalid.job_id);

    // Rejected by the provider (the error body echoes content): terminal at once.
    stack.us.provider.script([Scripted::Status {
        status: 400,
        headers: vec![],
        body: format!(r#"{{"error":{{"message":"bad request near {CANARY} in {CANARY_PATH}"}}}}"#),
    }]);
    let diff = canary_diff("fourth");
    let rejected = client.submit_review(canary_req("canary-400", diff)).await.unwrap().into_inner().review.unwrap();
    let last = wait_final(&mut client, US_KEY, &rejected.job_id).await;
    assert_eq!(last.terminal_reason, "upstream_rejected");
    jobs.push(rejected.job_id);

    // A diff the ingress refuses: the error names the problem, not the content.
    let err = client.submit_review(canary_req("canary-bad", format!("{CANARY}\n{CANARY_PATH}\n"))).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(needles(err.message()).is_empty(), "error message: {}", err.message());

    // Spans (names, attributes, events) of every trace these jobs touched.
    let finished = || capture().spans.get_finished_spans().unwrap();
    let all_done = |spans: &[opentelemetry_sdk::trace::SpanData]| {
        jobs.iter().all(|j| {
            spans.iter().any(|s| s.name == "publish findings" && attr(s, "job_id").as_deref() == Some(j))
                || spans.iter().any(|s| {
                    s.name == "process review"
                        && attr(s, "job_id").as_deref() == Some(j)
                        && attr(s, "outcome").as_deref() == Some("terminal")
                })
        })
    };
    // Checked as they stand after 10 s at most (the checks below say what is missing).
    let spans = poll_until(Duration::from_secs(10), || async {
        let spans = finished();
        all_done(&spans).then_some(spans)
    })
    .await
    .unwrap_or_else(finished);
    let mut checked = 0;
    for s in &spans {
        let mut text = format!("{} {:?} {:?}", s.name, s.attributes, s.status);
        for e in s.events.iter() {
            text.push_str(&format!(" {} {:?}", e.name, e.attributes));
        }
        assert!(needles(&text).is_empty(), "content in span {}: {text}", s.name);
        if jobs.iter().any(|j| text.contains(j.as_str())) {
            checked += 1;
        }
    }
    assert!(checked >= 20, "spans of the canary jobs were captured ({checked})");

    // Every log line written so far.
    let logs = capture().log_text();
    for line in logs.lines() {
        assert!(needles(line).is_empty(), "content in a log line: {line}");
    }
    for j in &jobs {
        assert!(logs.contains(j.as_str()), "log lines of {j} were captured");
    }
    assert!(logs.contains("invalid provider output") && logs.contains("retry scheduled"));

    // Every metric sample of every service.
    let mut admins = vec![stack.ingress_admin];
    admins.extend(stack.extractor_admin.iter().map(|(_, a)| *a));
    admins.extend(stack.publisher_admin.iter().map(|(_, a)| *a));
    for addr in admins {
        let page = http_get(addr, "/metrics").await;
        assert!(needles(&page).is_empty(), "content in metrics of {addr}:\n{page}");
    }
    stack.shutdown().await;
}

/// The value of the sample of `family` whose labels include every one of `labels`.
fn sample(page: &str, family: &str, labels: &[&str]) -> Option<f64> {
    page.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counters_alerts_watch_exist_at_zero_before_their_first_event() {
    // Before any review: `increase()` over a series born at its first event reads 0,
    // so each series an alert watches is exposed from the start.
    let stack = Stack::start().await;
    let (_, extractor) = stack.extractor_admin.iter().find(|(r, _)| *r == reviewlane_shared::Region::Us).unwrap();
    let page = http_get(*extractor, "/metrics").await;
    for outcome in ["insufficient_quota", "rate_limited", "ok"] {
        let labels = [r#"region="us""#, r#"tenant="acme""#, &format!(r#"outcome="{outcome}""#)];
        assert_eq!(sample(&page, "reviewlane_upstream_responses_total", &labels), Some(0.0), "{outcome}:\n{page}");
    }
    for reason in ["rate_limit_budget_exhausted", "transient_budget_exhausted", "invalid_output"] {
        let labels = [r#"region="us""#, r#"lane="interactive""#, &format!(r#"reason="{reason}""#)];
        assert_eq!(sample(&page, "reviewlane_jobs_terminal_total", &labels), Some(0.0), "{reason}");
    }
    assert_eq!(sample(&page, "reviewlane_job_attempts_count", &[r#"lane="batch""#]), Some(0.0));
    assert_eq!(sample(&page, "reviewlane_reconciled_jobs_total", &[r#"reason="ended""#]), Some(0.0));
    for (_, publisher) in &stack.publisher_admin {
        let page = http_get(*publisher, "/metrics").await;
        for reason in ["delivery_rejected", "delivery_budget_exhausted"] {
            let labels = [r#"lane="batch""#, &format!(r#"reason="{reason}""#)];
            assert_eq!(sample(&page, "reviewlane_jobs_terminal_total", &labels), Some(0.0), "{reason}:\n{page}");
        }
    }
    let page = http_get(stack.ingress_admin, "/metrics").await;
    assert_eq!(
        sample(&page, "reviewlane_jobs_terminal_total", &[r#"region="eu""#, r#"reason="deadline_exceeded""#]),
        Some(0.0)
    );
    stack.shutdown().await;
}
