//! A region's deployments as one pool: two extractor replicas (and two processes)
//! spreading one model class over two simulated deployments, each within its own
//! budget; an account running out of quota mid-run, its key refused or every call
//! failing, its reviews taken by the other deployment without ending or being paid
//! twice, even with a replica killed (`kill -9`) at the failure; classes per lane and
//! per depth; a split review's parts and a sweep's items on the deployments of their
//! class; and a deployment of another region refusing the start.

use std::time::Duration;

use reviewlane_api::proto::JobState;
use reviewlane_core::meter::Dimension;
use reviewlane_extractor::config::{DeploymentConfig, Price, ProviderConfig};
use reviewlane_shared::Region;
use reviewlane_testkit::simmeter::SimLimits;
use reviewlane_testkit::simprovider::{Scripted, SimConfig, SimProvider};

use crate::harness::*;

/// Requests per minute each deployment's account allows.
const RPM: u64 = 40;

/// The second deployment of the US region's class, at `provider`.
fn second(stack: &Stack, provider: &SimProvider, region: Region) -> DeploymentConfig {
    let class = stack.extractor_config(Region::Us).quota.model_class;
    DeploymentConfig {
        id: "second".into(),
        class,
        provider: ProviderConfig::OpenAi {
            base_url: provider.base_url(),
            model: "sim".into(),
            api_key: None,
            endpoint_region: region,
            schema_dialect: Default::default(),
        },
        key_limit: 8,
        budgets: vec![(Dimension::Requests, RPM)],
        price: Some(SECOND_PRICE),
        preference: 0,
    }
}

/// The second deployment's price: dearer than any model's, so its cost is its own.
const SECOND_PRICE: Price = Price { input_per_mtok: 1000.0, output_per_mtok: 2000.0 };

/// A stack whose US region's provider allows `RPM`, with `replicas` extractors that
/// each call it and a second deployment of the same class allowing as much.
async fn two_deployments(replicas: usize) -> (Stack, SimProvider) {
    two_deployments_first(replicas, SimConfig::default()).await
}

/// As `two_deployments`, the first deployment's provider also set by `first`.
async fn two_deployments_first(replicas: usize, first: SimConfig) -> (Stack, SimProvider) {
    let limits = SimConfig { limits: Some(SimLimits::openai(Some(RPM), None)), ..Default::default() };
    let mut stack = Stack::start_with(StackOptions {
        us_provider: SimConfig { limits: limits.limits, ..first },
        key_budgets: vec![(Dimension::Requests, RPM)],
        extractors: 0,
        ..Default::default()
    })
    .await;
    let other = SimProvider::start(limits).await;
    for _ in 0..replicas {
        let mut xc = stack.extractor_config(Region::Us);
        xc.pool = vec![second(&stack, &other, Region::Us)];
        stack.start_extractor_with(Region::Us, xc).await;
    }
    (stack, other)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_spread_a_class_over_two_deployments_each_within_its_budget() {
    let (stack, other) = two_deployments(2).await;
    let mut client = stack.client().await;
    // More reviews than one account allows in a minute, fewer than both do.
    let n = RPM as usize + RPM as usize / 2;
    let mut jobs = Vec::new();
    for i in 0..n {
        jobs.push(submit(&mut client, US_KEY, &format!("pool-{i}"), &sample_diff(&format!("pool{i}"))).await);
    }
    let mut finals = Vec::new();
    for job in &jobs {
        let last = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(40)).await;
        assert_eq!(last.state, JobState::Published as i32, "{last:?}");
        finals.push(last);
    }
    let (first, second) = (stack.us.provider.stats(), other.stats());
    // Neither account was asked past its budget: no 429 from either.
    assert_eq!((first.calls_429, second.calls_429), (0, 0), "{first:?} {second:?}");
    // Both took a share; each review was paid once, on one of them.
    assert!(first.total_calls > 0 && second.total_calls > 0, "{} / {}", first.total_calls, second.total_calls);
    for job in &jobs {
        let paid = first.paid_by_job.get(&job.job_id).copied().unwrap_or(0)
            + second.paid_by_job.get(&job.job_id).copied().unwrap_or(0);
        assert_eq!(paid, 1, "{} paid once", job.job_id);
    }
    // Each review names the deployment that answered it and its class, and is costed
    // at that deployment's price; the replicas count each deployment's tokens.
    let mut second_tokens = 0;
    for r in &finals {
        let by_second = second.paid_by_job.contains_key(&r.job_id);
        assert_eq!(r.deployment, if by_second { "second" } else { "openai" }, "{r:?}");
        assert_eq!(r.model_class, "sim");
        let t = r.tokens.expect("tokens");
        assert!(t.input > 0, "{r:?}");
        if by_second {
            second_tokens += t.input;
            let cost = (t.input as f64 * SECOND_PRICE.input_per_mtok + t.output as f64 * SECOND_PRICE.output_per_mtok)
                .round()
                / 1e6;
            assert!((r.estimated_cost_usd - cost).abs() < 1e-9, "{} against {cost}", r.estimated_cost_usd);
        }
    }
    let mut counted = 0;
    for (_, admin) in stack.extractor_admin.clone() {
        let page = http_get(admin, "/metrics").await;
        let series =
            "reviewlane_deployment_tokens_total{region=\"us\",deployment=\"second\",class=\"sim\",direction=\"in\"} ";
        counted += page.lines().find_map(|l| l.strip_prefix(series)).map_or(0, |v| v.parse::<u64>().expect("a count"));
        assert!(
            page.contains("reviewlane_deployment_cost_usd_total{region=\"us\",deployment=\"second\",class=\"sim\"}")
        );
    }
    assert_eq!(counted, second_tokens, "input tokens paid to the second deployment, over the replicas");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_out_of_quota_hands_its_reviews_to_the_other_deployment() {
    let (stack, other) = two_deployments(2).await;
    let mut client = stack.client().await;
    stack.us.provider.script((0..500).map(|_| Scripted::insufficient_quota()));
    let mut jobs = Vec::new();
    for i in 0..20 {
        jobs.push(submit(&mut client, US_KEY, &format!("quota-{i}"), &sample_diff(&format!("quota{i}"))).await);
    }
    for job in &jobs {
        let last = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(30)).await;
        assert_eq!(last.state, JobState::Published as i32, "not ended for one account's quota: {last:?}");
    }
    let (first, second) = (stack.us.provider.stats(), other.stats());
    assert!(first.paid_by_job.is_empty(), "the empty account was paid nothing");
    // Only calls already in flight when its circuit opened reached the empty account:
    // at most one per call slot of the two replicas.
    assert!(first.total_calls <= 16, "{} calls to the empty account", first.total_calls);
    for job in &jobs {
        assert_eq!(second.paid_by_job.get(&job.job_id), Some(&1), "{} paid once, by the other", job.job_id);
    }
    // Operators see it on every replica (the circuit is the fleet's): the first
    // deployment out of quota, the other routing.
    for (_, admin) in stack.extractor_admin.clone() {
        let state = |deployment: &str, state: &str| {
            format!(
                "reviewlane_deployment_state{{region=\"us\",deployment=\"{deployment}\",class=\"sim\",state=\"{state}\"}} 1"
            )
        };
        let seen = poll_until(Duration::from_secs(5), || async {
            let page = http_get(admin, "/metrics").await;
            (page.contains(&state("openai", "out_of_quota")) && page.contains(&state("second", "routing")))
                .then_some(())
        })
        .await;
        assert!(
            seen.is_some(),
            "{}",
            http_get(admin, "/metrics")
                .await
                .lines()
                .filter(|l| l.contains("deployment_state"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    // An operator sees the pool over the API: each deployment, its class, state and
    // room; a tenant key may not look.
    use reviewlane_api::proto::ListDeploymentsRequest;
    let seen = poll_until(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move {
            let pool = client
                .list_deployments(authed(OPERATOR_KEY, ListDeploymentsRequest {}))
                .await
                .expect("an operator lists the pool")
                .into_inner()
                .deployments;
            let state = |id: &str| pool.iter().find(|d| d.deployment == id).map(|d| d.state.clone());
            (state("openai").as_deref() == Some("out_of_quota") && state("second").as_deref() == Some("routing"))
                .then_some(pool)
        }
    })
    .await
    .expect("both deployments listed with their states");
    let second = seen.iter().find(|d| d.deployment == "second").unwrap();
    assert_eq!((second.region.as_str(), second.kind.as_str(), second.model_class.as_str()), ("us", "openai", "sim"));
    assert_eq!(second.budgets.len(), 1, "{second:?}");
    assert_eq!((second.budgets[0].dimension.as_str(), second.budgets[0].limit), ("rpm", RPM));
    assert!(second.budgets[0].room <= RPM && second.window > 0 && second.observed_at.is_some(), "{second:?}");
    let denied = client.list_deployments(authed(US_KEY, ListDeploymentsRequest {})).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    stack.shutdown().await;
}

/// Submits `n` reviews and waits for each to be published.
async fn all_published(stack: &Stack, prefix: &str, n: usize) -> Vec<String> {
    let mut client = stack.client().await;
    let mut jobs = Vec::new();
    for i in 0..n {
        jobs.push(submit(&mut client, US_KEY, &format!("{prefix}-{i}"), &sample_diff(&format!("{prefix}{i}"))).await);
    }
    for job in &jobs {
        let last = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(30)).await;
        assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    }
    jobs.into_iter().map(|j| j.job_id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_key_takes_its_deployment_out_and_the_other_serves_the_class() {
    let (stack, other) = two_deployments(2).await;
    let refused =
        || Scripted::Status { status: 401, headers: vec![], body: r#"{"error":{"code":"invalid_api_key"}}"#.into() };
    stack.us.provider.script((0..500).map(|_| refused()));
    let jobs = all_published(&stack, "key", 20).await;
    let (first, second) = (stack.us.provider.stats(), other.stats());
    assert!(first.paid_by_job.is_empty());
    assert!(first.total_calls <= 16, "only the calls in flight when the key was refused: {}", first.total_calls);
    for job in &jobs {
        assert_eq!(second.paid_by_job.get(job), Some(&1), "{job} paid once, by the other");
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_deployment_is_taken_out_after_failures_in_a_row() {
    let (stack, other) = two_deployments_first(2, SimConfig { error_5xx_rate: 1.0, ..Default::default() }).await;
    let jobs = all_published(&stack, "failing", 20).await;
    let (first, second) = (stack.us.provider.stats(), other.stats());
    // Five failures in a row on a replica take it out for the fleet: the calls already
    // in flight, and at most five a replica, reached it.
    assert!(first.total_calls <= 26, "{} calls to the failing deployment", first.total_calls);
    assert_eq!(first.calls_5xx, first.total_calls);
    for job in &jobs {
        assert_eq!(second.paid_by_job.get(job), Some(&1), "{job} paid once, by the other");
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_of_another_region_refuses_the_start() {
    let stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    let us_endpoint = SimProvider::start(SimConfig::default()).await;
    let mut xc = stack.extractor_config(Region::Eu);
    xc.pool =
        vec![DeploymentConfig { class: xc.quota.model_class.clone(), ..second(&stack, &us_endpoint, Region::Us) }];
    let refused =
        reviewlane_extractor::build(xc).await.err().expect("an EU pool with a US deployment refuses to start");
    assert!(refused.to_string().contains("belongs to region `us`"), "{refused}");
    assert_eq!(us_endpoint.stats().total_calls, 0);
    stack.shutdown().await;
}

/// A tenant `id` under `key` whose reviews use `classes` (a TOML inline table's body).
fn tenant_with_classes(id: &str, key: &str, classes: &str) -> String {
    format!(
        "[[tenants]]\nid = \"{id}\"\nregion = \"us\"\napi_key_sha256 = [\"{}\"]\nclasses = {{ {classes} }}\n",
        reviewlane_core::tenants::hash_api_key(key)
    )
}

/// Starts the US extractor with a second deployment, serving class `fast`, beside the
/// region's first: the second's provider.
async fn start_with_fast_class(stack: &mut Stack) -> SimProvider {
    let fast = SimProvider::start(SimConfig::default()).await;
    let mut xc = stack.extractor_config(Region::Us);
    xc.pool = vec![DeploymentConfig { class: "fast".into(), ..second(stack, &fast, Region::Us) }];
    stack.start_extractor_with(Region::Us, xc).await;
    fast
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_names_the_class_of_each_lane_and_only_that_class_serves_it() {
    const KEY: &str = "classy-key";
    let tenant = tenant_with_classes("classy", KEY, "interactive = \"fast\"");
    let mut stack =
        Stack::start_with(StackOptions { extractors: 0, extra_tenants: tenant, ..Default::default() }).await;
    let fast = start_with_fast_class(&mut stack).await;
    let mut client = stack.client().await;
    let interactive = submit(&mut client, KEY, "classy-i", &sample_diff("ci")).await;
    let batch = submit_batch(&mut client, KEY, "classy-b", &sample_diff("cb")).await;
    for job in [&interactive, &batch] {
        let last = wait_final(&mut client, KEY, &job.job_id).await;
        assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    }
    let (default_class, fast_class) = (stack.us.provider.stats(), fast.stats());
    // Interactive reviews use `fast`, the only deployment of it; batch reviews the
    // region's class, on the first deployment.
    assert_eq!(fast_class.paid_by_job.keys().collect::<Vec<_>>(), vec![&interactive.job_id]);
    assert_eq!(default_class.paid_by_job.keys().collect::<Vec<_>>(), vec![&batch.job_id]);
    stack.shutdown().await;

    // A class no deployment serves refuses the start, naming tenant, lane and class.
    let tenant = tenant_with_classes("deep", "deep-key", "batch = \"deep\"");
    let stack = Stack::start_with(StackOptions { extractors: 0, extra_tenants: tenant, ..Default::default() }).await;
    let refused = reviewlane_extractor::build(stack.extractor_config(Region::Us)).await.err().expect("refused");
    assert!(refused.to_string().contains("tenant `deep`'s batch reviews use model class `deep`"), "{refused}");
    stack.shutdown().await;
}

/// Starts two US extractor processes, each with the second deployment at `other`
/// (`rpm` requests a minute) beside the first, and waits until both are ready. Each
/// calls the second account with a key of its own (`sk-second-<n>`), so the account
/// tells the processes' calls apart.
async fn two_extractor_processes(stack: &mut reviewlane_testkit::procs::ProcStack, other: &SimProvider, rpm: u64) {
    let dir = stack.log_dir().to_path_buf();
    for n in 0..2 {
        let key = dir.join(format!("second-{n}.key"));
        std::fs::write(&key, format!("sk-second-{n}")).unwrap();
        std::fs::write(
            dir.join(format!("deployments-{n}.toml")),
            format!(
                "[[deployments]]\nid = \"second\"\nkind = \"openai\"\nendpoint = \"{}\"\nmodel = \"sim\"\nregion = \"us\"\napi_key_file = \"{}\"\nbudgets = \"rpm={rpm}\"\n",
                other.base_url(),
                key.display()
            ),
        )
        .unwrap();
    }
    for _ in 0..2 {
        let name = stack
            .spawn_extractor_with(Region::Us, |n| {
                vec![("REVIEWLANE_DEPLOYMENTS_FILE", dir.join(format!("deployments-{n}.toml")).display().to_string())]
            })
            .expect("extractor starts");
        stack.wait_ready(&name).await.expect("extractor ready");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_failover_leaves_nothing_lost_and_nothing_paid_twice_but_its_calls() {
    use reviewlane_testkit::procs::{ProcStack, ensure_built, ensure_nats_server};
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    // Two extractor processes route one class over two accounts; calls take 300 ms, so
    // calls are in flight on both replicas when the first account runs out of money and
    // when one replica is killed right after.
    let sim = |latency| SimConfig { latency, limits: Some(SimLimits::openai(Some(600), None)), ..Default::default() };
    let latency = Duration::from_millis(300);
    let mut stack = ProcStack::start(StackOptions {
        extractors: 0,
        us_provider: sim(latency),
        key_budgets: vec![(Dimension::Requests, 600)],
        lease: Duration::from_secs(2),
        ..Default::default()
    })
    .await
    .expect("stack starts");
    let other = SimProvider::start(sim(latency)).await;
    two_extractor_processes(&mut stack, &other, 600).await;
    let mut client =
        reviewlane_api::proto::review_service_client::ReviewServiceClient::connect(format!("http://{}", stack.ingress))
            .await
            .unwrap();
    let n = 40;
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(submit(&mut client, US_KEY, &format!("kill-{i}"), &sample_diff(&format!("kill{i}"))).await.job_id);
    }
    // A few answered, then the first account is out of quota ...
    let some_paid = poll_until(Duration::from_secs(30), || async {
        (stack.us.provider.stats().paid_by_job.len() + other.stats().paid_by_job.len() >= 6).then_some(())
    })
    .await;
    assert!(some_paid.is_some(), "reviews were answered");
    stack.us.provider.script((0..10_000).map(|_| Scripted::insufficient_quota()));
    // ... and at its first such answer, the first replica dies.
    let failed =
        poll_until(Duration::from_secs(20), || async { (stack.us.provider.stats().calls_429 > 0).then_some(()) }).await;
    assert!(failed.is_some(), "the first account answered insufficient_quota");
    let failed_ms = stack.us.provider.epoch().elapsed().as_millis() as u64;
    let killed_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    stack.service("extractor-us").expect("the first replica").signal("KILL").unwrap();

    for id in &ids {
        let last = wait_final_within(&mut client, US_KEY, id, Duration::from_secs(60)).await;
        assert_eq!(last.state, JobState::Published as i32, "not lost: {last:?}");
    }
    let (first, second) = (stack.us.provider.stats(), other.stats());
    let _ = stack.shutdown();
    // Paid twice only where the killed replica had a call in flight: its answer was
    // paid but never recorded, and the other replica called again. Nothing else.
    let killed_keys = ["sk-load-0", "sk-second-0"];
    let mut paid: std::collections::BTreeMap<&str, Vec<&reviewlane_testkit::simprovider::PaidCall>> =
        Default::default();
    for c in first.paid_calls.iter().chain(second.paid_calls.iter()) {
        paid.entry(c.job.as_str()).or_default().push(c);
    }
    assert_eq!(paid.len(), n, "every review paid for");
    let twice: Vec<_> = paid.iter().filter(|(_, calls)| calls.len() > 1).collect();
    for (job, calls) in &twice {
        assert_eq!(calls.len(), 2, "{job}: {calls:?}");
        assert!(
            calls.iter().any(|c| killed_keys.contains(&c.key.as_str()) && c.started_unix_ms <= killed_at),
            "{job} paid twice without a call of the killed replica in flight: {calls:?}"
        );
    }
    assert!(twice.len() <= 8, "at most the killed replica's calls in flight: {}", twice.len());
    // Once out of quota, the first account was paid nothing more; and whether the dead
    // replica opened its circuit before dying or not, the surviving one sent it nothing
    // a second after the first such answer (its own answer opens it, fleet-wide).
    let after: Vec<_> = first.paid_calls.iter().filter(|c| c.started_unix_ms > killed_at).collect();
    assert!(after.is_empty(), "{after:?}");
    let late = first.call_times_by_key.get("sk-load-1").into_iter().flatten().filter(|t| **t > failed_ms + 1_000);
    assert_eq!(late.count(), 0, "calls to the account out of quota");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cheaper_deployment_takes_what_it_has_room_for_and_the_dearer_the_rest() {
    // The second deployment is priced far above the first (which has no price): while
    // the first can take a review, the second pulls none.
    let (stack, other) = two_deployments(1).await;
    let mut client = stack.client().await;
    for i in 0..8 {
        let job = submit(&mut client, US_KEY, &format!("cheap-{i}"), &sample_diff(&format!("cheap{i}"))).await;
        let last = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(20)).await;
        assert_eq!(last.state, JobState::Published as i32, "{last:?}");
        assert_eq!(last.deployment, "openai", "{last:?}");
    }
    assert_eq!(other.stats().total_calls, 0, "the dearer deployment was not called");
    // More at once than the first's budget allows in a minute: the rest go to the second.
    let jobs = all_published(&stack, "spill", RPM as usize).await;
    let (first, second) = (stack.us.provider.stats(), other.stats());
    assert!(second.total_calls > 0, "the dearer deployment took what the first could not");
    assert_eq!(first.calls_429 + second.calls_429, 0);
    for job in &jobs {
        let paid = first.paid_by_job.get(job).copied().unwrap_or(0) + second.paid_by_job.get(job).copied().unwrap_or(0);
        assert_eq!(paid, 1, "{job} paid once");
    }
    stack.shutdown().await;
}

/// A tenant whose reviews admitted at `changed_hunks` use class `fast`, its others the
/// region's class.
fn tiered_tenant(key: &str) -> String {
    tenant_with_classes("tiered", key, "changed_hunks = \"fast\"")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reviews_admitted_at_changed_hunks_go_to_the_class_their_tenant_names_for_them() {
    use reviewlane_api::proto::ReviewDepth;
    const KEY: &str = "tiered-key";
    // The slow lane of the scheduling tests (one call at a time of 400 ms on the
    // region's class, a 1 s window): a steady stream of submits is degraded.
    let mut stack = Stack::start_with(StackOptions {
        extractors: 0,
        extra_tenants: tiered_tenant(KEY),
        ..crate::scheduling::slow_lane_options()
    })
    .await;
    let region_class = stack.extractor_config(Region::Us).quota.model_class;
    let fast = start_with_fast_class(&mut stack).await;
    let mut client = stack.client().await;
    let (mut full, mut hunks) = (Vec::new(), Vec::new());
    for i in 0..80 {
        let req = reviewlane_testkit::stack::submit_req(KEY, &format!("tier-{i}"), &sample_diff(&format!("tier{i}")));
        match client.submit_review(req).await {
            Ok(answer) => {
                let r = answer.into_inner().review.expect("review set");
                match r.review_depth {
                    d if d == ReviewDepth::ChangedHunks as i32 => hunks.push(r.job_id),
                    _ => full.push(r.job_id),
                }
            }
            // The slow lane may also refuse at either depth (`LANE_OVER_WINDOW`): an
            // admission outcome, not this test's subject; the next arrival goes on.
            Err(status) if status.code() == tonic::Code::ResourceExhausted => {}
            Err(status) => panic!("submit refused: {status:?}"),
        }
        if hunks.len() >= 3 {
            break;
        }
        // The pace of arrivals, not a wait for a condition.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(!full.is_empty() && hunks.len() >= 3, "{} full, {} changed_hunks", full.len(), hunks.len());
    for (jobs, class, deployment) in [(&full, region_class.as_str(), "openai"), (&hunks, "fast", "second")] {
        for job in jobs {
            let last = wait_final_within(&mut client, KEY, job, Duration::from_secs(60)).await;
            assert_eq!(last.state, JobState::Published as i32, "{last:?}");
            assert_eq!((last.model_class.as_str(), last.deployment.as_str()), (class, deployment), "{last:?}");
        }
    }
    let (region_calls, fast_calls) = (stack.us.provider.stats(), fast.stats());
    let mut paid_fast: Vec<_> = fast_calls.paid_by_job.keys().cloned().collect();
    paid_fast.sort();
    hunks.sort();
    assert_eq!(paid_fast, hunks, "the fast class paid for exactly the changed_hunks reviews");
    for job in &full {
        assert_eq!(region_calls.paid_by_job.get(job), Some(&1), "{job}: paid once, by the region's class");
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_depth_class_named_or_dropped_reshapes_the_lane_consumers_in_place() {
    use async_nats::jetstream::consumer::PullConsumer;
    use reviewlane_shared::{Lane, layout};
    let stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    let fast = SimProvider::start(SimConfig::default()).await;
    let js = async_nats::jetstream::new(async_nats::connect(stack.us.nats.url()).await.unwrap());
    let stream = js.get_stream(layout::lane_stream(Region::Us, Lane::Interactive)).await.unwrap();
    let filter_of = |name: String| {
        let stream = stream.clone();
        async move {
            let found: Result<PullConsumer, _> = stream.get_consumer(&name).await;
            found.ok().map(|c| c.cached_info().config.filter_subject.clone())
        }
    };
    let (main, by_depth) =
        (layout::lane_consumer(Lane::Interactive, "tiered"), layout::lane_depth_consumer(Lane::Interactive, "tiered"));
    for (splits, main_filter, depth_filter) in [
        (true, "reviews.us.interactive.tiered.*", Some("reviews.us.interactive.tiered.changed_hunks.*")),
        (false, "reviews.us.interactive.tiered.>", None),
        (true, "reviews.us.interactive.tiered.*", Some("reviews.us.interactive.tiered.changed_hunks.*")),
    ] {
        let mut xc = stack.extractor_config(Region::Us);
        let tenant = if splits {
            tiered_tenant("tiered-key")
        } else {
            tiered_tenant("tiered-key").replace("classes = { changed_hunks = \"fast\" }\n", "")
        };
        let text = format!("{}\n{tenant}", reviewlane_testkit::stack::tenants_toml("http://127.0.0.1:9/"));
        xc.tenants = std::sync::Arc::new(reviewlane_core::tenants::Tenants::parse(&text).unwrap());
        xc.pool = vec![DeploymentConfig { class: "fast".into(), ..second(&stack, &fast, Region::Us) }];
        let app = reviewlane_extractor::build(xc).await.unwrap_or_else(|e| panic!("splits {splits}: {e}"));
        drop(app);
        assert_eq!(filter_of(main.clone()).await.as_deref(), Some(main_filter), "splits {splits}");
        assert_eq!(filter_of(by_depth.clone()).await.as_deref(), depth_filter, "splits {splits}");
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_runs_through_the_batch_api_of_a_deployment_of_its_tenants_class() {
    use reviewlane_api::proto::{
        AddSweepItemsRequest, CreateSweepRequest, GetSweepRequest, SealSweepRequest, SweepItem, SweepItemState,
        SweepMode,
    };
    const KEY: &str = "batchy-key";
    let tenant = tenant_with_classes("batchy", KEY, "batch = \"fast\"");
    // Both classes' deployments have a batch API: the region's class its first
    // deployment's, `fast` the second's.
    let mut stack =
        Stack::start_with(StackOptions { extractors: 0, extra_tenants: tenant, ..Default::default() }).await;
    let fast = start_with_fast_class(&mut stack).await;
    let mut client = stack.client().await;
    let sweep_of = |key: &'static str, name: &'static str| {
        let mut client = client.clone();
        async move {
            let create = CreateSweepRequest {
                idempotency_key: name.into(),
                mode: SweepMode::ProviderBatch as i32,
                ..Default::default()
            };
            let sweep = client.create_sweep(authed(key, create)).await.unwrap().into_inner().sweep.unwrap();
            assert_eq!(sweep.runs_on, SweepMode::ProviderBatch as i32, "{sweep:?}");
            let items = (0..3)
                .map(|i| SweepItem {
                    item_key: format!("f{i}"),
                    diff: sample_diff(&format!("{name}{i}")),
                    ..Default::default()
                })
                .collect();
            let page = AddSweepItemsRequest { sweep_id: sweep.sweep_id.clone(), items };
            client.add_sweep_items(authed(key, page)).await.unwrap();
            client.seal_sweep(authed(key, SealSweepRequest { sweep_id: sweep.sweep_id.clone() })).await.unwrap();
            sweep.sweep_id
        }
    };
    let (ours, regions) = (sweep_of(KEY, "batchy").await, sweep_of(US_KEY, "acme").await);
    for (key, id) in [(KEY, &ours), (US_KEY, &regions)] {
        let done = poll_until(Duration::from_secs(60), || {
            let mut client = client.clone();
            let id = id.clone();
            async move {
                let req = authed(key, GetSweepRequest { sweep_id: id });
                let s = client.get_sweep(req).await.ok()?.into_inner().sweep?;
                (s.percent_done == 100.0).then_some(s)
            }
        })
        .await
        .expect("every item final in time");
        let published = done.items.iter().find(|c| c.state == SweepItemState::Published as i32);
        assert_eq!(published.map(|c| c.count), Some(3), "{done:?}");
    }
    // Each sweep's three lines ran through its class's batch API, none on the lanes.
    let (first, second) = (stack.us.provider.batch_stats(), fast.batch_stats());
    assert_eq!(first.paid_lines.len(), 3, "{first:?}");
    assert_eq!(second.paid_lines.len(), 3, "{second:?}");
    assert_eq!(stack.us.provider.stats().total_calls + fast.stats().total_calls, 0);
    let items = reviewlane_api::proto::ListSweepItemsRequest { sweep_id: ours, page_size: 10, ..Default::default() };
    let items = client.list_sweep_items(authed(KEY, items)).await.unwrap().into_inner().items;
    for item in items {
        let review = client.get_review(authed(KEY, reviewlane_api::proto::GetReviewRequest { job_id: item.job_id }));
        let review = review.await.unwrap().into_inner().review.unwrap();
        assert_eq!((review.deployment.as_str(), review.model_class.as_str()), ("second", "fast"), "{review:?}");
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_reviews_parts_run_on_another_deployment_of_its_class_when_its_own_has_no_room() {
    use reviewlane_core::parts::{self, PartLimits, Tokenizer};
    // Calls long enough to overlap; the admitting deployment takes 2 at once, the
    // second (dearer, so ranked behind) 4.
    let latency = SimConfig { latency: Duration::from_millis(200), ..Default::default() };
    let mut stack = Stack::start_with(StackOptions {
        extractors: 0,
        max_diff_bytes: 4 * 1024 * 1024,
        key_limit: 2,
        us_provider: latency.clone(),
        ..Default::default()
    })
    .await;
    let other = SimProvider::start(latency).await;
    let mut xc = stack.extractor_config(Region::Us);
    xc.pool = vec![DeploymentConfig { key_limit: 4, budgets: Vec::new(), ..second(&stack, &other, Region::Us) }];
    stack.start_extractor_with(Region::Us, xc).await;
    let mut client = stack.client().await;
    let diff = reviewlane_testkit::diffs::large(40, 1000);
    let limits = PartLimits { max_tokens: 100_000, ..Default::default() };
    let count = reviewlane_extractor::tokenizer::counter(Tokenizer::default());
    let n = parts::split(&reviewlane_core::diff::parse(&diff).unwrap(), &limits, count.as_ref()).len();
    assert!(n >= 8, "{n} parts");
    let job = submit(&mut client, US_KEY, "split-pool", &diff).await;
    let done = wait_final_within(&mut client, US_KEY, &job.job_id, Duration::from_secs(90)).await;
    assert_eq!(done.state, JobState::Published as i32, "{done:?}");
    assert_eq!((done.parts_total, done.parts_done), (n as u32, n as u32));
    let (first, second) = (stack.us.provider.stats(), other.stats());
    let on = |s: &reviewlane_testkit::simprovider::Stats| {
        s.paid_by_part.iter().filter(|(k, _)| k.starts_with(&job.job_id)).map(|(_, v)| *v).collect::<Vec<_>>()
    };
    let (on_first, on_second) = (on(&first), on(&second));
    // Every part paid once, on one deployment or the other; both took some.
    assert_eq!(on_first.len() + on_second.len(), n, "{on_first:?} {on_second:?}");
    assert!(on_first.iter().chain(&on_second).all(|v| *v == 1), "{on_first:?} {on_second:?}");
    assert!(!on_first.is_empty() && !on_second.is_empty(), "{on_first:?} {on_second:?}");
    // Each within its own window.
    assert!(
        first.max_concurrent <= 2 && second.max_concurrent <= 4,
        "{} / {}",
        first.max_concurrent,
        second.max_concurrent
    );
    // Each part charged at the price of the deployment that answered it (100 tokens in,
    // 50 out a call in the simulation; the first deployment has no price).
    let per_call = (100.0 * SECOND_PRICE.input_per_mtok + 50.0 * SECOND_PRICE.output_per_mtok) / 1e6;
    let want = per_call * on_second.len() as f64;
    assert!((done.estimated_cost_usd - want).abs() < 1e-9, "{} against {want}", done.estimated_cost_usd);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_extractor_processes_route_a_class_over_two_deployments_each_within_its_budget() {
    use reviewlane_testkit::procs::{ProcStack, ensure_built, ensure_nats_server};
    ensure_nats_server().expect("nats-server");
    ensure_built().expect("service binaries build");
    // Each account allows `RPM` requests a minute, and each deployment is configured
    // with that budget; the two processes share it through `QUOTA_US`.
    let sim = || SimConfig { limits: Some(SimLimits::openai(Some(RPM), None)), ..Default::default() };
    let mut stack = ProcStack::start(StackOptions {
        extractors: 0,
        us_provider: sim(),
        key_budgets: vec![(Dimension::Requests, RPM)],
        ..Default::default()
    })
    .await
    .expect("stack starts");
    let other = SimProvider::start(sim()).await;
    two_extractor_processes(&mut stack, &other, RPM).await;
    let mut client =
        reviewlane_api::proto::review_service_client::ReviewServiceClient::connect(format!("http://{}", stack.ingress))
            .await
            .unwrap();
    // More than one account allows in a minute, fewer than both do.
    let n = RPM as usize + RPM as usize / 2;
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(submit(&mut client, US_KEY, &format!("procs-{i}"), &sample_diff(&format!("procs{i}"))).await.job_id);
    }
    for id in &ids {
        let last = wait_final_within(&mut client, US_KEY, id, Duration::from_secs(60)).await;
        assert_eq!(last.state, JobState::Published as i32, "{last:?}");
    }
    let (first, second) = (stack.us.provider.stats(), other.stats());
    let _ = stack.shutdown();
    // Neither account was asked past its budget, though both processes called both.
    assert_eq!((first.calls_429, second.calls_429), (0, 0), "{first:?} {second:?}");
    for (stats, keys) in [(&first, ["sk-load-0", "sk-load-1"]), (&second, ["sk-second-0", "sk-second-1"])] {
        for key in keys {
            assert!(stats.call_times_by_key.get(key).is_some_and(|t| !t.is_empty()), "no call with {key}");
        }
    }
    for id in &ids {
        let paid = first.paid_by_job.get(id).copied().unwrap_or(0) + second.paid_by_job.get(id).copied().unwrap_or(0);
        assert_eq!(paid, 1, "{id} paid once");
    }
}

/// The pool's statuses listed while every replica rewrites them (each does every few
/// seconds): each listing names every deployment once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pools_statuses_listed_while_they_are_rewritten_name_every_deployment_once() {
    use reviewlane_core::region::Region;
    use reviewlane_shared::layout::{self, LayoutConfig};
    use reviewlane_shared::pool_status::{self, DeploymentStatus};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let nats = reviewlane_shared::testing::NatsServer::start();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let layout = layout::ensure(&js, Region::Us, &LayoutConfig::default()).await.unwrap();
    let status = |i: usize| DeploymentStatus {
        deployment: format!("dep-{i:02}"),
        kind: "openai".into(),
        model: "m".into(),
        model_class: "fast".into(),
        state: "routing".into(),
        in_flight: 0,
        window: 4,
        budgets: Vec::new(),
        paused_for_ms: None,
        observed_at_ms: 0,
    };
    let n = 20;
    for i in 0..n {
        pool_status::put(&layout.quota, &status(i)).await.unwrap();
    }
    let (stop, rewrites) = (std::sync::Arc::new(AtomicBool::new(false)), std::sync::Arc::new(AtomicUsize::new(0)));
    let writer = {
        let (kv, stop, rewrites) = (layout.quota.clone(), stop.clone(), rewrites.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let i = rewrites.fetch_add(1, Ordering::Relaxed);
                pool_status::put(&kv, &DeploymentStatus { observed_at_ms: i as u64, ..status(i % n) }).await.unwrap();
            }
        })
    };
    let want: Vec<String> = (0..n).map(|i| status(i).deployment).collect();
    for round in 0..200 {
        let listed: Vec<String> =
            pool_status::list(&layout.quota).await.unwrap().into_iter().map(|s| s.deployment).collect();
        assert_eq!(listed, want, "listing {round}");
    }
    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();
    assert!(rewrites.load(Ordering::Relaxed) > 200, "the statuses were rewritten throughout");
}
