//! The Azure OpenAI adapter against the simulated Azure endpoint (`simazure`, written
//! from Azure's documentation apart from the adapter): the deployment's path with its
//! `api-version`, the `api-key` header or an Entra ID token from a file, the content
//! filter's refusals ending a review `content_filtered` without a retry, and a 429's
//! `retry-after-ms` keeping the next call out of the refused window.

use std::collections::BTreeMap;
use std::time::Duration;

use reviewlane_api::proto::{self, JobState};
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_extractor::config::{AzureAuth, AzureDeployment, ProviderConfig};
use reviewlane_shared::Region;
use reviewlane_testkit::simazure::{self, AzureConfig, SimAzure};

use crate::harness::*;

const DEPLOYMENT: &str = "reviews-us";

/// An Azure deployment of `rpm` calls a window (no token limit), and a stack whose one
/// US extractor calls it with `auth`.
async fn azure_stack(rpm: u32, auth: AzureAuth) -> (Stack, SimAzure) {
    let deployment = simazure::AzureDeployment {
        name: DEPLOYMENT.into(),
        model: "gpt-4o-mini".into(),
        rpm: Some(rpm),
        tpm: None,
        global_batch: false,
        enqueued_token_limit: None,
    };
    let azure = SimAzure::start(AzureConfig { deployments: vec![deployment], ..Default::default() }).await;
    let mut stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    let mut xc = stack.extractor_config(Region::Us);
    xc.provider = ProviderConfig::AzureOpenAi(AzureDeployment {
        endpoint: azure.base_url(),
        deployment: DEPLOYMENT.into(),
        model: "gpt-4o-mini".into(),
        api_version: "2024-10-21".into(),
        auth,
        endpoint_region: Region::Us,
        schema_dialect: SchemaDialect::Portable,
    });
    stack.start_extractor_with(Region::Us, xc).await;
    (stack, azure)
}

fn api_key() -> AzureAuth {
    AzureAuth::ApiKey(Some(simazure::SIM_API_KEY.to_string().into()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_review_goes_to_the_deployment_with_its_key_or_an_entra_token() {
    let (stack, azure) = azure_stack(600, api_key()).await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "azure-key", &sample_diff("az")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    assert!(!last.findings.is_empty());
    let stats = azure.stats();
    assert_eq!(stats.deployments[DEPLOYMENT].ok, 1, "{stats:?}");
    assert_eq!((stats.not_found, stats.unauthorized, stats.unknown_deployment), (0, 0, 0));
    assert_eq!(stats.paid_by_job.get(&job.job_id), Some(&1));
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1);
    stack.shutdown().await;

    // The token file is read at each call: a renewed token is used at once.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "expired-token\n").unwrap();
    let (stack, azure) = azure_stack(600, AzureAuth::TokenFile(token.clone())).await;
    let mut client = stack.client().await;
    std::fs::write(&token, format!("{}\n", simazure::SIM_BEARER_TOKEN)).unwrap();
    let job = submit(&mut client, US_KEY, "azure-token", &sample_diff("tok")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    assert_eq!(azure.stats().deployments[DEPLOYMENT].unauthorized, 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_content_filter_ends_a_review_saying_so_without_a_retry() {
    let (stack, azure) = azure_stack(600, api_key()).await;
    let mut client = stack.client().await;

    // The prompt refused (400 `content_filter`): one call, the reason says why.
    azure.filter_next_prompts(1);
    let job = submit(&mut client, US_KEY, "azure-prompt", &sample_diff("prompt")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "content_filtered"));
    assert_eq!(last.terminal_reason_enum, proto::TerminalReason::ContentFiltered as i32);
    assert_eq!(azure.stats().calls_by_job.get(&job.job_id), Some(&1), "never sent again");

    // The answer cut (200 ending `content_filter`): one call, paid, charged to the job.
    azure.filter_next_completions(1);
    let job = submit(&mut client, US_KEY, "azure-completion", &sample_diff("completion")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "content_filtered"));
    let stats = azure.stats();
    assert_eq!((stats.calls_by_job.get(&job.job_id), stats.paid_by_job.get(&job.job_id)), (Some(&1), Some(&1)));
    assert!(last.tokens.is_some_and(|t| t.input > 0), "the paid answer is charged: {last:?}");
    assert!(stack.webhook.for_job(&job.job_id).is_empty(), "nothing delivered");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_call_comes_back_only_after_its_retry_after_ms() {
    // 30 RPM: 5 calls in each 10-second window. 11 reviews at once: whichever two
    // windows they fall in, one is asked for more than 5.
    let (stack, azure) = azure_stack(30, api_key()).await;
    let mut client = stack.client().await;
    let mut jobs = Vec::new();
    for i in 0..11 {
        jobs.push(submit(&mut client, US_KEY, &format!("azure-rpm-{i}"), &sample_diff(&format!("rpm{i}"))).await);
    }
    for job in &jobs {
        let last = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(60)).await;
        assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    }
    let stats = azure.stats();
    let d = &stats.deployments[DEPLOYMENT];
    assert!(d.rate_limited >= 1, "the sixth call of a window is refused: {d:?}");
    assert!(d.requests_by_window.values().all(|n| *n <= 5), "{:?}", d.requests_by_window);
    // Each refused job's next call came in a later window: the hint was waited out.
    let mut calls: BTreeMap<&str, Vec<(u64, u16)>> = BTreeMap::new();
    for c in &stats.calls {
        calls.entry(c.job.as_str()).or_default().push((c.at_ms, c.status));
    }
    let window = |at_ms: u64| at_ms / 10_000;
    for (job, seen) in &calls {
        for pair in seen.windows(2) {
            let ((refused_at, status), (next_at, _)) = (pair[0], pair[1]);
            if status == 429 {
                assert!(window(next_at) > window(refused_at), "{job}: called again in the refused window: {seen:?}");
            }
        }
    }
    for job in &jobs {
        assert_eq!(stats.paid_by_job.get(&job.job_id), Some(&1), "paid once");
    }
    stack.shutdown().await;
}
