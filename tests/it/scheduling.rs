//! Issue 3: tenant-aware scheduling ahead of the worker pool, interactive before batch,
//! and the lifecycle under cancellation, SIGTERM and kill -9.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reviewlane_api::proto::{CancelReviewRequest, JobState};
use reviewlane_core::messages::Delivery;
use reviewlane_core::region::Region;
use reviewlane_shared::layout;
use reviewlane_testkit::simprovider::SimConfig;

use crate::harness::*;

fn tenant_order(stack: &Stack) -> Vec<String> {
    stack
        .webhook
        .received()
        .iter()
        .map(|r| serde_json::from_slice::<Delivery>(&r.body).expect("delivery").tenant)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_does_not_starve_another() {
    let stack = Stack::start_with(StackOptions {
        extractor_concurrency: 2,
        us_provider: SimConfig { latency: Duration::from_millis(80), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    for i in 0..100 {
        submit(&mut client, US_KEY, &format!("flood-{i}"), &sample_diff(&format!("a{i}"))).await;
    }
    // The backlog acme has when beta arrives (on a loaded machine, part of acme's 100
    // may already be done).
    let a_done_at_b = stack.webhook.received().len();
    let backlog = 100 - a_done_at_b;
    assert!(backlog >= 40, "acme's backlog when beta arrives is only {backlog}");
    let mut b = Vec::new();
    for i in 0..5 {
        b.push(submit(&mut client, US2_KEY, &format!("few-{i}"), &sample_diff(&format!("b{i}"))).await);
    }
    for j in &b {
        assert_eq!(wait_final(&mut client, US2_KEY, &j.job_id).await.state, JobState::Published as i32);
    }
    let order = tenant_order(&stack);
    let fifth_b = order.iter().enumerate().filter(|(_, t)| *t == "beta").nth(4).map(|(i, _)| i).expect("five beta");
    let a_meanwhile = order[..fifth_b].iter().filter(|t| *t == "acme").count() - a_done_at_b;
    assert!(
        a_meanwhile < backlog / 2,
        "{a_meanwhile} of acme's backlog of {backlog} finished before beta's fifth review"
    );
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_review_waits_behind_no_batch_backlog() {
    let latency = Duration::from_millis(300);
    let stack = Stack::start_with(StackOptions {
        extractor_concurrency: 2,
        us_provider: SimConfig { latency, ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    for i in 0..200 {
        submit_batch(&mut client, US_KEY, &format!("batch-{i}"), &sample_diff(&format!("b{i}"))).await;
    }
    assert!(eventually(Duration::from_secs(5), || stack.us.provider.stats().total_calls >= 2).await);
    let started = Instant::now();
    let job = submit(&mut client, US_KEY, "urgent", &sample_diff("urgent")).await;
    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    let took = started.elapsed();
    eprintln!("interactive submit-to-published: {took:?}");
    // At most one call to wait for (a slot to free), plus its own call, plus overhead.
    assert!(took < 2 * latency + Duration::from_millis(300), "interactive took {took:?}");
    let batch_done = stack.webhook.received().len() - 1;
    assert!(batch_done < 40, "{batch_done} of 200 batch reviews were done first");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_during_the_call_abandons_it() {
    let stack = Stack::start_with(StackOptions {
        us_provider: SimConfig { latency: Duration::from_secs(3), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "cancel-mid", &sample_diff("mid")).await;
    assert!(
        eventually(Duration::from_secs(5), || stack.us.provider.stats().calls_by_job.contains_key(&job.job_id)).await
    );
    let started = Instant::now();
    let r = client
        .cancel_review(authed(US_KEY, CancelReviewRequest { job_id: job.job_id.clone() }))
        .await
        .unwrap()
        .into_inner()
        .review
        .unwrap();
    assert_eq!((r.state, r.terminal_reason.as_str()), (JobState::Terminal as i32, "cancelled"));
    // The worker abandons the call at once: the provider sees its caller go away well
    // before the 3 s answer.
    assert!(eventually(Duration::from_secs(2), || stack.us.provider.in_flight() == 0).await, "call still running");
    assert!(started.elapsed() < Duration::from_secs(3));
    let url = stack.us.nats.url().to_string();
    // Nothing of the job is kept: no findings, no dead letter, nothing delivered.
    assert!(stream_messages(&url, &layout::findings_stream(Region::Us)).await.is_empty());
    assert!(stream_messages(&url, &layout::deadletter_stream(Region::Us)).await.is_empty());
    assert!(stream_messages(&url, &layout::deadletter_content_stream(Region::Us)).await.is_empty());
    assert!(stack.webhook.for_job(&job.job_id).is_empty());
    assert_eq!(get(&mut client, US_KEY, &job.job_id).await.unwrap().state, JobState::Terminal as i32);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_work_loses_and_duplicates_nothing() {
    let mut stack = Stack::start_with(StackOptions {
        extractor_concurrency: 2,
        shutdown_grace: Duration::from_secs(3),
        us_provider: SimConfig { latency: Duration::from_millis(1200), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let mut jobs = Vec::new();
    for i in 0..6 {
        jobs.push(submit(&mut client, US_KEY, &format!("term-{i}"), &sample_diff(&format!("t{i}"))).await);
    }
    assert!(eventually(Duration::from_secs(5), || stack.us.provider.stats().total_calls >= 2).await);
    // SIGTERM: stop pulling, let the two calls in flight finish, hand back the rest.
    stack.stop_extractors(Region::Us).await;
    let after_stop = stack.us.provider.stats();
    assert_eq!(after_stop.total_calls, after_stop.paid_by_job.values().sum::<u64>(), "in-flight calls finished");
    stack.start_extractor(Region::Us).await;
    for j in &jobs {
        assert_eq!(wait_final(&mut client, US_KEY, &j.job_id).await.state, JobState::Published as i32);
    }
    let stats = stack.us.provider.stats();
    for j in &jobs {
        assert_eq!(stats.calls_by_job.get(&j.job_id), Some(&1), "one call per job");
        assert!(eventually(Duration::from_secs(3), || stack.webhook.for_job(&j.job_id).len() == 1).await);
    }
    assert_eq!(stack.webhook.received().len(), 6);
    stack.shutdown().await;
}

/// The extractor binary next to this test binary (cargo builds it for the extractor's
/// own integration tests in the same `cargo test --workspace` run).
fn extractor_binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let bin = exe.parent().and_then(|d| d.parent()).expect("target dir").join("reviewlane-extractor");
    assert!(bin.exists(), "{} missing: run `cargo build --bins` or the whole workspace's tests", bin.display());
    bin
}

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_call_is_redelivered_after_the_lease_and_published_once() {
    let mut stack = Stack::start_with(StackOptions {
        extractors: 0,
        us_provider: SimConfig { latency: Duration::from_secs(4), ..Default::default() },
        ..Default::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, tenants_toml(&stack.webhook.url())).unwrap();
    let mut process = Process(
        Command::new(extractor_binary())
            .env_clear()
            .envs([
                ("REVIEWLANE_REGION", "us".to_string()),
                ("REVIEWLANE_ADMIN_ADDR", "127.0.0.1:0".into()),
                ("REVIEWLANE_NATS_URL", stack.us.nats.url().to_string()),
                ("REVIEWLANE_TENANTS_FILE", tenants.display().to_string()),
                ("REVIEWLANE_PROVIDER", "openai".into()),
                ("REVIEWLANE_OPENAI_BASE_URL", stack.us.provider.base_url()),
                ("REVIEWLANE_OPENAI_MODEL", "sim".into()),
                ("REVIEWLANE_OPENAI_API_KEY", "sk-doomed".into()),
                ("REVIEWLANE_PROVIDER_REGION", "us".into()),
                ("REVIEWLANE_LEASE_SECS", "2".into()),
                ("REVIEWLANE_HEARTBEAT_MS", "200".into()),
                ("RUST_LOG", "error".into()),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the extractor binary"),
    );
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "crash", &sample_diff("crash")).await;
    assert!(
        eventually(Duration::from_secs(10), || stack.us.provider.stats().calls_by_job.contains_key(&job.job_id)).await
    );
    process.0.kill().expect("SIGKILL");
    process.0.wait().expect("reaped");
    let killed_at = stack.us.provider.stats().call_times_ms[&job.job_id][0];

    // A healthy replica takes the job once the dead one's lease has run out.
    stack.start_extractor(Region::Us).await;
    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    let stats = stack.us.provider.stats();
    let times = &stats.call_times_ms[&job.job_id];
    assert_eq!(times.len(), 2, "the dead replica's call, then one more");
    assert!(times[1] - killed_at >= 1000, "redelivered only after the lease ({} ms)", times[1] - killed_at);
    assert!(eventually(Duration::from_secs(3), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    publisher_settled(&stack, Region::Us).await;
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1, "published exactly once");
    stack.shutdown().await;
}

/// One call at a time of 400 ms (about 2.5 reviews/s served); a 1 s window; degraded
/// service up to 3 s predicted; admission sampled every 100 ms.
pub(crate) fn slow_lane_options() -> StackOptions {
    use reviewlane_ingress::admission::LanePolicy;
    let policy = LanePolicy {
        window: Duration::from_secs(1),
        degrade_factor: 3.0,
        min_waiting: 2,
        deadline: Duration::from_secs(600),
    };
    StackOptions {
        extractor_concurrency: 1,
        us_provider: SimConfig { latency: Duration::from_millis(400), ..Default::default() },
        interactive_policy: Some((policy, Duration::from_millis(100))),
        ..Default::default()
    }
}

async fn slow_lane() -> Stack {
    Stack::start_with(slow_lane_options()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_lane_with_a_short_window_degrades_then_refuses() {
    use reviewlane_api::proto::ReviewDepth;
    use tonic_types::StatusExt;

    let stack = slow_lane().await;
    let mut client = stack.client().await;
    let (mut degraded, mut refused) = (None, None);
    for i in 0..60 {
        match client.submit_review(submit_req(US_KEY, &format!("adm-{i}"), &sample_diff(&format!("adm{i}")))).await {
            Ok(r) => {
                let r = r.into_inner().review.unwrap();
                if r.review_depth == ReviewDepth::ChangedHunks as i32 && degraded.is_none() {
                    degraded = Some(r.job_id);
                    // The predicted wait is now past the 1 s window: a review due in
                    // 200 ms ends at admission, without reaching the lane.
                    let mut due = submit_req(US_KEY, "due-soon", &sample_diff("due-soon"));
                    due.get_mut().timeout = Some(prost_types::Duration { seconds: 0, nanos: 200_000_000 });
                    let late = client.submit_review(due).await.unwrap().into_inner().review.unwrap();
                    assert_eq!(
                        (late.state, late.terminal_reason.as_str()),
                        (JobState::Terminal as i32, "deadline_exceeded"),
                        "{late:?}"
                    );
                    // At either depth's subject (`reviews.us.interactive.acme[.changed_hunks].<id>`).
                    let subject_end = format!(".{}", late.job_id);
                    let lane = stream_messages(
                        stack.us.nats.url(),
                        &reviewlane_shared::layout::lane_stream(
                            reviewlane_shared::Region::Us,
                            reviewlane_shared::Lane::Interactive,
                        ),
                    )
                    .await;
                    assert!(
                        lane.iter().all(|(s, _, _)| !s.ends_with(&subject_end)),
                        "a review past its deadline was queued"
                    );
                }
            }
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
                let retry = status.get_details_retry_info().expect("RetryInfo");
                assert!(retry.retry_delay.is_some_and(|d| d >= Duration::from_secs(1)));
                refused = Some(i);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let degraded = degraded.expect("some reviews were degraded before any refusal");
    assert!(refused.is_some(), "the lane refused once the predicted age passed 3 s");

    let last = wait_final(&mut client, US_KEY, &degraded).await;
    assert_eq!(last.state, JobState::Published as i32);
    assert_eq!(last.review_depth, ReviewDepth::ChangedHunks as i32, "labelled in GetReview");
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&degraded).len() == 1).await);
    let d: Delivery = serde_json::from_slice(&stack.webhook.for_job(&degraded)[0].body).unwrap();
    assert_eq!(d.review_depth, reviewlane_core::job::ReviewDepth::ChangedHunks, "labelled in the delivery");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_is_refused_while_another_is_still_admitted_and_served() {
    let stack = slow_lane().await;
    let mut client = stack.client().await;
    // Tenant acme floods until it is refused.
    let mut flood = Vec::new();
    let mut refused = false;
    for i in 0..80 {
        match client.submit_review(submit_req(US_KEY, &format!("flood-{i}"), &sample_diff(&format!("f{i}")))).await {
            Ok(r) => flood.push(r.into_inner().review.unwrap().job_id),
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
                refused = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused, "the flooding tenant was never refused ({} accepted)", flood.len());
    // Tenant beta is still admitted, and served while acme's backlog is still there.
    let mut others = Vec::new();
    for i in 0..2 {
        let r = client.submit_review(submit_req(US2_KEY, &format!("small-{i}"), &sample_diff(&format!("s{i}")))).await;
        others.push(r.expect("the other tenant is admitted").into_inner().review.unwrap().job_id);
    }
    for id in &others {
        assert_eq!(wait_final(&mut client, US2_KEY, id).await.state, JobState::Published as i32);
    }
    let mut open = 0;
    for id in &flood {
        if get(&mut client, US_KEY, id).await.unwrap().state != JobState::Published as i32 {
            open += 1;
        }
    }
    assert!(open > 0, "the other tenant waited for the whole flood");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_slows_down_under_an_interactive_backlog_but_is_never_starved() {
    // Two call slots; an interactive backlog of ~6 s; batch keeps one slot (the default).
    let stack = Stack::start_with(StackOptions {
        extractor_concurrency: 2,
        us_provider: SimConfig { latency: Duration::from_millis(300), ..Default::default() },
        interactive_wait_limit: Duration::from_secs(1),
        ..Default::default()
    })
    .await;
    let mut client = stack.client().await;
    let mut interactive = Vec::new();
    for i in 0..40 {
        interactive.push(submit(&mut client, US_KEY, &format!("int-{i}"), &sample_diff(&format!("i{i}"))).await.job_id);
    }
    // Once the interactive lane counts as backlogged, batch work arrives.
    let admin = stack.extractor_admin[0].1;
    let backlogged = poll_until(Duration::from_secs(10), || async move {
        let page = http_get(admin, "/metrics").await;
        (metric_sum(&page, "reviewlane_queue_age_seconds{region=\"us\",lane=\"interactive\"}") > 1.5).then_some(())
    })
    .await;
    assert!(backlogged.is_some(), "interactive backlog builds up");
    let mut batch = Vec::new();
    for i in 0..2 {
        batch
            .push(submit_batch(&mut client, US2_KEY, &format!("bat-{i}"), &sample_diff(&format!("b{i}"))).await.job_id);
    }
    for id in &batch {
        assert_eq!(wait_final(&mut client, US2_KEY, id).await.state, JobState::Published as i32);
    }
    let mut open = 0;
    for id in &interactive {
        if get(&mut client, US_KEY, id).await.unwrap().state != JobState::Published as i32 {
            open += 1;
        }
    }
    assert!(open > 0, "batch waited for the whole interactive backlog");
    for id in &interactive {
        assert_eq!(wait_final(&mut client, US_KEY, id).await.state, JobState::Published as i32);
    }
    stack.shutdown().await;
}
