use std::time::Duration;

use reviewlane_api::proto::{CancelReviewRequest, JobState};
use reviewlane_core::region::Region;
use reviewlane_shared::layout;
use reviewlane_testkit::simprovider::{Scripted, SimConfig};

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_before_the_provider_call_and_after_publication() {
    // One slot and a slow provider: the second job waits on its lane while we cancel it.
    let stack = Stack::start_with(StackOptions {
        extractor_concurrency: 1,
        us_provider: SimConfig { latency: Duration::from_millis(1500), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let a = submit(&mut client, US_KEY, "cancel-a", &sample_diff("a")).await;
    assert!(
        eventually(Duration::from_secs(5), || stack.us.provider.stats().calls_by_job.contains_key(&a.job_id)).await
    );
    let b = submit(&mut client, US_KEY, "cancel-b", &sample_diff("b")).await;
    let cancelled = client
        .cancel_review(authed(US_KEY, CancelReviewRequest { job_id: b.job_id.clone() }))
        .await
        .unwrap()
        .into_inner()
        .review
        .unwrap();
    assert_eq!(cancelled.state, JobState::Terminal as i32);
    assert_eq!(cancelled.terminal_reason, "cancelled");

    // B's content is dropped at the cancel: its message leaves the lane at once, and
    // nothing of it reaches the dead letters (a cancel is not a failure to look into).
    let url = stack.us.nats.url().to_string();
    let lane = stream_messages(&url, &layout::lane_stream(Region::Us, reviewlane_shared::Lane::Interactive)).await;
    let b_subject = layout::lane_subject(
        Region::Us,
        reviewlane_shared::Lane::Interactive,
        "acme",
        reviewlane_core::job::ReviewDepth::Full,
        &b.job_id,
    );
    assert!(lane.iter().all(|(s, _, _)| *s != b_subject), "cancelled review still on the lane");
    assert_eq!(wait_final(&mut client, US_KEY, &a.job_id).await.state, JobState::Published as i32);
    assert!(stream_messages(&url, &layout::deadletter_stream(Region::Us)).await.is_empty());
    assert!(stream_messages(&url, &layout::deadletter_content_stream(Region::Us)).await.is_empty());
    assert!(!stack.us.provider.stats().calls_by_job.contains_key(&b.job_id));
    assert!(stack.webhook.for_job(&b.job_id).is_empty());

    // Cancelling a published job changes nothing.
    let again = client
        .cancel_review(authed(US_KEY, CancelReviewRequest { job_id: a.job_id.clone() }))
        .await
        .unwrap()
        .into_inner()
        .review
        .unwrap();
    assert_eq!(again.state, JobState::Published as i32);
    assert!(!again.findings.is_empty());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_acks_keep_the_lease_through_a_call_longer_than_it() {
    let stack = Stack::start_with(StackOptions {
        lease: Duration::from_secs(1),
        us_provider: SimConfig { latency: Duration::from_millis(2600), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "long-call", &sample_diff("long")).await;
    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    // Without progress acks the message would be redelivered after 1 s and called again.
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&job.job_id), Some(&1));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_output_spends_the_schema_budget_then_ends_terminal() {
    let stack = Stack::start().await;
    // Budget 2: the first answer and two retries are malformed.
    stack.eu.provider.script([
        Scripted::Output("not json".into()),
        Scripted::Output("{\"findings\": \"nope\"}".into()),
        Scripted::Output("[]".into()),
    ]);
    let mut client = stack.client().await;
    let job = submit(&mut client, EU_KEY, "bad-output", &sample_diff("bad")).await;
    let last = wait_final(&mut client, EU_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Terminal as i32);
    assert_eq!(last.terminal_reason, "invalid_output");
    assert_eq!(last.attempts.unwrap().schema, 2);
    assert_eq!(stack.eu.provider.stats().calls_by_job.get(&job.job_id), Some(&3));
    assert!(stack.webhook.for_job(&job.job_id).is_empty());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_request_is_terminal_at_once_and_the_adapter_speaks_structured_outputs() {
    let stack = Stack::start().await;
    stack.us.provider.script([Scripted::Status { status: 401, headers: vec![], body: "{\"error\":{}}".into() }]);
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "unauthorized", &sample_diff("401")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "upstream_rejected"));
    let a = last.attempts.unwrap();
    assert_eq!((a.congestion, a.transient, a.schema), (0, 0, 0));
    let stats = stack.us.provider.stats();
    assert_eq!(stats.calls_by_job.get(&job.job_id), Some(&1), "never retried");

    let shape = stats.last_request.unwrap();
    assert_eq!(shape.model, "sim");
    assert_eq!(shape.response_format, "json_schema");
    assert!(shape.strict && shape.schema_has_findings && shape.bearer, "{shape:?}");

    // The dead letter: a reference an operator can act on, without content, and the
    // content beside it under its own retention. It is written right after the
    // terminal record (a holder whose lease was taken over writes neither).
    let url = stack.us.nats.url().to_string();
    let refs = poll_until(Duration::from_secs(5), || async {
        Some(stream_messages(&url, &layout::deadletter_stream(Region::Us)).await).filter(|r| !r.is_empty())
    })
    .await
    .unwrap_or_default();
    let (subject, _, body) = refs.first().expect("a dead-letter reference");
    assert_eq!(*subject, layout::deadletter_subject(Region::Us, "acme", &job.job_id));
    let dead: reviewlane_core::messages::DeadLetter = serde_json::from_slice(body).unwrap();
    assert_eq!(
        (dead.job_id.as_str(), dead.tenant.as_str(), dead.reason.as_str()),
        (job.job_id.as_str(), "acme", "upstream_rejected")
    );
    assert_eq!(dead.input_digest, reviewlane_core::job_id::sha256_hex(&[sample_diff("401").as_bytes()]));
    assert!(!String::from_utf8_lossy(body).contains("unwrap()"), "the reference carries no diff");
    let content = stream_messages(&url, &layout::deadletter_content_stream(Region::Us)).await;
    assert_eq!(content.len(), 1);
    assert_eq!(content[0].0, dead.content_subject);
    let kept: reviewlane_core::messages::ReviewMessage = serde_json::from_slice(&content[0].2).unwrap();
    assert_eq!(kept.diff, sample_diff("401"));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_whose_every_finding_fails_the_schema_is_retried_never_published_empty() {
    let stack = Stack::start().await;
    // Budget 2: three answers whose every finding lacks required fields.
    let broken = r#"{"findings": [{"path": "src/handler.rs"}, {"line": 2, "severity": "dire"}]}"#;
    stack.us.provider.script((0..3).map(|_| Scripted::Output(broken.into())));
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "all-broken", &sample_diff("broken")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "invalid_output"));
    assert_eq!(last.attempts.unwrap().schema, 2);
    assert_eq!(stack.us.provider.stats().calls_by_job.get(&job.job_id), Some(&3));
    assert!(stack.webhook.for_job(&job.job_id).is_empty(), "published as an empty review");
    // The job record says why, without content.
    let js = async_nats::jetstream::new(async_nats::connect(stack.us.nats.url()).await.unwrap());
    let jobs = js.get_key_value(layout::jobs_bucket(Region::Us)).await.unwrap();
    let rec: reviewlane_core::job::JobRecord =
        serde_json::from_slice(&jobs.get(&job.job_id).await.unwrap().unwrap()).unwrap();
    assert_eq!(rec.last_invalid_output.as_deref(), Some("all_findings_invalid"));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_sent_is_the_one_the_providers_dialect_accepts_and_the_answer_is_held_to_the_full_schema() {
    use reviewlane_core::schema_dialect::SchemaDialect;
    use reviewlane_testkit::simprovider::SimConfig;

    // The provider accepts only what Anthropic's structured outputs accept, and the
    // extractors send that dialect: the review publishes.
    let stack = Stack::start_with(StackOptions {
        us_provider: SimConfig { enforce_dialect: Some(SchemaDialect::Anthropic), ..Default::default() },
        schema_dialect: SchemaDialect::Anthropic,
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "anthropic-dialect", &sample_diff("a")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    assert_eq!(stack.us.provider.stats().schemas_refused, 0);
    // A title over the full schema's 200 characters, which the projection does not say:
    // our validator still holds the answer to it.
    let long = "t".repeat(201);
    stack.us.provider.script([Scripted::Output(format!(
        r#"{{"findings": [{{"path": "src/handler.rs", "line": 2, "severity": "high", "category": "correctness", "title": "{long}", "message": "m", "evidence": "unwrap()"}}]}}"#
    ))]);
    let job = submit(&mut client, US_KEY, "too-long-title", &sample_diff("b")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert!(last.findings.iter().all(|f| f.title.len() <= 200), "{last:?}");
    stack.shutdown().await;

    // The full schema sent to a provider that refuses it: its 400 ends the job at once
    // (upstream_rejected), which is what a regression in the projection would do.
    let stack = Stack::start_with(StackOptions {
        us_provider: SimConfig { enforce_dialect: Some(SchemaDialect::Anthropic), ..Default::default() },
        schema_dialect: SchemaDialect::Full,
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "full-to-anthropic", &sample_diff("c")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "upstream_rejected"));
    assert_eq!(stack.us.provider.stats().schemas_refused, 1);
    stack.shutdown().await;
}
