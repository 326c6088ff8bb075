//! Review surfaces against the formats' published schemas: a published review's findings
//! as SARIF 2.1.0 (OASIS schema) and as reviewdog rdjson / rdjsonl (reviewdog's Diagnostic
//! Format schemas), vendored in `tests/vendor`.

use reviewlane_core::findings::Finding;
use reviewlane_core::surfaces::{Report, rdjson, sarif};

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
