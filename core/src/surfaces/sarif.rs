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
    // The schema requires `repositoryUri`: a repository named otherwise (`acme/app`)
    // has no provenance object; its name stays in the run's properties.
    if let Ok(uri) = http::Uri::try_from(report.repository)
        && uri.scheme().is_some()
    {
        let mut provenance = json!({"repositoryUri": report.repository});
        if !report.head_revision.is_empty() {
            provenance["revisionId"] = json!(report.head_revision);
        }
        run["versionControlProvenance"] = json!([provenance]);
    }
    if !report.repository.is_empty() {
        run["properties"]["repository"] = json!(report.repository);
    }
    if !report.head_revision.is_empty() {
        run["properties"]["headRevision"] = json!(report.head_revision);
    }
    json!({
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [run],
    })
}

/// What a path may keep unencoded in a URI reference's path (RFC 3986: unreserved
/// characters, sub-delimiters, `@` and `/`); everything else, and every non-ASCII byte,
/// is percent-encoded. `:` is encoded too, so a first segment never reads as a scheme.
const PATH_KEEPS: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'!')
    .remove(b'$')
    .remove(b'&')
    .remove(b'\'')
    .remove(b'(')
    .remove(b')')
    .remove(b'*')
    .remove(b'+')
    .remove(b',')
    .remove(b';')
    .remove(b'=')
    .remove(b'@')
    .remove(b'/');

/// A diff path as a SARIF `uri` (a URI reference, relative to the repository's root):
/// the name's bytes percent-encoded, so a name that is not UTF-8 (`"l\351gacy.txt"`,
/// see `diff::path`) is `l%E9gacy.txt`.
pub fn path_uri(path: &str) -> String {
    percent_encoding::percent_encode(&crate::diff::path::to_bytes(path), PATH_KEEPS).to_string()
}

/// The `artifactLocation` of a path: its URI reference, and the path as findings carry
/// it (git's quoted form for a name that is not UTF-8) when encoding changed it.
fn artifact_location(path: &str) -> Value {
    let uri = path_uri(path);
    if uri == path { json!({"uri": uri}) } else { json!({"uri": uri, "properties": {"path": path}}) }
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
    let artifact = artifact_location(&f.path);
    let (location, message) = match f.side() {
        Side::New => (json!({"artifactLocation": artifact, "region": region}), message_text(f)),
        Side::Old => (
            json!({"artifactLocation": artifact}),
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
                "artifactLocation": artifact_location(&f.path),
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
        // A repository that is not a URI has no provenance object (the schema requires
        // its URI); its name is a property of the run.
        let plain = Report { repository: "acme/app", ..report };
        let run = &super::log(&plain)["runs"][0];
        assert!(run.get("versionControlProvenance").is_none(), "{run}");
        assert_eq!(run["properties"]["repository"], "acme/app");
        assert_eq!(run["properties"]["headRevision"], "d4e5");
    }

    #[test]
    fn paths_become_uri_references() {
        assert_eq!(path_uri("src/app.rs"), "src/app.rs");
        assert_eq!(path_uri("docs/dir with space/read me.md"), "docs/dir%20with%20space/read%20me.md");
        assert_eq!(path_uri("src/caf\u{e9}.rs"), "src/caf%C3%A9.rs");
        assert_eq!(path_uri("a#b?c%d"), "a%23b%3Fc%25d");
        assert_eq!(path_uri("c:/x"), "c%3A/x");
        let f = Finding { path: "docs/read me.md".into(), ..finding() };
        let r = result(&f);
        let location = &r["locations"][0]["physicalLocation"]["artifactLocation"];
        assert_eq!(
            (location["uri"].as_str(), location["properties"]["path"].as_str()),
            (Some("docs/read%20me.md"), Some("docs/read me.md"))
        );
        assert_eq!(r["fixes"][0]["artifactChanges"][0]["artifactLocation"]["uri"], "docs/read%20me.md");
        // A name that is not UTF-8: its bytes encoded, git's quoted form beside them.
        assert_eq!(path_uri("\"l\\351gacy.txt\""), "l%E9gacy.txt");
        assert_eq!(path_uri("\"dir/\\\"q\\\" \\377\""), "dir/%22q%22%20%FF");
        let location = &result(&Finding { path: "\"l\\351gacy.txt\"".into(), ..finding() })["locations"][0]["physicalLocation"]
            ["artifactLocation"];
        assert_eq!(location["properties"]["path"], "\"l\\351gacy.txt\"");
    }
}
