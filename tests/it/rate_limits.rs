//! Issue 3: a 429 is an admission signal. Retry hints, backoff, budgets, the shared
//! pause per quota scope, and the scope's concurrency summed over replicas.

use std::time::Duration;

use reviewlane_api::proto::JobState;
use reviewlane_core::meter::{Dimension, Reading};
use reviewlane_core::region::Region;
use reviewlane_testkit::simprovider::{Scripted, SimConfig};

use crate::harness::*;

fn status(status: u16, headers: &[(&str, &str)], body: &str) -> Scripted {
    Scripted::Status {
        status,
        headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        body: body.to_string(),
    }
}

const RATE_LIMITED: &str =
    r#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_429s_then_success_honours_retry_after_and_publishes_once() {
    let stack = Stack::start().await;
    stack.us.provider.script([status(429, &[("retry-after", "2")], RATE_LIMITED), status(429, &[], RATE_LIMITED)]);
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "429-twice", &sample_diff("r")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32, "{}", last.terminal_reason);
    let a = last.attempts.unwrap();
    assert_eq!((a.congestion, a.transient, a.schema), (2, 0, 0));
    assert!(!last.findings.is_empty(), "the result validated");

    let times = stack.us.provider.stats().call_times_ms[&job.job_id].clone();
    assert_eq!(times.len(), 3, "{times:?}");
    // The first 429 answered at about times[0]; retry-after: 2 holds the next call back.
    assert!(times[1] - times[0] >= 2000, "second attempt {} ms after the first", times[1] - times[0]);
    assert!(eventually(Duration::from_secs(3), || stack.webhook.for_job(&job.job_id).len() == 1).await);
    publisher_settled(&stack, Region::Us).await;
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1, "exactly one publication");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_without_hint_backs_off_within_bounds_and_quota_exhaustion_is_terminal() {
    let stack = Stack::start().await;
    // Backoff in the harness: base 200 ms, cap 2 s, jitter x0.5..1.5.
    stack.us.provider.script([
        status(429, &[], RATE_LIMITED),
        status(429, &[], RATE_LIMITED),
        status(429, &[], RATE_LIMITED),
    ]);
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "429-nohint", &sample_diff("n")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!(last.state, JobState::Published as i32);
    assert_eq!(last.attempts.unwrap().congestion, 3);
    let t = stack.us.provider.stats().call_times_ms[&job.job_id].clone();
    for (n, pair) in t.windows(2).enumerate() {
        let gap = pair[1] - pair[0];
        let nominal = 200.0 * 2f64.powi(n as i32);
        let (lo, hi) = ((nominal * 0.5) as u64, (nominal * 1.5) as u64 + 300);
        assert!(gap >= lo && gap <= hi, "retry {} after {gap} ms, expected {lo}..{hi}", n + 1);
    }

    // 429 insufficient_quota: money, not load. Terminal at once, no retry.
    stack.eu.provider.script([status(
        429,
        &[("retry-after", "1")],
        r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#,
    )]);
    let job = submit(&mut client, EU_KEY, "no-money", &sample_diff("q")).await;
    let last = wait_final(&mut client, EU_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "insufficient_quota"));
    assert_eq!(stack.eu.provider.stats().calls_by_job[&job.job_id], 1);
    // The scope's circuit is open: the next jobs end the same way without a call.
    for i in 0..2 {
        let next = submit(&mut client, EU_KEY, &format!("no-money-{i}"), &sample_diff(&format!("q{i}"))).await;
        let last = wait_final(&mut client, EU_KEY, &next.job_id).await;
        assert_eq!(last.terminal_reason, "insufficient_quota");
    }
    assert_eq!(stack.eu.provider.stats().total_calls, 1, "no call while the circuit is open");
    // The alert's metric counts it, labelled by quota scope.
    let eu_admin = stack.extractor_admin.iter().find(|(r, _)| *r == Region::Eu).unwrap().1;
    let metrics = http_get(eu_admin, "/metrics").await;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("reviewlane_upstream_responses_total{") && l.contains("outcome=\"insufficient_quota\""))
        .unwrap_or_else(|| panic!("no insufficient_quota sample in:\n{metrics}"));
    assert!(line.contains("tenant=\"euro\"") && line.contains("region=\"eu\"") && line.ends_with(" 1"), "{line}");
    assert_eq!(http_get(eu_admin, "/healthz").await, "ok\n");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_congestion_budget_ends_in_rate_limit_budget_exhausted() {
    let stack = Stack::start().await;
    // Budget 5: six 429s with a short hint.
    stack.us.provider.script((0..6).map(|_| status(429, &[("retry-after-ms", "50")], RATE_LIMITED)));
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "429-forever", &sample_diff("f")).await;
    let last = wait_final(&mut client, US_KEY, &job.job_id).await;
    assert_eq!((last.state, last.terminal_reason.as_str()), (JobState::Terminal as i32, "rate_limit_budget_exhausted"));
    assert_eq!(last.attempts.unwrap().congestion, 5);
    assert_eq!(stack.us.provider.stats().calls_by_job[&job.job_id], 6);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_429_pauses_the_key_on_every_replica() {
    let stack = Stack::start_with(StackOptions {
        extractors: 2,
        extractor_concurrency: 2,
        us_provider: SimConfig { latency: Duration::from_millis(200), ..Default::default() },
        ..Default::default()
    })
    .await;
    stack.us.provider.script([status(429, &[("retry-after", "2")], RATE_LIMITED)]);
    let mut client = stack.client().await;
    let mut jobs = Vec::new();
    for i in 0..8 {
        jobs.push(submit(&mut client, US_KEY, &format!("pause-{i}"), &sample_diff(&format!("p{i}"))).await);
    }
    for j in &jobs {
        assert_eq!(wait_final(&mut client, US_KEY, &j.job_id).await.state, JobState::Published as i32);
    }
    let stats = stack.us.provider.stats();
    // The 429 answered when its call ended: the span of the first call.
    let (first_start, answered) = stats.call_spans_ms.iter().copied().min_by_key(|(s, _)| *s).unwrap();
    assert!(answered >= first_start);
    let starts: Vec<u64> = stats.call_times_by_key.values().flatten().copied().collect();
    let in_pause: Vec<_> = starts.iter().filter(|&&t| t > answered + 100 && t < answered + 2000).collect();
    assert!(in_pause.is_empty(), "calls during the pause at {in_pause:?} (429 answered at {answered})");
    // The fleet resumed after it (within the key's window, now one call).
    assert!(starts.iter().any(|&t| t >= answered + 2000), "nobody resumed: {starts:?}");
    assert_eq!(stats.call_times_by_key.len(), 2, "both replicas called: {:?}", stats.call_times_by_key.keys());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_never_exceed_the_key_limit() {
    let stack = Stack::start_with(StackOptions {
        extractors: 3,
        extractor_concurrency: 8,
        key_limit: 2,
        us_provider: SimConfig { latency: Duration::from_millis(150), ..Default::default() },
        ..Default::default()
    })
    .await;
    // Every replica warmed up, so the shares are settled before the load.
    extractors_ready(&stack).await;
    let mut client = stack.client().await;
    let mut jobs = Vec::new();
    for i in 0..16 {
        jobs.push(submit(&mut client, US_KEY, &format!("limit-{i}"), &sample_diff(&format!("l{i}"))).await);
    }
    for j in &jobs {
        assert_eq!(wait_final(&mut client, US_KEY, &j.job_id).await.state, JobState::Published as i32);
    }
    let stats = stack.us.provider.stats();
    assert_eq!(stats.total_calls, 16, "one call per job");
    assert!(stats.max_concurrent <= 2, "provider saw {} concurrent calls", stats.max_concurrent);
    assert_eq!(stats.max_concurrent, 2, "and the limit was used");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_pause_and_an_open_circuit_end_when_the_clock_passes_them() {
    use reviewlane_core::clock::ManualClock;
    use reviewlane_extractor::quota::Quota;
    let nats = reviewlane_shared::testing::NatsServer::start_provisioned(reviewlane_shared::Region::Us).await;
    let s = crate::manual::stores(nats.url(), reviewlane_shared::Region::Us, reviewlane_core::clock::system()).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let clock = ManualClock::at(1_000_000);
    let key = reviewlane_extractor::quota::KeyConfig {
        key: "openai.default".into(),
        limit: 4,
        tenant_limits: Default::default(),
        weights: Default::default(),
    };
    let quota =
        Quota::new(s.layout.quota.clone(), client, key, Duration::from_secs(1), Duration::from_secs(60), clock.clone());
    quota.pause(Duration::from_secs(30)).await.unwrap();
    assert_eq!(quota.paused_for(), Some(Duration::from_secs(30)));
    clock.advance(Duration::from_secs(29));
    assert_eq!(quota.paused_for(), Some(Duration::from_secs(1)));
    clock.advance(Duration::from_secs(1));
    assert_eq!(quota.paused_for(), None, "the pause ends on the clock, not on a timer");

    quota
        .open_circuit(reviewlane_extractor::quota::CircuitCause::InsufficientQuota, Duration::from_secs(600))
        .await
        .unwrap();
    assert!(quota.circuit_open());
    clock.advance(Duration::from_secs(600));
    assert!(!quota.circuit_open());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_answer_over_the_size_cap_is_never_read_whole() {
    use reviewlane_extractor::provider::openai::OpenAiProvider;
    use reviewlane_extractor::provider::{Provider, ProviderRequest};
    use reviewlane_extractor::upstream::UpstreamOutcome;
    let sim = reviewlane_testkit::simprovider::SimProvider::start_with(SimConfig::default(), Vec::new()).await;
    let provider = OpenAiProvider::new(
        &sim.base_url(),
        "sim".into(),
        None,
        Region::Us,
        Duration::from_secs(5),
        Duration::from_secs(60),
        4096,
    );
    let text = sample_diff("cap");
    let diff = reviewlane_core::diff::parse(&text).unwrap();
    let req = ProviderRequest {
        job_id: "us_00000000000000000000000000000000",
        region: Region::Us,
        schema_version: "findings.v1",
        diff_text: &text,
        diff: &diff,
        review_depth: Default::default(),
        part: None,
    };
    let small = r#"{"findings":[]}"#.to_string();
    sim.script([
        Scripted::Output(small.clone()),
        Scripted::Output(format!("{{\"findings\":[],\"pad\":\"{}\"}}", "x".repeat(64 * 1024))),
    ]);
    match provider.review(&req).await {
        UpstreamOutcome::Ok { output, .. } => assert_eq!(output, small),
        other => panic!("{other:?}"),
    }
    // Over the cap: an unusable answer (the schema path decides), never a 64 KiB read.
    match provider.review(&req).await {
        UpstreamOutcome::Ok { output, .. } => assert!(output.is_empty(), "{} bytes kept", output.len()),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_key_never_take_more_than_its_token_bucket_holds() {
    use reviewlane_core::clock::ManualClock;
    use reviewlane_extractor::quota::bucket::Refused;
    use reviewlane_extractor::quota::{KeyConfig, Quota};
    let nats = reviewlane_shared::testing::NatsServer::start_provisioned(reviewlane_shared::Region::Us).await;
    let s = crate::manual::stores(nats.url(), reviewlane_shared::Region::Us, reviewlane_core::clock::system()).await;
    // The clock stands still: nothing refills while the two race.
    let clock = ManualClock::at(1_000_000);
    let key = || KeyConfig {
        key: "openai.default".into(),
        limit: 8,
        tenant_limits: Default::default(),
        weights: Default::default(),
    };
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let client = async_nats::connect(nats.url()).await.unwrap();
        let (hb, probe) = (Duration::from_secs(1), Duration::from_secs(60));
        replicas.push(Quota::new(s.layout.quota.clone(), client, key(), hb, probe, clock.clone()));
    }
    // 48,000 tokens a minute; each replica tries 40 calls of 1,000 tokens at once.
    const TPM: u64 = 48_000;
    let tries = replicas.iter().flat_map(|q| (0..40).map(move |_| q.budgets().reserve(Dimension::Tokens, TPM, 1_000)));
    let results = futures::future::join_all(tries).await;
    let taken = results.iter().filter(|r| matches!(r, Ok(Ok(())))).count();
    let waits: Vec<Duration> = results
        .iter()
        .filter_map(|r| match r {
            Ok(Err(Refused::Wait(d))) => Some(*d),
            _ => None,
        })
        .collect();
    let failed: Vec<_> = results.iter().filter(|r| r.is_err()).collect();
    // Every one was decided: contenders are spread out, not given up on.
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(taken, 48, "the fleet took {taken} calls of 1,000 from a bucket of 48,000");
    assert_eq!(waits.len(), 32);
    assert_eq!(
        taken as f64 * 1_000.0,
        TPM as f64 - replicas[0].budgets().bucket_level(Dimension::Tokens, TPM).await.unwrap()
    );
    // Each refused one was told how long until its 1,000 tokens are back: 1,000 at 800 a
    // second.
    assert!(waits.iter().all(|w| *w <= Duration::from_millis(1_250)), "{waits:?}");

    // Drain the rest, then the refill brings exactly what the wait said.
    while let Ok(Ok(())) = replicas[1].budgets().reserve(Dimension::Tokens, TPM, 1_000).await {}
    let Ok(Err(Refused::Wait(wait))) = replicas[0].budgets().reserve(Dimension::Tokens, TPM, 1_000).await else {
        panic!("an empty bucket refuses")
    };
    clock.advance(wait);
    assert!(matches!(replicas[0].budgets().reserve(Dimension::Tokens, TPM, 1_000).await, Ok(Ok(()))));

    // Usage below the reservation is given back to every replica.
    replicas[0].budgets().correct(Dimension::Tokens, TPM, 1_000, 200).await.unwrap();
    assert!(matches!(replicas[1].budgets().reserve(Dimension::Tokens, TPM, 800).await, Ok(Ok(()))));
    // A call larger than the whole bucket never runs.
    assert_eq!(
        replicas[1].budgets().reserve(Dimension::Tokens, TPM, TPM + 1).await.unwrap(),
        Err(Refused::TooLarge { capacity: TPM })
    );
    // The provider reporting less than the bucket holds wins, for both replicas.
    clock.advance(Duration::from_secs(60));
    replicas[0]
        .budgets()
        .follow(Dimension::Tokens, TPM, &Reading { remaining: Some(2_000), ..Default::default() })
        .await
        .unwrap();
    assert_eq!(replicas[1].budgets().bucket_level(Dimension::Tokens, TPM).await.unwrap(), 2_000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_per_minute_budget_paces_calls_without_a_429_a_lease_or_a_retry() {
    // Three requests a minute: three calls at once, then one every 20 s.
    let stack =
        Stack::start_with(StackOptions { key_budgets: vec![(Dimension::Requests, 3)], ..Default::default() }).await;
    let mut client = stack.client().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(submit(&mut client, US_KEY, &format!("rpm-{i}"), &sample_diff(&format!("rpm {i}"))).await.job_id);
    }
    // Three are answered; the other two wait on the lane for the bucket, not the provider.
    let three =
        poll_until(Duration::from_secs(15), || async {
            let done =
                futures::future::join_all(ids.iter().map(|id| {
                    let mut c = client.clone();
                    async move {
                        get(&mut c, US_KEY, id).await.map(|r| r.state == JobState::Published as i32).unwrap_or(false)
                    }
                }))
                .await;
            (done.iter().filter(|d| **d).count() == 3).then_some(())
        })
        .await;
    assert!(three.is_some(), "three calls fit the budget at once");
    let stats = stack.us.provider.stats();
    assert_eq!((stats.total_calls, stats.calls_429), (3, 0), "the bucket held the rest back, not the provider");
    for id in &ids {
        let r = get(&mut client, US_KEY, id).await.unwrap();
        assert!(r.state != JobState::Terminal as i32, "{id} ended: {r:?}");
        let a = r.attempts.unwrap_or_default();
        assert_eq!((a.congestion, a.transient), (0, 0), "{id}: a wait the bucket predicted spends no retry");
    }
    // The fourth call starts when the bucket has a request again: 20 s after the first.
    let fourth = poll_until(Duration::from_secs(40), || async {
        let s = stack.us.provider.stats();
        (s.total_calls >= 4).then(|| {
            let mut starts: Vec<u64> = s.call_times_ms.values().flatten().copied().collect();
            starts.sort();
            starts[3] - starts[0]
        })
    })
    .await
    .expect("a fourth call within 40 s");
    assert!(fourth >= 19_000, "the fourth call started {fourth} ms after the first");
    assert_eq!(stack.us.provider.stats().calls_429, 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_tokens_reservation_is_corrected_to_the_answers_usage() {
    // A call reserves its 4,096-token output limit of the output tokens per minute
    // (counted as produced, as Anthropic does); the simulated provider reports 50 output
    // tokens. 10,000 a minute holds two reservations: corrected by usage, each answer
    // frees room for the next call at once. Uncorrected, the third would wait about 13 s.
    let stack =
        Stack::start_with(StackOptions { key_budgets: vec![(Dimension::OutputTokens, 10_000)], ..Default::default() })
            .await;
    let mut client = stack.client().await;
    let started = std::time::Instant::now();
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(submit(&mut client, US_KEY, &format!("tpm-{i}"), &sample_diff(&format!("tpm {i}"))).await.job_id);
    }
    for id in &ids {
        let r = wait_final_within(&mut client, US_KEY, id, Duration::from_secs(30)).await;
        assert_eq!(r.state, JobState::Published as i32, "{id}: {r:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(12), "six reviews took {:?}", started.elapsed());
    let stats = stack.us.provider.stats();
    assert_eq!((stats.total_calls, stats.calls_429), (6, 0));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_reporting_fewer_tokens_left_than_the_bucket_holds_wins() {
    // 120,000 tokens a minute (2,000 a second) configured; the provider's answers say
    // only 1,000 remain (another deployment on the account used the rest). The next
    // call (about 4,200 tokens) waits for the refill instead of being sent for a 429.
    let stack =
        Stack::start_with(StackOptions { key_budgets: vec![(Dimension::Tokens, 120_000)], ..Default::default() }).await;
    stack.us.provider.set_answer_headers(vec![
        ("x-ratelimit-limit-tokens".into(), "120000".into()),
        ("x-ratelimit-remaining-tokens".into(), "1000".into()),
        // OpenAI says when the dimension is full again (here: what refilling the
        // 119,000 missing at 2,000 a second takes), so the bucket refills continuously.
        ("x-ratelimit-reset-tokens".into(), "59.5s".into()),
    ]);
    let mut client = stack.client().await;
    let first = submit(&mut client, US_KEY, "meter-1", &sample_diff("meter 1")).await.job_id;
    assert_eq!(wait_final(&mut client, US_KEY, &first).await.state, JobState::Published as i32);
    let second = submit(&mut client, US_KEY, "meter-2", &sample_diff("meter 2")).await.job_id;
    assert_eq!(wait_final(&mut client, US_KEY, &second).await.state, JobState::Published as i32);
    let stats = stack.us.provider.stats();
    let (a, b) = (stats.call_times_ms[&first][0], stats.call_times_ms[&second][0]);
    // 1,000 left, about 4,200 needed: at least 1.5 s of refill at 2,000 a second.
    assert!(b - a >= 1_500, "the second call started {} ms after the first", b - a);
    assert_eq!(stats.calls_429, 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfigured_limit_is_learned_from_the_headers_and_paces_the_next_calls() {
    // No budget configured. The provider says it allows 60 requests a minute, that none
    // remain, and that the limit is full again in a minute: after the first answer the
    // fleet's requests bucket exists (60, one a second) and is empty, so each later call
    // waits its second instead of a 429 — and not the minute until the limit is full (a
    // headroom pause, which the bucket makes unneeded).
    let stack = Stack::start_with(StackOptions::default()).await;
    stack.us.provider.set_answer_headers(vec![
        ("x-ratelimit-limit-requests".into(), "60".into()),
        ("x-ratelimit-remaining-requests".into(), "0".into()),
        ("x-ratelimit-reset-requests".into(), "1m0s".into()),
    ]);
    let started = std::time::Instant::now();
    let mut client = stack.client().await;
    let first = submit(&mut client, US_KEY, "learn-0", &sample_diff("learn 0")).await.job_id;
    assert_eq!(wait_final(&mut client, US_KEY, &first).await.state, JobState::Published as i32);
    let mut ids = Vec::new();
    for i in 1..4 {
        ids.push(submit(&mut client, US_KEY, &format!("learn-{i}"), &sample_diff(&format!("learn {i}"))).await.job_id);
    }
    for id in &ids {
        assert_eq!(wait_final(&mut client, US_KEY, id).await.state, JobState::Published as i32);
    }
    let stats = stack.us.provider.stats();
    let mut starts: Vec<u64> = ids.iter().map(|id| stats.call_times_ms[id][0]).collect();
    starts.sort();
    for pair in starts.windows(2) {
        assert!(pair[1] - pair[0] >= 900, "calls {} ms apart: {starts:?}", pair[1] - pair[0]);
    }
    assert!(started.elapsed() < Duration::from_secs(20), "four reviews took {:?}", started.elapsed());
    assert_eq!((stats.total_calls, stats.calls_429), (4, 0));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_429_empties_its_bucket_and_a_racing_429_keeps_the_window() {
    use reviewlane_extractor::quota::{KeyConfig, Limited, Quota};
    let nats = reviewlane_shared::testing::NatsServer::start_provisioned(reviewlane_shared::Region::Us).await;
    let s = crate::manual::stores(nats.url(), reviewlane_shared::Region::Us, reviewlane_core::clock::system()).await;
    let clock = reviewlane_core::clock::ManualClock::at(1_000_000);
    let key = KeyConfig {
        key: "openai.default".into(),
        limit: 8,
        tenant_limits: Default::default(),
        weights: Default::default(),
    };
    let client = async_nats::connect(nats.url()).await.unwrap();
    let (hb, probe) = (Duration::from_secs(1), Duration::from_secs(60));
    let q = Quota::new(s.layout.quota.clone(), client, key, hb, probe, clock.clone())
        .with_budgets(vec![(Dimension::Tokens, 48_000)]);
    for _ in 0..6 {
        q.succeeded(q.now_ms()).await;
    }
    assert_eq!(q.fleet_window(), 8);
    let pause = Duration::from_millis(10);
    // A 429 of the tokens bucket: the bucket is empty, the window untouched.
    let limited = |bucket, in_flight| Limited { pause, started_ms: q.now_ms(), in_flight: Some(in_flight), bucket };
    q.rate_limited(limited(Some(Dimension::Tokens), 8)).await.unwrap();
    assert_eq!(q.fleet_window(), 8);
    assert!(q.budgets().bucket_level(Dimension::Tokens, 48_000).await.unwrap() <= 0.0);
    // A 429 naming requests, which the key has no limit for: no bucket to lower, so it
    // is congestion (below, after the race).
    // Twelve calls were running when the refused one started: replicas racing.
    clock.advance(Duration::from_secs(1));
    q.rate_limited(limited(None, 12)).await.unwrap();
    assert_eq!(q.fleet_window(), 8, "a race keeps the level");
    // At the window, the level does not hold.
    q.rate_limited(limited(Some(Dimension::Requests), 8)).await.unwrap();
    assert_eq!(q.fleet_window(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learned_limit_is_raised_at_once_and_lapses_after_ten_minutes_of_answers_without_it() {
    use reviewlane_core::meter::Cost;
    use reviewlane_extractor::quota::{KeyConfig, Limited, Quota};
    use reviewlane_extractor::upstream::Meter;
    let nats = reviewlane_shared::testing::NatsServer::start_provisioned(reviewlane_shared::Region::Us).await;
    let s = crate::manual::stores(nats.url(), reviewlane_shared::Region::Us, reviewlane_core::clock::system()).await;
    let clock = reviewlane_core::clock::ManualClock::at(1_000_000);
    let url = nats.url().to_string();
    let quota = |key: &str| {
        let key =
            KeyConfig { key: key.into(), limit: 8, tenant_limits: Default::default(), weights: Default::default() };
        let (kv, clock, url) = (s.layout.quota.clone(), clock.clone(), url.clone());
        async move {
            let client = async_nats::connect(url).await.unwrap();
            Quota::new(kv, client, key, Duration::from_secs(1), Duration::from_secs(60), clock)
        }
    };
    let q = quota("openai.learned").await;
    let call = Cost { input: 1_000, output: 100 };
    let reading = |limit, remaining, reset_ms| Reading {
        limit: Some(limit),
        remaining: Some(remaining),
        reset: Some(Duration::from_millis(reset_ms)),
    };
    // The answers teach 20 requests a minute, none left (one back in 3 s).
    q.budgets().follow_readings(&Meter::from([(Dimension::Requests, reading(20, 0, 3_000))])).await;
    assert_eq!(q.budgets().limits(), vec![(Dimension::Requests, 20)]);
    assert!(q.budgets().reserve_call(call).await.is_err(), "an empty learned bucket paces the next call");
    // A larger tier: the higher limit holds from the answer that reports it, and what it
    // adds is there at once.
    q.budgets().follow_readings(&Meter::from([(Dimension::Requests, reading(40, 20, 1_500))])).await;
    assert_eq!(q.budgets().limits(), vec![(Dimension::Requests, 40)]);
    let r = q.budgets().reserve_call(call).await.expect("the raised limit has room at once");
    q.budgets().correct_call(&r, Cost::default()).await;

    // The provider stops reporting the limit. For ten minutes the learned one still
    // paces: drained, a call waits for the refill.
    let silent = Meter::new();
    for _ in 0..9 {
        clock.advance(Duration::from_secs(60));
        q.budgets().follow_readings(&silent).await;
    }
    assert_eq!(q.budgets().limits(), vec![(Dimension::Requests, 40)]);
    while let Ok(r) = q.budgets().reserve_call(call).await {
        q.budgets().correct_call(&r, Cost::default()).await;
    }
    // Ten minutes of answers without it: it lapses. Calls are no longer paced by it, its
    // bucket is gone from the fleet (a replica starting now adopts nothing), and a 429
    // with `retry-after: 2` holds the key for the hint, not for a refill.
    clock.advance(Duration::from_secs(61));
    q.budgets().follow_readings(&silent).await;
    assert_eq!(q.budgets().limits(), vec![], "the learned limit lapsed");
    assert!(q.budgets().reserve_call(call).await.is_ok(), "nothing paces the call any more");
    assert!(s.layout.quota.get("bucket.openai.learned.requests").await.unwrap().is_none());
    let fresh = quota("openai.learned").await;
    fresh.start(tokio_util::sync::CancellationToken::new()).await.unwrap();
    assert_eq!(fresh.budgets().limits(), vec![], "a replica starting later adopts no lapsed limit");
    let hint = Duration::from_secs(2);
    let limited =
        Limited { pause: hint, started_ms: q.now_ms(), in_flight: Some(1), bucket: Some(Dimension::Requests) };
    q.rate_limited(limited).await.unwrap();
    assert!(q.paused_for().is_some_and(|p| p <= hint), "{:?}", q.paused_for());
    clock.advance(hint);
    assert_eq!(q.paused_for(), None);
    assert!(q.budgets().reserve_call(call).await.is_ok(), "the retry after the hint is not held back");

    // A configured limit never lapses.
    let configured = quota("openai.configured").await.with_budgets(vec![(Dimension::Requests, 20)]);
    for _ in 0..30 {
        clock.advance(Duration::from_secs(60));
        configured.budgets().follow_readings(&silent).await;
    }
    assert_eq!(configured.budgets().limits(), vec![(Dimension::Requests, 20)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_gateway_with_fixed_windows_reviews_wait_for_the_next_window_not_for_429s() {
    use reviewlane_testkit::simgateway::{GatewayConfig, SimGateway};
    // A LiteLLM-style proxy in front of the provider: 6 requests per fixed minute, its
    // 200s carrying the limit and what remains but no reset, its 429s no hint at all
    // ("No deployments available for selected model"). The window starts as the test
    // does, so one window and a call is the floor for 10 reviews.
    let window = Duration::from_secs(60);
    let gateway = SimGateway::start(GatewayConfig {
        rpm: 6,
        window,
        clock: reviewlane_testkit::simgateway::clock_starting_a_window_now(window),
        deployment: SimConfig { latency: Duration::from_millis(200), ..Default::default() },
        ..Default::default()
    })
    .await;
    let mut stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    stack.start_extractor_calling(Region::Us, gateway.base_url()).await;

    let started = std::time::Instant::now();
    let mut client = stack.client().await;
    let mut ids = Vec::new();
    for i in 0..10 {
        ids.push(submit(&mut client, US_KEY, &format!("gw-{i}"), &sample_diff(&format!("gateway {i}"))).await.job_id);
    }
    for id in &ids {
        let r = wait_final_within(&mut client, US_KEY, id, Duration::from_secs(120)).await;
        assert_eq!(r.state, JobState::Published as i32, "{id}: {r:?}");
        let a = r.attempts.unwrap_or_default();
        assert_eq!(a.congestion, 0, "{id}: a wait the answers predicted spends no retry");
    }
    let took = started.elapsed();
    let stats = gateway.stats();
    // Six in the first window, four in the next: no call sent into a window the answers
    // said was used up (continuous refill would send one every 10 s, each a 429).
    assert_eq!(
        stats.calls_429, 0,
        "{} calls, {} answered 429: {:?}",
        stats.total_calls, stats.calls_429, stats.windows
    );
    assert_eq!(stats.calls_200, 10);
    // Within 1.15x of the floor: one window and a call.
    assert!(took <= (window + Duration::from_secs(2)).mul_f64(1.15), "ten reviews took {took:?}");
    stack.shutdown().await;
}
