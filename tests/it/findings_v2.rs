//! `findings.v2` end to end: a review asking for v2 gets findings with a suggested
//! action, a confidence, a side and a fingerprint, in `GetReview` (with the severity and
//! category enums) and in the delivery — through OpenAI's strict rules with the default
//! dialect (optional fields as nulls) and Anthropic's. v1 reviews keep their shape.

use reviewlane_api::proto::{self, JobState};
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_testkit::simprovider::SimConfig;

use crate::harness::*;

async fn submit_v2(stack: &Stack, idem: &str, diff: &str) -> proto::Review {
    let mut client = stack.client().await;
    let mut req = submit_req(US_KEY, idem, diff);
    req.get_mut().schema_version = "findings.v2".into();
    let job = client.submit_review(req).await.expect("submit").into_inner().review.expect("review");
    wait_final(&mut client, US_KEY, &job.job_id).await
}

fn assert_actionable(review: &proto::Review) {
    assert_eq!(review.state, JobState::Published as i32, "{review:?}");
    assert_eq!(review.schema_version, "findings.v2");
    assert!(!review.findings.is_empty());
    for f in &review.findings {
        assert_eq!(f.suggested_action, "Look at this line again.");
        assert_eq!(f.confidence, "medium");
        assert_eq!(f.side, proto::Side::New as i32);
        assert_eq!(f.severity_enum, proto::Severity::Low as i32);
        assert_eq!(f.category_enum, proto::Category::Maintainability as i32);
        assert_eq!(f.fingerprint.len(), 32);
    }
}

/// The default dialect (`portable`) to a provider enforcing OpenAI's strict rules: what
/// a new user's first review through OpenAI does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_findings_through_openai_strict_and_in_the_delivery() {
    let stack = Stack::start_with(StackOptions {
        us_provider: SimConfig { enforce_dialect: Some(SchemaDialect::OpenAi), ..Default::default() },
        ..Default::default()
    })
    .await;
    let review = submit_v2(&stack, "v2-openai", &sample_diff("v2")).await;
    assert_actionable(&review);
    assert_eq!(stack.us.provider.stats().schemas_refused, 0);
    let delivered: serde_json::Value = serde_json::from_slice(&stack.webhook.for_job(&review.job_id)[0].body).unwrap();
    assert_eq!(delivered["schema_version"], "findings.v2");
    let f = &delivered["findings"][0];
    assert_eq!(f["suggested_action"], "Look at this line again.");
    assert_eq!(f["fingerprint"].as_str().unwrap(), review.findings[0].fingerprint);

    // A v1 review of the same diff: the v1 fields only (and the fingerprint).
    let mut client = stack.client().await;
    let v1 = submit(&mut client, US_KEY, "v1-same", &sample_diff("v2")).await;
    let v1 = wait_final(&mut client, US_KEY, &v1.job_id).await;
    assert_eq!(v1.state, JobState::Published as i32);
    assert!(v1.findings.iter().all(|f| f.suggested_action.is_empty() && f.confidence.is_empty()));
    let delivered: serde_json::Value = serde_json::from_slice(&stack.webhook.for_job(&v1.job_id)[0].body).unwrap();
    assert!(delivered["findings"][0].get("suggested_action").is_none(), "{delivered}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_findings_through_anthropics_dialect() {
    let stack = Stack::start_with(StackOptions {
        anthropic: true,
        us_provider: SimConfig { enforce_dialect: Some(SchemaDialect::Anthropic), ..Default::default() },
        ..Default::default()
    })
    .await;
    let review = submit_v2(&stack, "v2-anthropic", &sample_diff("v2a")).await;
    assert_actionable(&review);
    assert_eq!(stack.us.provider.stats().schemas_refused, 0);
    stack.shutdown().await;
}
