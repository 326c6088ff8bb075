//! Review surfaces against the formats' published schemas: a published review's findings
//! as SARIF 2.1.0 (OASIS schema) and as reviewdog rdjson / rdjsonl (reviewdog's Diagnostic
//! Format schemas), vendored in `tests/vendor`; and a file name that is not UTF-8 through
//! the stack to every surface.

use std::time::Duration;

use reviewlane_api::proto;
use reviewlane_core::findings::Finding;
use reviewlane_core::surfaces::{Report, rdjson, sarif};

use crate::harness::*;

/// The schema's validator, formats (`uri`, `uri-reference`) checked as well.
fn validator(path: &str) -> jsonschema::Validator {
    let text = std::fs::read_to_string(format!("{}/vendor/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    jsonschema::options().should_validate_formats(true).build(&serde_json::from_str(&text).unwrap()).unwrap()
}

/// Valid against the schema, and every `uri` in it a URI reference (RFC 3986), as
/// the SARIF schema's `format: uri-reference` asks — a format of later drafts than
/// the schema's own draft-04, so checked here on its own.
fn assert_valid(v: &jsonschema::Validator, doc: &serde_json::Value) {
    let errors: Vec<String> = v.iter_errors(doc).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    assert!(errors.is_empty(), "{errors:#?}\n{doc:#}");
    let uris: Vec<&serde_json::Value> = all_uris(doc);
    let bad: Vec<&&serde_json::Value> = uris.iter().filter(|u| !uri_reference().is_valid(u)).collect();
    assert!(bad.is_empty(), "not URI references: {bad:?}");
}

fn uri_reference() -> jsonschema::Validator {
    let schema = serde_json::json!({"type": "string", "format": "uri-reference"});
    jsonschema::options().should_validate_formats(true).build(&schema).unwrap()
}

fn all_uris(doc: &serde_json::Value) -> Vec<&serde_json::Value> {
    match doc {
        serde_json::Value::Object(o) => {
            o.iter().flat_map(|(k, v)| if k == "uri" || k == "repositoryUri" { vec![v] } else { all_uris(v) }).collect()
        }
        serde_json::Value::Array(a) => a.iter().flat_map(all_uris).collect(),
        _ => Vec::new(),
    }
}

fn findings() -> Vec<Finding> {
    let base = Finding {
        path: "src/pay.rs".into(),
        line: 12,
        severity: "critical".into(),
        category: "security".into(),
        title: "Hard-coded secret".into(),
        message: "An API key is committed.".into(),
        evidence: "let key = \"sk-live\";".into(),
        fingerprint: Some("0123456789abcdef0123456789abcdef".into()),
        ..Default::default()
    };
    vec![
        // v1: no range, no action.
        base.clone(),
        // v2 with a range, an action, a replacement and a confidence.
        Finding {
            line: 20,
            end_line: Some(22),
            severity: "medium".into(),
            category: "reliability".into(),
            suggested_action: Some("Propagate the error.".into()),
            suggested_replacement: Some("let v = parse(x)?;".into()),
            confidence: Some("high".into()),
            ..base.clone()
        },
        // On removed lines.
        Finding { side: Some(reviewlane_core::findings::Side::Old), severity: "info".into(), ..base },
    ]
}

fn report(findings: &[Finding]) -> Report<'_> {
    Report {
        job_id: "us_0123",
        schema_version: "findings.v2",
        repository: "https://git.example/acme/payments",
        head_revision: "d4e5f6",
        findings,
    }
}

#[test]
fn sarif_output_is_valid_sarif_2_1_0() {
    let findings = findings();
    let log = sarif::log(&report(&findings));
    assert_valid(&validator("sarif/sarif-schema-2.1.0.json"), &log);
    assert_eq!(log["runs"][0]["results"].as_array().unwrap().len(), 3);
    // An empty review is a valid log too.
    assert_valid(&validator("sarif/sarif-schema-2.1.0.json"), &sarif::log(&report(&[])));
    // The schema does catch a broken log (the check is not vacuous), and a path that
    // is not a URI reference.
    let mut broken = log.clone();
    broken["runs"][0]["results"][0]["level"] = "fatal".into();
    assert!(!validator("sarif/sarif-schema-2.1.0.json").is_valid(&broken));
    assert!(!uri_reference().is_valid(&"docs/dir with space/read me.md".into()));
    assert!(!uri_reference().is_valid(&"src/café.rs".into()));
}

#[test]
fn sarif_of_paths_with_spaces_and_non_ascii_and_of_a_repository_that_is_no_uri_is_valid() {
    let base = findings().remove(1);
    let findings: Vec<Finding> = ["docs/dir with space/read me.md", "src/café/naïve.rs", "a#b?c%d[1].rs"]
        .into_iter()
        .map(|p| Finding { path: p.into(), ..base.clone() })
        .collect();
    for repository in ["acme/app", "", "https://git.example/acme/app"] {
        let log = sarif::log(&Report { repository, ..report(&findings) });
        assert_valid(&validator("sarif/sarif-schema-2.1.0.json"), &log);
        let run = &log["runs"][0];
        assert_eq!(run.get("versionControlProvenance").is_some(), repository.starts_with("https://"), "{run}");
        let location = &run["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"];
        assert_eq!(location["uri"], "docs/dir%20with%20space/read%20me.md");
        assert_eq!(location["properties"]["path"], "docs/dir with space/read me.md");
        assert_eq!(
            run["results"][1]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
            "src/caf%C3%A9/na%C3%AFve.rs"
        );
    }
}

#[test]
fn rdjson_and_rdjsonl_output_follow_reviewdogs_schemas() {
    let findings = findings();
    let doc = rdjson::result(&report(&findings));
    assert_valid(&validator("reviewdog-rdf/DiagnosticResult.json"), &doc);
    assert_eq!(doc["diagnostics"][1]["suggestions"][0]["text"], "let v = parse(x)?;\n");
    let line_schema = validator("reviewdog-rdf/Diagnostic.json");
    let text = rdjson::lines(&report(&findings));
    assert_eq!(text.lines().count(), 3);
    for line in text.lines() {
        assert_valid(&line_schema, &serde_json::from_str(line).unwrap());
    }
    // On removed lines: no range of the new file.
    let old_side = &doc["diagnostics"][2];
    assert!(old_side["location"].get("range").is_none(), "{old_side}");
    assert!(old_side["message"].as_str().unwrap().contains("removed lines 12-12"), "{old_side}");
    let mut broken = doc["diagnostics"][0].clone();
    broken["severity"] = "FATAL".into();
    assert!(!line_schema.is_valid(&broken));
}

/// A change to `l\xe9gacy.txt` (a Latin-1 name) made by git in a temporary repository:
/// the diff as git writes it by default (the name quoted, `"l\351gacy.txt"`: ASCII) and
/// with `core.quotePath=false` (the name's bytes as they are: no UTF-8).
fn latin1_name_diffs() -> (String, Vec<u8>) {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .args(args)
            .current_dir(dir.path())
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", dir.path())
            .output()
            .expect("git runs");
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    git(&["init", "-q"]);
    git(&["config", "user.email", "t@example.invalid"]);
    git(&["config", "user.name", "t"]);
    let file = dir.path().join(std::ffi::OsStr::from_bytes(b"l\xe9gacy.txt"));
    std::fs::write(&file, b"first line\n").unwrap();
    git(&["add", "-A"]);
    git(&["commit", "-qm", "c"]);
    std::fs::write(&file, b"first line\n// TODO: drop the legacy encoding\n").unwrap();
    git(&["add", "-A"]);
    let quoted = String::from_utf8(git(&["diff", "--cached"])).expect("git quotes the name");
    let raw = git(&["-c", "core.quotePath=false", "diff", "--cached"]);
    assert!(std::str::from_utf8(&raw).is_err(), "the name's bytes as they are");
    (quoted, raw)
}

/// A US tenant delivering to files of `format` under `dir`.
fn file_tenant(id: &str, dir: &std::path::Path, format: &str) -> String {
    format!(
        "[[tenants]]\nid = \"{id}\"\nregion = \"us\"\napi_key_sha256 = [\"{}\"]\nsink = {{ kind = \"file\", dir = \"{}\", format = \"{format}\" }}\n",
        reviewlane_core::tenants::hash_api_key(&format!("key-{id}")),
        dir.join(format).display(),
    )
}

/// The review `diff` (as `diff`, or as `diff_bytes` when it is no UTF-8) of tenant
/// `key`, once published.
async fn published(stack: &Stack, key: &str, diff: &[u8]) -> proto::Review {
    let mut client = stack.client().await;
    let mut req = submit_req(key, &format!("latin1-name-{}", diff.len()), "").into_inner();
    match std::str::from_utf8(diff) {
        Ok(text) => req.diff = text.into(),
        Err(_) => req.diff_bytes = diff.to_vec(),
    }
    let job = client.submit_review(authed(key, req)).await.unwrap().into_inner().review.unwrap();
    let done = wait_final(&mut client, key, &job.job_id).await;
    assert_eq!(done.state, proto::JobState::Published as i32, "{done:?}");
    done
}

/// The file a file sink wrote for `job_id`, once there.
async fn delivered_file(dir: &std::path::Path, format: &str, job_id: &str) -> serde_json::Value {
    let path = dir.join(format).join(format!("{job_id}.{format}"));
    let text = poll_until(Duration::from_secs(15), || {
        let path = path.clone();
        async move { std::fs::read(&path).ok() }
    })
    .await
    .unwrap_or_else(|| panic!("no {format} file delivered"));
    serde_json::from_slice(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_name_that_is_not_utf8_reaches_every_surface_as_git_quotes_it() {
    const NAME: &str = "\"l\\351gacy.txt\"";
    let files = tempfile::tempdir().unwrap();
    let extra_tenants =
        ["json", "sarif", "rdjson"].map(|f| file_tenant(&format!("files-{f}"), files.path(), f)).join("\n");
    let stack = Stack::start_with(StackOptions { extra_tenants, ..Default::default() }).await;
    let (quoted, raw) = latin1_name_diffs();

    // Either form of the diff: the finding names the file in git's quoted form, which
    // reads back to the name's bytes.
    for diff in [quoted.as_bytes(), &raw[..]] {
        let done = published(&stack, US_KEY, diff).await;
        let paths: Vec<&str> = done.findings.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, [NAME], "{done:?}");
        assert_eq!(&*reviewlane_core::diff::path::to_bytes(paths[0]), b"l\xe9gacy.txt");
        // The webhook's delivery says the same.
        let hook = stack.webhook.wait_for(&done.job_id, Duration::from_secs(15)).await.expect("delivered");
        let body: serde_json::Value = serde_json::from_slice(&hook.body).unwrap();
        assert_eq!(body["findings"][0]["path"], NAME, "{body}");
    }

    // The file sinks: the delivery as JSON and rdjson carry the same form; SARIF the
    // bytes percent-encoded as the artifact's URI, the same form beside it.
    let done = published(&stack, "key-files-json", &raw).await;
    assert_eq!(delivered_file(files.path(), "json", &done.job_id).await["findings"][0]["path"], NAME);
    let done = published(&stack, "key-files-rdjson", &raw).await;
    let doc = delivered_file(files.path(), "rdjson", &done.job_id).await;
    assert_valid(&validator("reviewdog-rdf/DiagnosticResult.json"), &doc);
    assert_eq!(doc["diagnostics"][0]["location"]["path"], NAME, "{doc}");
    let done = published(&stack, "key-files-sarif", quoted.as_bytes()).await;
    let log = delivered_file(files.path(), "sarif", &done.job_id).await;
    assert_valid(&validator("sarif/sarif-schema-2.1.0.json"), &log);
    let location = &log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"];
    assert_eq!((location["uri"].as_str(), location["properties"]["path"].as_str()), (Some("l%E9gacy.txt"), Some(NAME)));
    stack.shutdown().await;
}
