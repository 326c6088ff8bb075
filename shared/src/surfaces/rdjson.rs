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

/// One finding as a `Diagnostic`.
pub fn diagnostic(f: &Finding) -> Value {
    let lines = f.lines();
    let range = json!({"start": {"line": lines.start()}, "end": {"line": lines.end()}});
    let mut d = json!({
        "message": message_text(f),
        "location": {"path": f.path, "range": range},
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
