//! The Azure OpenAI adapter against the simulated Azure endpoint (`simazure`, written
//! from Azure's documentation apart from the adapter): the deployment's path with its
//! `api-version`, the `api-key` header or an Entra ID token from a file, the content
//! filter's refusals ending a review `content_filtered` without a retry, a 429's
//! `retry-after-ms` keeping the next call out of the refused window, and a sweep through
//! the resource's global batch deployment (found again by its input file after a crash).

use std::collections::BTreeMap;
use std::time::Duration;

use reviewlane_api::proto::{self, JobState};
use reviewlane_core::schema_dialect::SchemaDialect;
use reviewlane_extractor::config::{AzureAuth, AzureDeployment, ProviderConfig};
use reviewlane_shared::Region;
use reviewlane_testkit::simazure::{self, AzureConfig, SimAzure};

use crate::harness::*;

const DEPLOYMENT: &str = "reviews-us";
const BATCH_DEPLOYMENT: &str = "reviews-batch";

/// The extractor's view of the simulated resource: its deployment, and its global batch
/// deployment.
fn deployment(azure: &SimAzure, auth: AzureAuth) -> AzureDeployment {
    AzureDeployment {
        endpoint: azure.base_url(),
        deployment: DEPLOYMENT.into(),
        model: "gpt-4o-mini".into(),
        api_version: "2024-10-21".into(),
        auth,
        endpoint_region: Region::Us,
        schema_dialect: SchemaDialect::Portable,
        batch_deployment: Some(BATCH_DEPLOYMENT.into()),
    }
}

/// An Azure resource with a deployment of `rpm` calls a window (no token limit) and a
/// global batch deployment, and a stack whose one US extractor calls it with `auth`.
async fn azure_stack(rpm: u32, auth: AzureAuth) -> (Stack, SimAzure) {
    let sync = simazure::AzureDeployment {
        name: DEPLOYMENT.into(),
        model: "gpt-4o-mini".into(),
        rpm: Some(rpm),
        tpm: None,
        global_batch: false,
        enqueued_token_limit: None,
    };
    let batch = simazure::AzureDeployment::global_batch(BATCH_DEPLOYMENT, "gpt-4o-mini", None);
    let azure = SimAzure::start(AzureConfig { deployments: vec![sync, batch], ..Default::default() }).await;
    let mut stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    let mut xc = stack.extractor_config(Region::Us);
    xc.provider = ProviderConfig::AzureOpenAi(deployment(&azure, auth));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_runs_through_the_global_batch_deployment_paid_once_per_item() {
    use proto::{AddSweepItemsRequest, CreateSweepRequest, GetSweepRequest, SealSweepRequest, SweepItem, SweepMode};
    let (stack, azure) = azure_stack(600, api_key()).await;
    let mut client = stack.client().await;
    let items: Vec<SweepItem> = (0..5)
        .map(|i| SweepItem {
            item_key: format!("src/az_{i}.rs"),
            diff: sample_diff(&format!("az{i}")),
            ..Default::default()
        })
        .collect();
    let create = CreateSweepRequest { idempotency_key: "azure-sweep".into(), ..Default::default() };
    let sweep = client.create_sweep(authed(US_KEY, create)).await.unwrap().into_inner().sweep.unwrap();
    let id = sweep.sweep_id.clone();
    client.add_sweep_items(authed(US_KEY, AddSweepItemsRequest { sweep_id: id.clone(), items })).await.unwrap();
    let sealed = client.seal_sweep(authed(US_KEY, SealSweepRequest { sweep_id: id.clone() })).await.unwrap();
    let sealed = sealed.into_inner().sweep.unwrap();
    assert_eq!(sealed.runs_on, SweepMode::ProviderBatch as i32, "the batch deployment is used: {sealed:?}");
    let done = poll_until(Duration::from_secs(60), || {
        let (mut client, id) = (client.clone(), id.clone());
        async move {
            let s = client.get_sweep(authed(US_KEY, GetSweepRequest { sweep_id: id })).await.unwrap();
            let s = s.into_inner().sweep.unwrap();
            (s.percent_done == 100.0).then_some(s)
        }
    })
    .await
    .expect("every item final in time");
    let published = done.items.iter().find(|c| c.state == proto::SweepItemState::Published as i32);
    assert_eq!(published.map(|c| c.count), Some(5), "{done:?}");
    let stats = azure.stats();
    assert_eq!((stats.files_uploaded, stats.batches_created, stats.batch_lines_received), (1, 1, 5), "{stats:?}");
    assert_eq!(stats.paid_batch_lines.len(), 5);
    assert!(stats.paid_batch_lines.values().all(|n| *n == 1), "each line paid once: {stats:?}");
    assert_eq!(stats.deployments[DEPLOYMENT].calls, 0, "no synchronous call");
    let settled = stack.webhook.wait_count(5, Duration::from_millis(500), Duration::from_secs(20)).await;
    assert_eq!(settled, 5, "each item delivered once");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_created_before_a_crash_is_found_by_its_input_file_and_no_other() {
    use reviewlane_extractor::batch::{BatchApi, Found, Sent, openai::OpenAiBatches};
    let batch = simazure::AzureDeployment::global_batch(BATCH_DEPLOYMENT, "gpt-4o-mini", None);
    let azure = SimAzure::start(AzureConfig { deployments: vec![batch], ..Default::default() }).await;
    let d = deployment(&azure, api_key());
    let limits = (Duration::from_secs(5), Duration::from_secs(60));
    let adapter = std::sync::Arc::new(reviewlane_extractor::provider::openai::OpenAiProvider::azure(
        &d,
        limits.0,
        limits.1,
        1 << 20,
    ));
    let api = OpenAiBatches::azure(&d, limits, adapter);
    let chunk_of = |n: u32| {
        let ids: Vec<String> = (0..2).map(|i| format!("us_{:032x}", n * 10 + i)).collect();
        let lines: Vec<serde_json::Value> = ids
            .iter()
            .map(|id| {
                let text = sample_diff(id);
                let diff = reviewlane_core::diff::parse(&text).unwrap();
                let req = reviewlane_extractor::provider::ProviderRequest {
                    job_id: id,
                    region: Region::Us,
                    schema_version: reviewlane_core::findings::LATEST_SCHEMA,
                    diff_text: &text,
                    diff: &diff,
                    review_depth: reviewlane_core::job::ReviewDepth::Full,
                    part: None,
                };
                api.line(reviewlane_core::batch::custom_id(id).unwrap(), &req)
            })
            .collect();
        let chunk = reviewlane_core::batch::ChunkRecord::new("sw_azure", "acme", n, ids, 0);
        (chunk, lines)
    };
    // Two chunks uploaded and created; the second's id was never recorded (a crash).
    let mut created = Vec::new();
    for n in 0..2 {
        let (mut chunk, lines) = chunk_of(n);
        assert_eq!(lines[0]["body"]["model"], BATCH_DEPLOYMENT, "a line names the global batch deployment");
        assert_eq!(lines[0]["url"], "/chat/completions");
        let Sent::Uploaded { file_id } = api.send(&chunk, &lines).await.unwrap() else { panic!("upload first") };
        chunk.file_id = Some(file_id);
        let Sent::Created { batch_id } = api.send(&chunk, &lines).await.unwrap() else { panic!("then create") };
        created.push((chunk, batch_id));
    }
    for (chunk, batch_id) in &created {
        let found = api.find(chunk, &Default::default(), &mut Default::default()).await.unwrap();
        assert_eq!(found, Found::Ours(batch_id.clone()), "the batch made from its own file");
    }
    let (mut unsent, _) = chunk_of(7);
    assert_eq!(api.find(&unsent, &Default::default(), &mut Default::default()).await.unwrap(), Found::None);
    unsent.file_id = Some("file-never-used".into());
    assert_eq!(api.find(&unsent, &Default::default(), &mut Default::default()).await.unwrap(), Found::None);
    assert_eq!(azure.stats().batches_created, 2, "finding creates nothing");
}
