//! Review surfaces against the formats' published schemas: a published review's findings
//! as SARIF 2.1.0 (OASIS schema) and as reviewdog rdjson / rdjsonl (reviewdog's Diagnostic
//! Format schemas), vendored in `tests/vendor`.

use reviewlane_shared::findings::Finding;
use reviewlane_shared::surfaces::{Report, rdjson, sarif};

fn validator(path: &str) -> jsonschema::Validator {
    let text = std::fs::read_to_string(format!("{}/vendor/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap()
}

fn assert_valid(v: &jsonschema::Validator, doc: &serde_json::Value) {
    let errors: Vec<String> = v.iter_errors(doc).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    assert!(errors.is_empty(), "{errors:#?}\n{doc:#}");
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
        Finding { side: Some(reviewlane_shared::findings::Side::Old), severity: "info".into(), ..base },
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
    // The schema does catch a broken log (the check is not vacuous).
    let mut broken = log.clone();
    broken["runs"][0]["results"][0]["level"] = "fatal".into();
    assert!(!validator("sarif/sarif-schema-2.1.0.json").is_valid(&broken));
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
    let mut broken = doc["diagnostics"][0].clone();
    broken["severity"] = "FATAL".into();
    assert!(!line_schema.is_valid(&broken));
}
