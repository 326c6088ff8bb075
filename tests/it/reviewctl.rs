//! `reviewctl`, the real binary, against the real stack: submit from stdin, a file or
//! `git diff`, wait, and exit with the documented code; findings as JSON, SARIF (valid
//! against the OASIS schema), rdjsonl and text; a terminal failure, a refusal and an
//! unknown key.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use reviewlane_testkit::simprovider::{Scripted, SimConfig};
use tokio::io::AsyncWriteExt;

use crate::harness::*;

/// Builds `reviewctl` in the test's profile (a no-op when up to date) and returns it.
fn reviewctl() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = std::process::Command::new(cargo);
            cmd.current_dir(root).args(["build", "--quiet", "-p", "reviewctl"]);
            if !cfg!(debug_assertions) {
                cmd.arg("--release");
            }
            assert!(cmd.status().expect("cargo build").success(), "reviewctl builds");
            reviewlane_testkit::procs::bin_dir().unwrap().join("reviewctl")
        })
        .clone()
}

/// Runs git in `dir` as a test user; fails the test when git fails.
fn git_in(dir: &std::path::Path, args: &[&str]) {
    let ok = std::process::Command::new("git")
        .args(["-c", "user.email=t@example.invalid", "-c", "user.name=t", "-c", "init.defaultBranch=main"])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(ok.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&ok.stderr));
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs `reviewctl args` against `stack` with `key`, feeding `stdin`, in `dir`.
async fn run(stack: &Stack, key: &str, args: &[&str], stdin: Option<&str>, dir: Option<&std::path::Path>) -> Run {
    run_at(&format!("http://{}", stack.ingress), key, args, stdin, dir).await
}

/// Runs `reviewctl args` against the service at `endpoint`.
async fn run_at(endpoint: &str, key: &str, args: &[&str], stdin: Option<&str>, dir: Option<&std::path::Path>) -> Run {
    let mut cmd = tokio::process::Command::new(reviewctl());
    cmd.args(args)
        .env("REVIEWLANE_ENDPOINT", endpoint)
        .env_remove("REVIEWLANE_REQUEST_TIMEOUT_SECS")
        .env("REVIEWLANE_API_KEY", key)
        .env_remove("REVIEWLANE_API_KEY_FILE")
        .env("HOME", std::env::temp_dir())
        .env_remove("XDG_CONFIG_HOME")
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(d) = dir {
        cmd.current_dir(d);
    }
    let mut child = cmd.spawn().expect("reviewctl starts");
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().unwrap();
        pipe.write_all(text.as_bytes()).await.unwrap();
        drop(pipe);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("reviewctl finishes within 60 s")
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_wait_exits_by_the_findings_and_writes_every_format() {
    let stack = Stack::start().await;
    let diff = sample_diff("cli");
    // The simulated provider reports low-severity findings.
    let json =
        run(&stack, US_KEY, &["submit", "--wait", "--fail-on", "high", "--format", "json"], Some(&diff), None).await;
    assert_eq!(json.code, 0, "{}", json.stderr);
    let review: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(review["state"], "published");
    assert_eq!(review["schema_version"], "findings.v2");
    let finding = &review["findings"][0];
    assert_eq!((finding["path"].as_str(), finding["severity"].as_str()), (Some("src/handler.rs"), Some("low")));
    assert!(finding["suggested_action"].is_string() && finding["fingerprint"].is_string(), "{finding}");

    // The same submit again is the same review (the key comes from the diff): at or
    // above `low` it fails the build.
    let low =
        run(&stack, US_KEY, &["submit", "--wait", "--fail-on", "low", "--format", "json"], Some(&diff), None).await;
    assert_eq!(low.code, 1, "{}", low.stderr);
    let again: serde_json::Value = serde_json::from_str(&low.stdout).unwrap();
    assert_eq!(again["job_id"], review["job_id"]);
    assert_eq!(stack.us.provider.stats().total_calls, 1, "the repeat was not reviewed again");
    // Without --wait the repeat's answer is the job as it is, findings counted.
    let repeat = run(&stack, US_KEY, &["submit"], Some(&diff), None).await;
    assert_eq!(repeat.code, 0, "{}", repeat.stderr);
    let count = review["findings"].as_array().unwrap().len();
    assert!(repeat.stderr.contains(&format!("published, {count} findings")), "{}", repeat.stderr);

    // SARIF, valid against the OASIS schema; rdjsonl; text grouped by file.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &diff).unwrap();
    let path = file.path().to_str().unwrap();
    let sarif = run(&stack, US_KEY, &["submit", path, "--wait", "--format", "sarif"], None, None).await;
    assert_eq!(sarif.code, 0, "{}", sarif.stderr);
    let log: serde_json::Value = serde_json::from_str(&sarif.stdout).unwrap();
    let schema =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/vendor/sarif/sarif-schema-2.1.0.json")).unwrap();
    let validator = jsonschema::validator_for(&serde_json::from_str(&schema).unwrap()).unwrap();
    let errors: Vec<String> = validator.iter_errors(&log).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
        "src/handler.rs"
    );
    let rd = run(&stack, US_KEY, &["get", review["job_id"].as_str().unwrap(), "--format", "rdjsonl"], None, None).await;
    assert_eq!(rd.code, 0, "{}", rd.stderr);
    let line: serde_json::Value = serde_json::from_str(rd.stdout.lines().next().unwrap()).unwrap();
    assert_eq!(line["location"]["path"], "src/handler.rs");
    let text = run(&stack, US_KEY, &["get", review["job_id"].as_str().unwrap()], None, None).await;
    assert!(text.stdout.starts_with("src/handler.rs\n") && text.stdout.contains("low"), "{}", text.stdout);
    assert!(!text.stdout.contains('\u{1b}'), "no colour when stdout is not a terminal");

    // Without --wait: the job id on stdout, exit 0.
    let bare = run(&stack, US_KEY, &["submit", "--lane", "batch"], Some(&sample_diff("bare")), None).await;
    assert_eq!(bare.code, 0, "{}", bare.stderr);
    assert!(bare.stdout.trim().starts_with("us_"), "{}", bare.stdout);

    // `list`: the tenant's two reviews (the repeats were the same review), newest first.
    let listed = run(&stack, US_KEY, &["list", "--all", "--json"], None, None).await;
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let ids: Vec<String> = listed
        .stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["job_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, vec![bare.stdout.trim().to_string(), review["job_id"].as_str().unwrap().to_string()]);
    let batch = run(&stack, US_KEY, &["list", "--lane", "batch"], None, None).await;
    assert_eq!(batch.stdout.lines().count(), 1, "{}", batch.stdout);
    assert!(batch.stdout.contains("batch"), "{}", batch.stdout);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_ranges_failures_and_unknown_keys_have_their_exit_codes() {
    let stack = Stack::start().await;
    // `--git`: reviewctl runs `git diff` itself, with the range's revisions as metadata.
    let repo = tempfile::tempdir().unwrap();
    let git = |args: &[&str]| git_in(repo.path(), args);
    git(&["init", "-q"]);
    let src = repo.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("lib.rs"), "fn a() {}\n").unwrap();
    git(&["add", "."]);
    git(&["commit", "-qm", "one"]);
    std::fs::write(src.join("lib.rs"), "fn a() {}\nfn b() { panic!(\"todo\") }\n").unwrap();
    git(&["commit", "-qam", "two"]);
    // Settings that change what `git diff` prints: paths relative to the directory it
    // runs in, other prefixes, colour always, an external diff program.
    for (k, v) in [
        ("diff.relative", "true"),
        ("diff.mnemonicPrefix", "true"),
        ("diff.srcPrefix", "old/"),
        ("diff.dstPrefix", "new/"),
        ("color.ui", "always"),
        ("diff.external", "false"),
    ] {
        git(&["config", k, v]);
    }
    let ranged =
        run(&stack, US_KEY, &["submit", "--git", "HEAD~1..HEAD", "--wait", "--format", "json"], None, Some(&src)).await;
    assert_eq!(ranged.code, 0, "{}", ranged.stderr);
    let review: serde_json::Value = serde_json::from_str(&ranged.stdout).unwrap();
    assert_eq!(review["findings"][0]["path"], "src/lib.rs", "{review}");
    assert_eq!(review["quarantined_count"], 0, "{review}");

    // A terminal failure: the provider rejects the request.
    stack.us.provider.script([Scripted::Status { status: 400, headers: vec![], body: "{}".into() }]);
    let failed = run(&stack, US_KEY, &["submit", "--wait"], Some(&sample_diff("rejected")), None).await;
    assert_eq!(failed.code, 2, "{}", failed.stderr);
    assert!(failed.stderr.contains("upstream_rejected"), "{}", failed.stderr);

    // The failure is a dead letter; replayed, it is published (the provider answers now).
    let terminal = run(&stack, US_KEY, &["list", "--state", "terminal", "--json"], None, None).await;
    let dead: serde_json::Value = serde_json::from_str(terminal.stdout.lines().next().unwrap()).unwrap();
    let dead_id = dead["job_id"].as_str().unwrap().to_string();
    let dlq = poll_until(Duration::from_secs(10), || async {
        Some(run(&stack, US_KEY, &["dlq", "list"], None, None).await).filter(|d| d.stdout.contains(&dead_id))
    })
    .await
    .expect("dead-lettered within 10 s");
    assert!(dlq.stdout.contains("upstream_rejected"), "{}", dlq.stdout);
    let replayed = run(&stack, US_KEY, &["dlq", "replay", &dead_id, "--wait", "--format", "json"], None, None).await;
    assert_eq!(replayed.code, 0, "{}", replayed.stderr);
    let new: serde_json::Value = serde_json::from_str(&replayed.stdout).unwrap();
    assert_eq!(new["state"], "published");
    assert_ne!(new["job_id"], dead["job_id"]);

    // An unknown key: the request fails.
    let unknown = run(&stack, "key-nobody", &["submit"], Some(&sample_diff("x")), None).await;
    assert_eq!(unknown.code, 5, "{}", unknown.stderr);
    assert!(unknown.stderr.contains("API_KEY_INVALID"), "{}", unknown.stderr);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_exits_3_with_the_retry_delay() {
    // Two messages fill the lane while the one being processed is not yet acked. The
    // admission makes no prediction here (it would refuse the third as over the lane's
    // window once its sample saw the two waiting, depending on when it sampled), so the
    // refusal is the full lane's.
    let interactive = reviewlane_ingress::config::IngressConfig::default_policies().0;
    let policy = reviewlane_ingress::admission::LanePolicy { min_waiting: u64::MAX, ..interactive };
    let stack = Stack::start_with(StackOptions {
        lane_max_messages: Some(2),
        extractor_concurrency: 1,
        us_provider: SimConfig { latency: Duration::from_millis(3000), ..Default::default() },
        interactive_policy: Some((policy, Duration::from_millis(500))),
        ..Default::default()
    })
    .await;
    // Built before the lane is filled, so the fill is still there when it runs.
    reviewctl();
    let mut client = stack.client().await;
    submit(&mut client, US_KEY, "fill-a", &sample_diff("a")).await;
    submit(&mut client, US_KEY, "fill-b", &sample_diff("b")).await;
    let refused = run(&stack, US_KEY, &["submit", "--wait"], Some(&sample_diff("c")), None).await;
    assert_eq!(refused.code, 3, "{}", refused.stderr);
    assert!(refused.stderr.contains("refused") && refused.stderr.contains("retry in"), "{}", refused.stderr);
    assert!(refused.stderr.contains("LANE_FULL"), "{}", refused.stderr);

    // An operator sees the full lane; a tenant key may not look.
    let lanes = run(&stack, OPERATOR_KEY, &["lanes", "--json"], None, None).await;
    assert_eq!(lanes.code, 0, "{}", lanes.stderr);
    let interactive: serde_json::Value = lanes
        .stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|l| l["lane"] == "interactive")
        .unwrap();
    assert_eq!((interactive["depth"].as_u64(), interactive["bound"].as_u64()), (Some(2), Some(2)), "{interactive}");
    assert!(interactive["oldest_age_secs"].as_f64().is_some());
    let denied = run(&stack, US_KEY, &["lanes"], None, None).await;
    assert_eq!(denied.code, 5, "{}", denied.stderr);
    assert!(denied.stderr.contains("OPERATOR_ROLE_REQUIRED"), "{}", denied.stderr);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_has_a_deadline_against_a_service_that_never_answers() {
    // Takes every connection and never says a word.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    reviewctl();
    let diff = sample_diff("silent");
    for args in [
        &["--request-timeout", "1", "submit"][..],
        &["--request-timeout", "1", "submit", "--wait", "--wait-timeout", "600"][..],
        &["--request-timeout", "1", "get", "us_00000000000000000000000000000000"][..],
    ] {
        let started = std::time::Instant::now();
        let out = run_at(&endpoint, US_KEY, args, Some(&diff), None).await;
        assert_eq!(out.code, 4, "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains("--request-timeout"), "{args:?}: {}", out.stderr);
        assert!(started.elapsed() < Duration::from_secs(20), "{args:?} took {:?}", started.elapsed());
    }
    // A command that waits ends when its wait does: every request it makes gets the
    // smaller of the request timeout (30 s by default) and what is left of the wait.
    for args in [
        &["submit", "--wait", "--wait-timeout", "2"][..],
        &["watch", "us_00000000000000000000000000000000", "--wait-timeout", "2"][..],
        &["sweeps", "watch", "us_00000000000000000000000000000000", "--wait-timeout", "2"][..],
    ] {
        let started = std::time::Instant::now();
        let out = run_at(&endpoint, US_KEY, args, Some(&diff), None).await;
        let took = started.elapsed();
        assert_eq!(out.code, 4, "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains("--wait-timeout"), "{args:?}: {}", out.stderr);
        assert!(took >= Duration::from_secs(2), "{args:?} ended after {took:?}, before its wait");
        assert!(took < Duration::from_secs(10), "{args:?} took {took:?}: past its 2 s wait");
    }
    silent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_reviews_each_text_file_of_a_revision_once_and_writes_one_sarif_run() {
    let stack = Stack::start().await;
    let repo = tempfile::tempdir().unwrap();
    let git = |args: &[&str]| git_in(repo.path(), args);
    git(&["init", "-q"]);
    let write = |path: &str, bytes: &[u8]| {
        let p = repo.path().join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    };
    write("src/a.rs", b"fn a() {}\n// TODO: handle errors\n");
    write("src/b.rs", b"fn b() -> u32 {\n    1\n}\n");
    write("docs/guide.md", b"# Guide\n\nRun it.\n");
    write("assets/logo.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR");
    write("big.txt", "line\n".repeat(1000).as_bytes());
    write("empty.txt", b"");
    write("other/skip.rs", b"fn skipped() {}\n");
    git(&["add", "."]);
    git(&["commit", "-qm", "all"]);
    let args = [
        "sweep",
        "--git",
        "HEAD",
        "--paths",
        "src/**",
        "docs/*",
        "assets/*",
        "big.txt",
        "empty.txt",
        "--max-file-bytes",
        "2000",
        "--repository",
        "acme/app",
        "--wait",
        "--format",
        "sarif",
    ];
    let swept = run(&stack, US_KEY, &args, None, Some(repo.path())).await;
    assert_eq!(swept.code, 0, "{}", swept.stderr);
    assert!(swept.stderr.contains("3 items (3 new, 0 already in the sweep)"), "{}", swept.stderr);
    // One SARIF run for the whole sweep, valid against the OASIS schema, a result per
    // text file (the simulated provider points at each file's first line).
    let log: serde_json::Value = serde_json::from_str(&swept.stdout).unwrap();
    let schema =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/vendor/sarif/sarif-schema-2.1.0.json")).unwrap();
    let validator = jsonschema::validator_for(&serde_json::from_str(&schema).unwrap()).unwrap();
    let errors: Vec<String> = validator.iter_errors(&log).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(log["runs"].as_array().unwrap().len(), 1);
    let mut uris: Vec<&str> = log["runs"][0]["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].as_str().unwrap())
        .collect();
    uris.sort_unstable();
    assert_eq!(uris, ["docs/guide.md", "src/a.rs", "src/b.rs"], "binary, large, empty and unmatched files left out");
    // `auto` runs through the provider's batch API here: one line paid per item.
    let paid = || stack.us.provider.batch_stats().paid_lines.values().sum::<u64>();
    assert_eq!((paid(), stack.us.provider.batch_stats().batches_created), (3, 1));
    assert_eq!(stack.us.provider.stats().total_calls, 0);

    // The same sweep again is the same sweep: nothing added, nothing paid again; at or
    // above `low` it fails the build.
    let mut again = args.to_vec();
    again.extend(["--fail-on", "low"]);
    let repeat = run(&stack, US_KEY, &again, None, Some(repo.path())).await;
    assert_eq!(repeat.code, 1, "{}", repeat.stderr);
    assert!(repeat.stderr.contains("3 items (0 new, 3 already in the sweep)"), "{}", repeat.stderr);
    assert_eq!(paid(), 3);

    // `sweeps`: the sweep's progress and items.
    let id = repeat.stderr.split(':').next().unwrap().trim().to_string();
    let got = run(&stack, US_KEY, &["sweeps", "get", &id], None, None).await;
    assert_eq!(got.code, 0, "{}", got.stderr);
    let sweep: serde_json::Value = serde_json::from_str(&got.stdout).unwrap();
    assert_eq!((sweep["items_total"].as_u64(), sweep["items"]["published"].as_u64()), (Some(3), Some(3)), "{sweep}");
    assert_eq!(sweep["percent_done"], 100.0);
    assert_eq!(sweep["runs_on"], "provider_batch", "{sweep}");
    let items = run(&stack, US_KEY, &["sweeps", "items", &id, "--state", "published"], None, None).await;
    let keys: Vec<&str> = items.stdout.lines().map(|l| l.rsplit('\t').next().unwrap()).collect();
    assert_eq!(keys.len(), 3, "{}", items.stdout);
    assert!(keys.contains(&"src/a.rs") && keys.contains(&"docs/guide.md"), "{keys:?}");
    // What the commands show (printed with `--nocapture`).
    eprintln!(
        "$ reviewctl sweep ... --wait\n{}\n$ reviewctl sweeps get {id}\n{}\n$ reviewctl sweeps items {id} --state published\n{}",
        swept.stderr, got.stdout, items.stdout
    );
    // `batch` is an old name of `sweeps`, kept as a hidden alias.
    let watched = run(&stack, US_KEY, &["batch", "watch", &id], None, None).await;
    assert_eq!(watched.code, 0, "{}", watched.stderr);
    let listed = run(&stack, US_KEY, &["sweeps", "list"], None, None).await;
    assert!(listed.stdout.starts_with(&id) && listed.stdout.contains("3/3 done"), "{}", listed.stdout);
    stack.shutdown().await;
}
