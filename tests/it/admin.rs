//! Every service's admin port: `/healthz` (alive), `/readyz` (its NATS connected and its
//! streams present), `/metrics`.

use std::net::SocketAddr;
use std::time::Duration;

use reviewlane_core::region::Region;

use crate::harness::*;

async fn ready(addr: SocketAddr) -> bool {
    http_get(addr, "/readyz").await == "ready\n"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_reports_health_and_readiness() {
    let mut stack = Stack::start().await;
    let mut all = vec![("ingress", Region::Us, stack.ingress_admin)];
    all.extend(stack.extractor_admin.iter().map(|(r, a)| ("extractor", *r, *a)));
    all.extend(stack.publisher_admin.iter().map(|(r, a)| ("publisher", *r, *a)));
    assert_eq!(all.len(), 5);
    for (name, region, addr) in &all {
        assert_eq!(http_get(*addr, "/healthz").await, "ok\n", "{name} {region}");
        assert!(ready(*addr).await, "{name} {region} ready");
        assert!(http_get(*addr, "/metrics").await.ends_with("# EOF\n"), "{name} {region} metrics");
    }

    // The US NATS goes away: the US services and the ingress (which serves both regions)
    // stop being ready; the EU services stay ready; everyone stays alive.
    stack.us.nats.kill();
    for (name, region, addr) in &all {
        let should_be_ready = *name != "ingress" && *region == Region::Eu;
        let seen =
            poll_until(Duration::from_secs(10), || async { (ready(*addr).await == should_be_ready).then_some(()) });
        assert!(seen.await.is_some(), "{name} {region}: ready is not {should_be_ready}");
        assert_eq!(http_get(*addr, "/healthz").await, "ok\n", "{name} {region} alive");
    }
    // No orderly shutdown: the US services cannot drain a dead server; dropping the
    // stack stops them.
}

/// A gauge sample for the US interactive lane, from a Prometheus text page.
fn lane_sample(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find(|l| {
            l.starts_with(&format!("{name}{{")) && l.contains("lane=\"interactive\"") && l.contains("region=\"us\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_age_rises_while_a_paused_scope_holds_work_and_falls_after_it_drains() {
    use reviewlane_api::proto::JobState;
    use reviewlane_testkit::simprovider::Scripted;

    let stack = Stack::start().await;
    // The first call is refused with a 3 s pause: its review stays on the lane.
    stack.us.provider.script([Scripted::Status {
        status: 429,
        headers: vec![("retry-after".into(), "3".into())],
        body: r#"{"error":{"code":"rate_limit_exceeded"}}"#.into(),
    }]);
    let admin = stack.extractor_admin.iter().find(|(r, _)| *r == Region::Us).unwrap().1;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "aged", &sample_diff("aged")).await;

    let age_at_least = |min: f64| async move {
        let reached = poll_until(Duration::from_secs(4), || async {
            let page = http_get(admin, "/metrics").await;
            let age = lane_sample(&page, "reviewlane_queue_age_seconds").filter(|age| *age >= min)?;
            Some((age, lane_sample(&page, "reviewlane_queue_depth")))
        })
        .await;
        let (age, depth) = reached.unwrap_or_else(|| panic!("queue age never reached {min} s"));
        assert_eq!(depth, Some(1.0));
        age
    };
    let first = age_at_least(0.5).await;
    // Sampled once a second: the next sample is about a second older (not exactly).
    let later = age_at_least(first + 0.5).await;
    assert!(later > first);

    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    let drained = poll_until(Duration::from_secs(5), || async {
        let page = http_get(admin, "/metrics").await;
        let zero = |name| lane_sample(&page, name) == Some(0.0);
        (zero("reviewlane_queue_age_seconds") && zero("reviewlane_queue_depth")).then_some(())
    })
    .await;
    assert!(drained.is_some(), "queue age did not fall after the drain");
    stack.shutdown().await;
}

/// Metric names (`reviewlane_*`) the alert rules and the dashboard's queries use.
fn referenced_metrics() -> std::collections::BTreeSet<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let rules = std::fs::read_to_string(root.join("k8s/alerts/reviewlane-rules.yaml")).unwrap();
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("k8s/dashboards/reviewlane.json")).unwrap()).unwrap();
    let mut texts = vec![rules];
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            texts.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    for v in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            texts.push(q.to_string());
        }
    }
    let mut names = std::collections::BTreeSet::new();
    for text in texts {
        let mut rest = text.as_str();
        while let Some(i) = rest.find("reviewlane_") {
            let tail = &rest[i..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_alerts_and_dashboard_use_is_exposed_after_a_workload() {
    use reviewlane_api::proto::JobState;
    use reviewlane_testkit::simprovider::{Scripted, findings_for};

    let stack = Stack::start().await;
    let mut client = stack.client().await;
    // A 429, then findings of which one names a file outside the diff (quarantined).
    let diff = sample_diff("metrics-1");
    stack.us.provider.script([
        Scripted::Status {
            status: 429,
            headers: vec![("retry-after".into(), "1".into())],
            body: r#"{"error":{"code":"rate_limit_exceeded"}}"#.into(),
        },
        Scripted::Output(findings_for(&diff, true).to_string()),
    ]);
    let job = submit(&mut client, US_KEY, "metrics-1", &diff).await;
    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    // The same review again: answered from the result cache, no call.
    let calls = stack.us.provider.stats().total_calls;
    let again = submit(&mut client, US_KEY, "metrics-1-again", &diff).await;
    assert_eq!(wait_final(&mut client, US_KEY, &again.job_id).await.state, JobState::Published as i32);
    assert_eq!(stack.us.provider.stats().total_calls, calls, "a cache hit pays no call");
    // Output that is never valid: terminal after the schema budget.
    let garbage = Scripted::Output("not json".into());
    stack.us.provider.script([garbage.clone(), garbage.clone(), garbage]);
    let bad = submit(&mut client, US_KEY, "metrics-bad", &sample_diff("metrics-bad")).await;
    assert_eq!(wait_final(&mut client, US_KEY, &bad.job_id).await.terminal_reason, "invalid_output");

    let mut admins = vec![stack.ingress_admin];
    admins.extend(stack.extractor_admin.iter().map(|(_, a)| *a));
    admins.extend(stack.publisher_admin.iter().map(|(_, a)| *a));
    let names = referenced_metrics();
    assert!(names.len() >= 15, "{names:?}");
    let missing = async || {
        let mut pages = String::new();
        for a in &admins {
            pages.push_str(&http_get(*a, "/metrics").await);
        }
        let exposed =
            |n: &&String| pages.lines().any(|l| l.starts_with(&format!("{n}{{")) || l.starts_with(&format!("{n} ")));
        names.iter().filter(|n| !exposed(n)).cloned().collect::<Vec<String>>()
    };
    let all = poll_until(Duration::from_secs(5), || async { missing().await.is_empty().then_some(()) }).await;
    assert!(all.is_some(), "referenced but never exposed: {:?}", missing().await);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_counts_the_messages_it_sends_to_nats() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let sent = |page: String| {
        page.lines()
            .filter(|l| l.starts_with("reviewlane_nats_messages_total{") && l.contains("direction=\"sent\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let us = |list: &Vec<(reviewlane_shared::Region, std::net::SocketAddr)>| {
        list.iter().find(|(r, _)| *r == reviewlane_shared::Region::Us).unwrap().1
    };
    let before = sent(http_get(stack.ingress_admin, "/metrics").await);
    let job = submit(&mut client, US_KEY, "counted", &sample_diff("counted")).await;
    wait_final(&mut client, US_KEY, &job.job_id).await;
    // The submit wrote the lane message, the job record and the index entry: three
    // requests at least.
    let after = sent(http_get(stack.ingress_admin, "/metrics").await);
    assert!(after - before >= 3.0, "ingress sent {before} -> {after}");
    for addr in [us(&stack.extractor_admin), us(&stack.publisher_admin)] {
        assert!(sent(http_get(addr, "/metrics").await) > 0.0);
    }
    stack.shutdown().await;
}
