//! reviewdog's Diagnostic Format: `rdjson` (one `DiagnosticResult` document) and
//! `rdjsonl` (one `Diagnostic` a line), with the finding's range, severity, category as
//! the code, and a suggestion when the finding carries a replacement.

use serde_json::{Value, json};

use super::{Report, message_text};
use crate::findings::{Finding, Side};

/// reviewdog's severity of ours.
pub fn severity(s: &str) -> &'static str {
    match s {
        "critical" | "high" => "ERROR",
        "medium" => "WARNING",
        _ => "INFO",
    }
}

/// One finding as a `Diagnostic`. rdjson's lines are the new file's: a finding on
/// removed lines has no range (reviewdog comments on the file, not on an unrelated
/// line of the new side), and its message says which lines it was about — as SARIF.
pub fn diagnostic(f: &Finding) -> Value {
    let lines = f.lines();
    let (location, message) = match f.side() {
        Side::New => {
            let range = json!({"start": {"line": lines.start()}, "end": {"line": lines.end()}});
            (json!({"path": f.path, "range": range}), message_text(f))
        }
        Side::Old => {
            (json!({"path": f.path}), format!("{} (removed lines {}-{})", message_text(f), lines.start(), lines.end()))
        }
    };
    let mut d = json!({
        "message": message,
        "location": location,
        "severity": severity(&f.severity),
        "source": {"name": "reviewlane"},
        "code": {"value": f.category},
    });
    if let Some(text) = f.suggested_replacement.as_ref().filter(|_| f.side() == Side::New) {
        // Whole lines: the range up to the start of the line after the last.
        let whole =
            json!({"start": {"line": lines.start(), "column": 1}, "end": {"line": lines.end() + 1, "column": 1}});
        let text = if text.ends_with('\n') { text.clone() } else { format!("{text}\n") };
        d["suggestions"] = json!([{"range": whole, "text": text}]);
    }
    d
}

/// The review as one `DiagnosticResult` (rdjson).
pub fn result(report: &Report<'_>) -> Value {
    json!({
        "source": {"name": "reviewlane"},
        "diagnostics": report.findings.iter().map(diagnostic).collect::<Vec<_>>(),
    })
}

/// The review as rdjsonl: one `Diagnostic` per line.
pub fn lines(report: &Report<'_>) -> String {
    report.findings.iter().map(|f| format!("{}\n", diagnostic(f))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finding_on_removed_lines_has_no_new_side_range() {
        let f = Finding {
            path: "src/a.rs".into(),
            line: 7,
            end_line: Some(8),
            side: Some(Side::Old),
            title: "t".into(),
            message: "m".into(),
            severity: "low".into(),
            suggested_replacement: Some("x".into()),
            ..Default::default()
        };
        let d = diagnostic(&f);
        assert_eq!(d["location"], json!({"path": "src/a.rs"}));
        assert!(d["message"].as_str().unwrap().ends_with("(removed lines 7-8)"), "{d}");
        assert!(d.get("suggestions").is_none());
        let new = diagnostic(&Finding { side: None, ..f });
        assert_eq!(new["location"]["range"]["start"]["line"], 7);
    }
}
