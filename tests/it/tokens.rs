//! Tokens and cost: every paid call's tokens (the provider's usage fields) are added to
//! its job, with an estimated cost from the model's configured price, shown in
//! `GetReview`; totals per tenant, model and region are Prometheus counters.

use reviewlane_api::proto::JobState;
use reviewlane_extractor::config::Price;
use reviewlane_testkit::simprovider::Scripted;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_paid_call_is_charged_to_its_job_and_counted() {
    // The simulated provider reports 100 input and 50 output tokens per call.
    let prices = [("sim".to_string(), Price { input_per_mtok: 1.0, output_per_mtok: 2.0 })].into();
    let stack = Stack::start_with(StackOptions { model_prices: prices, ..Default::default() }).await;
    let mut client = stack.client().await;

    let one = submit(&mut client, US_KEY, "one-call", &sample_diff("one")).await;
    let one = wait_final(&mut client, US_KEY, &one.job_id).await;
    assert_eq!(one.state, JobState::Published as i32);
    let t = one.tokens.unwrap();
    assert_eq!((t.input, t.output), (100, 50));
    assert!((one.estimated_cost_usd - 0.0002).abs() < 1e-12, "{}", one.estimated_cost_usd);

    // An answer that fails the schema is paid for too: two calls, twice the tokens.
    stack.us.provider.script([Scripted::Output("not json".into())]);
    let two = submit(&mut client, US_KEY, "two-calls", &sample_diff("two")).await;
    let two = wait_final(&mut client, US_KEY, &two.job_id).await;
    assert_eq!((two.state, two.attempts.unwrap().schema), (JobState::Published as i32, 1));
    let t = two.tokens.unwrap();
    assert_eq!((t.input, t.output), (200, 100));
    assert!((two.estimated_cost_usd - 0.0004).abs() < 1e-12, "{}", two.estimated_cost_usd);

    let admin = stack.extractor_admin.iter().find(|(r, _)| *r == reviewlane_shared::Region::Us).unwrap().1;
    let page = http_get(admin, "/metrics").await;
    let counted = metric_sum(
        &page,
        "reviewlane_tokens_total{region=\"us\",tenant=\"acme\",model_class=\"sim\",direction=\"in\"}",
    );
    assert_eq!(counted, 300.0, "{page}");
    // The same calls by the deployment that answered them, with their cost.
    assert_eq!((one.deployment.as_str(), one.model_class.as_str()), ("openai", "sim"));
    let by_deployment = |series: &str| metric_sum(&page, series);
    assert_eq!(
        by_deployment(
            "reviewlane_deployment_tokens_total{region=\"us\",deployment=\"openai\",class=\"sim\",direction=\"out\"}"
        ),
        150.0
    );
    let cost = by_deployment("reviewlane_deployment_cost_usd_total{region=\"us\",deployment=\"openai\",class=\"sim\"}");
    assert!((cost - 0.0006).abs() < 1e-12, "{cost}");

    // The same review again: a result-cache hit, no call, no tokens charged; the tokens
    // it saved are counted.
    let calls = stack.us.provider.stats().total_calls;
    let again = submit(&mut client, US_KEY, "one-call-again", &sample_diff("one")).await;
    let again = wait_final(&mut client, US_KEY, &again.job_id).await;
    assert_eq!(again.state, JobState::Published as i32);
    assert_eq!(stack.us.provider.stats().total_calls, calls);
    let t = again.tokens.unwrap();
    assert_eq!((t.input, t.output, again.estimated_cost_usd), (0, 0, 0.0));
    let page = http_get(admin, "/metrics").await;
    let saved = metric_sum(
        &page,
        "reviewlane_tokens_saved_total{region=\"us\",tenant=\"acme\",model_class=\"sim\",direction=\"in\"}",
    );
    assert_eq!(saved, 100.0, "{page}");
    stack.shutdown().await;
}
