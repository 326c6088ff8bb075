//! SARIF 2.1.0: one run per review; a rule per category; each finding a result with its
//! region (start and end lines), the evidence as the region's snippet, the fingerprint
//! as a partial fingerprint, and a fix when the finding carries a replacement.

use serde_json::{Value, json};

use super::{CATEGORIES, Report, message_text};
use crate::findings::{Finding, Side};

/// The key of reviewlane's fingerprint in `partialFingerprints`.
pub const FINGERPRINT_KEY: &str = "reviewlane/v1";

/// SARIF `level` of a severity.
pub fn level(severity: &str) -> &'static str {
    match severity {
        "critical" | "high" => "error",
        "medium" => "warning",
        _ => "note",
    }
}

/// The review as a SARIF 2.1.0 log.
pub fn log(report: &Report<'_>) -> Value {
    let rules: Vec<Value> = CATEGORIES
        .iter()
        .map(|(id, text)| {
            json!({
                "id": id,
                "name": id,
                "shortDescription": {"text": text},
            })
        })
        .collect();
    let mut run = json!({
        "tool": {"driver": {
            "name": "reviewlane",
            "version": env!("CARGO_PKG_VERSION"),
            "rules": rules,
        }},
        "automationDetails": {"id": format!("reviewlane/{}", report.job_id)},
        "results": report.findings.iter().map(result).collect::<Vec<_>>(),
        "properties": {"schemaVersion": report.schema_version, "jobId": report.job_id},
    });
    if !report.head_revision.is_empty() {
        let mut provenance = json!({"revisionId": report.head_revision});
        if let Ok(uri) = http::Uri::try_from(report.repository)
            && uri.scheme().is_some()
        {
            provenance["repositoryUri"] = json!(report.repository);
        }
        run["versionControlProvenance"] = json!([provenance]);
    }
    json!({
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [run],
    })
}

fn result(f: &Finding) -> Value {
    let rule_index = CATEGORIES.iter().position(|(id, _)| *id == f.category);
    let lines = f.lines();
    let region = json!({
        "startLine": lines.start(),
        "endLine": lines.end(),
        "snippet": {"text": f.evidence},
    });
    // Locations are in the file as reviewed (the new side); a finding on removed lines
    // points at the file and says which lines it was about.
    let (location, message) = match f.side() {
        Side::New => (json!({"artifactLocation": {"uri": f.path}, "region": region}), message_text(f)),
        Side::Old => (
            json!({"artifactLocation": {"uri": f.path}}),
            format!("{} (removed lines {}-{})", message_text(f), lines.start(), lines.end()),
        ),
    };
    let fingerprint = f.fingerprint.clone().unwrap_or_else(|| crate::findings::fingerprint(f));
    let mut r = json!({
        "ruleId": f.category,
        "level": level(&f.severity),
        "message": {"text": message},
        "locations": [{"physicalLocation": location}],
        "partialFingerprints": {FINGERPRINT_KEY: fingerprint},
        "properties": {"severity": f.severity, "category": f.category},
    });
    if let Some(i) = rule_index {
        r["ruleIndex"] = json!(i);
    }
    if let Some(c) = &f.confidence {
        r["properties"]["confidence"] = json!(c);
    }
    if let Some(replacement) = f.suggested_replacement.as_ref().filter(|_| f.side() == Side::New) {
        let mut text = replacement.clone();
        if !text.ends_with('\n') {
            text.push('\n');
        }
        r["fixes"] = json!([{
            "description": {"text": f.suggested_action.clone().unwrap_or_else(|| f.title.clone())},
            "artifactChanges": [{
                "artifactLocation": {"uri": f.path},
                "replacements": [{
                    // Whole lines: from the start of the first to the start of the line after
                    // the last.
                    "deletedRegion": {"startLine": lines.start(), "startColumn": 1, "endLine": lines.end() + 1, "endColumn": 1},
                    "insertedContent": {"text": text},
                }],
            }],
        }]);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finding() -> Finding {
        Finding {
            path: "src/app.rs".into(),
            line: 2,
            end_line: Some(3),
            severity: "high".into(),
            category: "reliability".into(),
            title: "Unchecked error".into(),
            message: "unwrap panics on error".into(),
            evidence: "y.unwrap()".into(),
            suggested_action: Some("Return the error.".into()),
            suggested_replacement: Some("    let x = y?;".into()),
            confidence: Some("high".into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_finding_becomes_a_result_with_region_fingerprint_and_fix() {
        let findings = [finding()];
        let report = Report {
            job_id: "us_1",
            schema_version: "findings.v2",
            repository: "https://git.example/acme/app",
            head_revision: "d4e5",
            findings: &findings,
        };
        let log = log(&report);
        let run = &log["runs"][0];
        assert_eq!(run["versionControlProvenance"][0]["repositoryUri"], "https://git.example/acme/app");
        let r = &run["results"][0];
        assert_eq!(
            (r["ruleId"].as_str(), r["ruleIndex"].as_u64(), r["level"].as_str()),
            (Some("reliability"), Some(2), Some("error"))
        );
        let region = &r["locations"][0]["physicalLocation"]["region"];
        assert_eq!((region["startLine"].as_u64(), region["endLine"].as_u64()), (Some(2), Some(3)));
        assert_eq!(r["partialFingerprints"][FINGERPRINT_KEY], crate::findings::fingerprint(&findings[0]));
        assert!(r["message"]["text"].as_str().unwrap().ends_with("Suggested action: Return the error."));
        let replacement = &r["fixes"][0]["artifactChanges"][0]["replacements"][0];
        assert_eq!(replacement["deletedRegion"]["endLine"], 4);
        assert_eq!(replacement["insertedContent"]["text"], "    let x = y?;\n");
        // A repository that is not a URI is left out of the provenance.
        let plain = Report { repository: "acme/app", ..report };
        assert!(super::log(&plain)["runs"][0]["versionControlProvenance"][0].get("repositoryUri").is_none());
    }
}
