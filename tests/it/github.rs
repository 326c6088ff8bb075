//! The GitHub pull-request review sink against a fake GitHub API that enforces the real
//! one's rules: line comments only on the pull request's diff, a marker per finding so
//! a re-run posts nothing twice, a 422 moved into the summary, both rate limits obeyed
//! without a retry storm, and a backlog slowed down after a secondary limit so it meets
//! the limit once; a token from a file, or a GitHub App's installation token minted
//! from its private key.

use std::time::Duration;

use reviewlane_api::proto::{self, JobState};
use reviewlane_testkit::fakegithub::{FakeGitHub, PullRequest};
use serde_json::Value;

use crate::harness::*;

const OCTO_KEY: &str = "key-octo-us";

fn file(name: &str, text: &str) -> String {
    format!(
        "diff --git a/{name} b/{name}\n--- a/{name}\n+++ b/{name}\n@@ -1,2 +1,3 @@\n fn keep() {{}}\n+{text}\n fn end() {{}}\n"
    )
}

async fn review(stack: &Stack, idem: &str, diff: &str, pr: u32) -> proto::Review {
    let mut client = stack.client().await;
    let mut req = submit_req(OCTO_KEY, idem, diff);
    let meta = req.get_mut().metadata.as_mut().unwrap();
    meta.repository = "octo/app".into();
    meta.pull_request = pr;
    meta.head_revision = "c0ffee".into();
    let job = client.submit_review(req).await.unwrap().into_inner().review.unwrap();
    wait_final_within(&mut client, OCTO_KEY, &job.job_id, Duration::from_secs(60)).await
}

/// A stack whose tenant `octo` posts to `fake` with `auth` (the sink's `token_file = ...`
/// or `app = {...}`).
async fn stack_for(fake: &FakeGitHub, auth: &str) -> Stack {
    let tenant = format!(
        "[[tenants]]\nid = \"octo\"\nregion = \"us\"\napi_key_sha256 = [\"{}\"]\nallow_private_webhook = true\nsink = {{ kind = \"github\", api_url = \"{}\", {auth}, max_comments = 20 }}\n",
        reviewlane_core::tenants::hash_api_key(OCTO_KEY),
        fake.url(),
    );
    Stack::start_with(StackOptions { extra_tenants: tenant, ..Default::default() }).await
}

/// An RSA key pair as a GitHub App has (PKCS#1 private key, SPKI public key), made by
/// openssl: (private key file, public key PEM).
fn app_key(dir: &std::path::Path) -> (std::path::PathBuf, Vec<u8>) {
    let key = dir.join("app.pem");
    let public = dir.join("app.pub.pem");
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl").args(args).output().expect("openssl runs");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    run(&["genrsa", "-traditional", "-out", key.to_str().unwrap(), "2048"]);
    run(&["rsa", "-in", key.to_str().unwrap(), "-pubout", "-out", public.to_str().unwrap()]);
    (key, std::fs::read(public).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn findings_become_one_review_with_line_comments_and_a_rerun_posts_nothing_twice() {
    let (a, b, g) = (
        file("src/a.rs", "let a = x.unwrap();"),
        file("src/b.rs", "let b = y.unwrap();"),
        file("src/g.rs", "let g = u.unwrap();"),
    );
    let (fake, stack, _token) = token_stack(7, format!("{a}{b}{g}")).await;

    // The reviewed diff has a file the pull request's diff does not show.
    let diff = format!("{a}{b}{}", file("src/c.rs", "let c = z.unwrap();"));
    let done = review(&stack, "pr-7", &diff, 7).await;
    assert_eq!(done.state, JobState::Published as i32, "{done:?}");
    let posted = fake.reviews();
    assert_eq!(posted.len(), 1);
    let paths: Vec<&str> = posted[0].comments.iter().map(|c| c["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["src/a.rs", "src/b.rs"]);
    assert!(posted[0].comments.iter().all(|c| c["side"] == "RIGHT" && c["line"] == 2));
    let c_fp = done.findings.iter().find(|f| f.path == "src/c.rs").unwrap().fingerprint.clone();
    assert!(posted[0].body.contains(&format!("<!-- reviewlane:fingerprint={c_fp} -->")), "{}", posted[0].body);

    // The same findings again (another job): all already there, nothing posted.
    let again = review(&stack, "pr-7-again", &diff, 7).await;
    assert_eq!(again.state, JobState::Published as i32);
    assert_eq!(fake.reviews().len(), 1);

    // A new finding on a line of the pull request's diff, which GitHub refuses (422):
    // the review is posted with it in its summary instead of failing.
    fake.refuse_comments();
    let moved = review(&stack, "pr-7-moved", &g, 7).await;
    assert_eq!(moved.state, JobState::Published as i32, "{moved:?}");
    let refused = fake.requests().iter().filter(|r| r.1 == "POST" && r.3 == 422).count();
    assert_eq!(refused, 1);
    assert_eq!(fake.reviews().len(), 2);
    let last = fake.reviews().last().cloned().unwrap();
    assert!(last.comments.is_empty());
    assert!(last.body.contains("src/g.rs"), "{}", last.body);

    // A review that names no pull request cannot be posted: delivery_rejected.
    let no_pr = review(&stack, "no-pr", &file("src/e.rs", "let e = v.unwrap();"), 0).await;
    assert_eq!((no_pr.state, no_pr.terminal_reason.as_str()), (JobState::Terminal as i32, "delivery_rejected"));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn githubs_primary_and_secondary_rate_limits_are_waited_out_without_a_storm() {
    // This sink posts as a GitHub App: installation tokens minted from its private key.
    let dir = tempfile::tempdir().unwrap();
    let (key, public) = app_key(dir.path());
    let pr_diff = file("src/a.rs", "let a = x.unwrap();");
    let fake = FakeGitHub::start(PullRequest {
        repository: "octo/app".into(),
        number: 9,
        head: "c0ffee".into(),
        diff: pr_diff.clone(),
        token: "ghs-installation".into(),
        app: Some(("31337".into(), 42, public)),
    })
    .await;
    let auth =
        format!("app = {{ app_id = \"31337\", installation_id = 42, private_key_file = \"{}\" }}", key.display());
    let stack = stack_for(&fake, &auth).await;

    // Secondary limit: the review is refused 429 with retry-after 1, once.
    fake.secondary_limit([1]);
    let done = review(&stack, "secondary", &pr_diff, 9).await;
    assert_eq!(done.state, JobState::Published as i32, "{done:?}");
    let posts: Vec<_> = fake.requests().into_iter().filter(|r| r.1 == "POST" && r.2.ends_with("/reviews")).collect();
    assert_eq!(posts.len(), 2, "{posts:?}");
    assert_eq!(posts[0].3, 429);
    assert!(posts[1].0 - posts[0].0 >= Duration::from_secs(1), "retried before retry-after");

    // Primary limit: the next request is refused 403 with no requests left until the
    // reset 2 s later; nothing is sent to GitHub before then.
    fake.primary_limit(0, Duration::from_secs(2));
    let before = fake.requests().len();
    let done = review(&stack, "primary", &file("src/a.rs", "let b = y.unwrap();").replace("a.rs", "f.rs"), 9).await;
    assert_eq!(done.state, JobState::Published as i32, "{done:?}");
    let after: Vec<_> = fake.requests().into_iter().skip(before).collect();
    let limited: Vec<_> = after.iter().filter(|r| r.3 == 403).collect();
    assert_eq!(limited.len(), 1, "requests sent while limited: {after:?}");
    let resumed = after.iter().find(|r| r.3 == 200).expect("delivered after the reset");
    assert!(resumed.0 - limited[0].0 >= Duration::from_secs(1), "{after:?}");
    assert_eq!(fake.reviews().len(), 2);
    // One installation token served both deliveries.
    assert_eq!(fake.minted(), 1);
    // The pause was shared with the region's other publishers (PUBLISHED_US).
    assert!(!shared_entries(&stack, "github-pause.").await.is_empty(), "no shared pause recorded");
    stack.shutdown().await;
}

/// The entries of `PUBLISHED_US` whose keys start with `prefix`: what the region's
/// publishers share.
async fn shared_entries(stack: &Stack, prefix: &str) -> Vec<(String, bytes::Bytes)> {
    let js = async_nats::jetstream::new(async_nats::connect(stack.us.url()).await.unwrap());
    let published =
        js.get_key_value(reviewlane_shared::layout::published_bucket(reviewlane_shared::Region::Us)).await.unwrap();
    let mut keys = published.keys().await.unwrap();
    let mut shared = Vec::new();
    while let Some(k) = futures::StreamExt::next(&mut keys).await {
        let k = k.unwrap();
        if k.starts_with(prefix) {
            let value = published.get(&k).await.unwrap().unwrap_or_default();
            shared.push((k, value));
        }
    }
    shared
}

/// A fake GitHub serving pull request `number` of `octo/app` to the token `ghp-test`,
/// and a stack posting to it with that token (kept in the file returned).
async fn token_stack(number: u32, pr_diff: String) -> (FakeGitHub, Stack, tempfile::NamedTempFile) {
    let fake = FakeGitHub::start(PullRequest {
        repository: "octo/app".into(),
        number,
        head: "c0ffee".into(),
        diff: pr_diff,
        token: "ghp-test".into(),
        app: None,
    })
    .await;
    let token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token.path(), "ghp-test\n").unwrap();
    let stack = stack_for(&fake, &format!("token_file = \"{}\"", token.path().display())).await;
    (fake, stack, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_that_uses_the_last_request_stops_the_delivery_until_the_reset() {
    let pr_diff = file("src/a.rs", "let a = x.unwrap();");
    let (fake, stack, _token) = token_stack(11, pr_diff.clone()).await;
    // The delivery's first request is answered 200 with no requests left, resetting
    // 2 s later; GitHub refuses every request until then.
    fake.primary_limit(1, Duration::from_secs(2));
    let done = review(&stack, "last-request", &pr_diff, 11).await;
    assert_eq!(done.state, JobState::Published as i32, "{done:?}");
    let requests = fake.requests();
    assert!(requests.iter().all(|r| r.3 != 403), "a request was sent while paused: {requests:?}");
    let (first, next) = (&requests[0], &requests[1]);
    assert_eq!(first.3, 200);
    assert!(next.0 - first.0 >= Duration::from_millis(1900), "sent {:?} after the last request", next.0 - first.0);
    assert_eq!(fake.reviews().len(), 1);
    stack.shutdown().await;
}

/// Six reviews of pull request 11, one file each, submitted at once and waited for:
/// the fake, the stack, the finished reviews (all published).
async fn six_reviews_at_once(
    prepare: impl FnOnce(&FakeGitHub),
) -> (FakeGitHub, Stack, tempfile::NamedTempFile, Vec<proto::Review>) {
    let files: Vec<String> =
        (0..6).map(|i| file(&format!("src/m{i}.rs"), &format!("let v{i} = q.unwrap();"))).collect();
    let (fake, stack, token) = token_stack(11, files.concat()).await;
    prepare(&fake);
    let reviews = files.iter().enumerate().map(|(i, diff)| {
        let stack = &stack;
        async move { review(stack, &format!("pace-{i}"), diff, 11).await }
    });
    let done = futures::future::join_all(reviews).await;
    for d in &done {
        assert_eq!(d.state, JobState::Published as i32, "{d:?}");
    }
    (fake, stack, token, done)
}

/// The fake's answers to posting a review: (when, status).
fn review_posts(fake: &FakeGitHub) -> Vec<(std::time::Instant, u16)> {
    fake.requests().into_iter().filter(|r| r.1 == "POST" && r.2.ends_with("/reviews")).map(|r| (r.0, r.3)).collect()
}

/// The value of the us publisher's metric line starting with `prefix`.
async fn publisher_metric(stack: &Stack, prefix: &str) -> f64 {
    let (_, admin) = stack.publisher_admin.iter().find(|(r, _)| *r == reviewlane_shared::Region::Us).unwrap();
    let page = reviewlane_testkit::stack::http_get(*admin, "/metrics").await;
    let line = page.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix}: {page}"));
    line.rsplit_once(' ').and_then(|(_, v)| v.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reviews_of_one_pull_request_are_posted_a_second_apart_after_a_secondary_limit() {
    // The first review to post meets a secondary limit (retry-after 2): every delivery
    // to the account waits, then all six are due at once.
    let (fake, stack, _token, _) = six_reviews_at_once(|fake| fake.secondary_limit([2])).await;
    let posts = review_posts(&fake);
    let refused: Vec<_> = posts.iter().filter(|r| r.1 != 200).collect();
    assert_eq!(refused.len(), 1, "only the scripted limit, no secondary limit of our making: {posts:?}");
    let posted: Vec<_> = posts.iter().filter(|r| r.1 == 200).collect();
    assert_eq!(posted.len(), 6);
    for pair in posted.windows(2) {
        assert!(pair[1].0 - pair[0].0 >= Duration::from_secs(1), "posts {:?} apart", pair[1].0 - pair[0].0);
    }
    // Secondary limits are counted.
    let secondary = r#"reviewlane_github_rate_limited_total{region="us",kind="secondary"}"#;
    assert_eq!(publisher_metric(&stack, secondary).await, 1.0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_secondary_limit_a_backlog_slows_down_and_meets_it_once() {
    // GitHub allows 2 content-creating requests per rolling 4 s (the shape of 2 per
    // 10 s, shorter): at the configured pace the third review meets the limit, and so
    // would every second one after each wait.
    let (fake, stack, _token, done) = six_reviews_at_once(|fake| fake.content_limit(2, Duration::from_secs(4))).await;
    let posts = review_posts(&fake);
    let limited: Vec<_> = posts.iter().filter(|r| r.1 == 403).collect();
    assert!(limited.len() <= 1, "the limit met again after slowing down: {posts:?}");
    // Each review posted exactly once: each job's finding is in one review on GitHub.
    let posted = fake.reviews();
    assert_eq!(posted.len(), 6, "{posts:?}");
    for d in &done {
        let marker = format!("<!-- reviewlane:fingerprint={} -->", d.findings[0].fingerprint);
        let carrying = posted
            .iter()
            .filter(|r| r.body.contains(&marker) || r.comments.iter().any(|c| c.to_string().contains(&marker)))
            .count();
        assert_eq!(carrying, 1, "{} carried by {carrying} reviews", d.job_id);
    }
    // The interval was widened (at least doubled from 1.1 s), reported, and shared with
    // the region's other publishers.
    let interval = publisher_metric(&stack, r#"reviewlane_github_content_interval_seconds{region="us"}"#).await;
    assert!(interval >= 2.2, "content interval {interval} s");
    let shared = shared_entries(&stack, "github-interval.").await;
    let widened: Vec<Value> = shared.iter().map(|(_, v)| serde_json::from_slice(v).unwrap()).collect();
    assert!(matches!(widened.as_slice(), [w] if w["interval_ms"].as_u64() >= Some(2200)), "{widened:?}");
    stack.shutdown().await;
}
