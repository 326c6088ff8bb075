//! Findings: the versioned JSON Schema registry and the three-step validation every
//! provider answer goes through before a job may complete (invariant 2):
//! JSON parse -> JSON Schema -> semantic checks against the submitted diff.
//!
//! A document that is not JSON or does not have the schema's shape at the top is
//! invalid output (the schema retry path). A single finding that fails is quarantined:
//! kept with a content-free reason, counted, never delivered; the rest go on.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::diff::Diff;

pub const FINDINGS_V1: &str = "findings.v1";
/// Findings a developer can act on: a line range and side, a suggested action and an
/// optional replacement, a confidence, and a fingerprint reviewlane computes.
pub const FINDINGS_V2: &str = "findings.v2";
/// The version used when a request names none. (v1 stays the default so that callers
/// who never named a version keep getting what they parse; v2 is asked for by name.)
pub const LATEST_SCHEMA: &str = FINDINGS_V1;

const FINDINGS_V1_JSON: &str = include_str!("../schemas/findings.v1.json");
const FINDINGS_V2_JSON: &str = include_str!("../schemas/findings.v2.json");

/// Which side of the diff a finding's lines are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// The file after the change (line numbers of `+` and context lines).
    #[default]
    New,
    /// The file before the change (line numbers of `-` and context lines).
    Old,
}

/// One finding: the fields of `findings.v1`, and the optional ones `findings.v2` adds
/// (absent in v1 results). `fingerprint` is never the model's: reviewlane computes it
/// after validation.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Finding {
    pub path: String,
    pub line: u32,
    /// Last line of the range the finding covers (`line` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_line: Option<u32>,
    /// The side `line..end_line` count on (new when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side: Option<Side>,
    pub severity: String,
    pub category: String,
    pub title: String,
    pub message: String,
    pub evidence: String,
    /// What the developer should do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suggested_action: Option<String>,
    /// Lines that replace `line..=end_line` on the new side (checked to apply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suggested_replacement: Option<String>,
    /// `low`, `medium` or `high`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<String>,
    /// Stable identity of the finding across runs: digest of path, category and
    /// normalised evidence (see [`fingerprint`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
}

impl Finding {
    /// The lines the finding covers.
    pub fn lines(&self) -> std::ops::RangeInclusive<u32> {
        self.line..=self.end_line.unwrap_or(self.line).max(self.line)
    }

    pub fn side(&self) -> Side {
        self.side.unwrap_or_default()
    }
}

/// Rank of a severity: `critical` 5 down to `info` 1; anything else 0.
pub fn severity_rank(severity: &str) -> u8 {
    match severity {
        "critical" => 5,
        "high" => 4,
        "medium" => 3,
        "low" => 2,
        "info" => 1,
        _ => 0,
    }
}

/// The finding's fingerprint: sha256 of its path, category and evidence with
/// whitespace runs collapsed (so re-indenting the code does not change it), first 32
/// hex digits. Independent of line numbers, which move between revisions.
pub fn fingerprint(f: &Finding) -> String {
    let evidence = f.evidence.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut digest = crate::job_id::sha256_hex(&[f.path.as_bytes(), f.category.as_bytes(), evidence.as_bytes()]);
    digest.truncate(32);
    digest
}

/// Why a finding was quarantined. Names only, never content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuarantineReason {
    /// Failed the JSON Schema (missing field, unknown enum value, extra property...).
    Schema,
    /// The path is not a file on the new side of the diff.
    PathNotInDiff,
    /// The line is not on the new side of any hunk of that file.
    LineOutsideHunks,
    /// The quoted evidence does not appear in the hunk the line is in.
    EvidenceNotInHunk,
    /// The evidence quotes only removed lines, but the finding's line is on the new side.
    EvidenceNotOnLineSide,
    /// `end_line` is before `line`, or not in the same hunk on the same side.
    RangeOutsideHunk,
    /// A suggested replacement for lines that are not on the new side of the diff.
    ReplacementNotApplicable,
}

impl QuarantineReason {
    pub fn as_str(self) -> &'static str {
        match self {
            QuarantineReason::Schema => "schema",
            QuarantineReason::PathNotInDiff => "path_not_in_diff",
            QuarantineReason::LineOutsideHunks => "line_outside_hunks",
            QuarantineReason::EvidenceNotInHunk => "evidence_not_in_hunk",
            QuarantineReason::EvidenceNotOnLineSide => "evidence_not_on_line_side",
            QuarantineReason::RangeOutsideHunk => "range_outside_hunk",
            QuarantineReason::ReplacementNotApplicable => "replacement_not_applicable",
        }
    }
}

/// A finding kept back: the raw item as the provider sent it (or, over the configured
/// bound, the start of its JSON text with the digest and length of the whole), and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quarantined {
    pub index: usize,
    pub reason: QuarantineReason,
    pub raw: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<TruncatedRaw>,
}

/// What a truncated raw item was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TruncatedRaw {
    /// sha256 of the item's whole JSON text.
    pub sha256: String,
    pub original_bytes: usize,
}

impl Quarantined {
    /// Cuts `raw` to at most `max_bytes` of its JSON text (at a character boundary).
    pub fn bounded(mut self, max_bytes: usize) -> Self {
        let text = self.raw.to_string();
        if text.len() <= max_bytes {
            return self;
        }
        let mut end = max_bytes;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.truncated =
            Some(TruncatedRaw { sha256: crate::job_id::sha256_hex(&[text.as_bytes()]), original_bytes: text.len() });
        self.raw = serde_json::Value::String(text[..end].to_string());
        self
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Validated {
    pub findings: Vec<Finding>,
    pub quarantined: Vec<Quarantined>,
}

/// The whole answer is unusable. Content-free on purpose: it is logged and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidOutput {
    #[error("provider output is not JSON")]
    NotJson,
    #[error("provider output does not match the schema at its top level")]
    Shape,
    #[error("unknown findings schema version")]
    UnknownSchema,
    /// Findings were given, and every one failed the schema: the answer is broken, not
    /// an empty review.
    #[error("every finding of the provider output failed the schema")]
    AllFindingsInvalid,
}

impl InvalidOutput {
    pub fn as_str(self) -> &'static str {
        match self {
            InvalidOutput::NotJson => "not_json",
            InvalidOutput::Shape => "shape",
            InvalidOutput::UnknownSchema => "unknown_schema",
            InvalidOutput::AllFindingsInvalid => "all_findings_invalid",
        }
    }
}

struct Schema {
    version: &'static str,
    document: serde_json::Value,
    validator: jsonschema::Validator,
}

fn registry() -> &'static [Schema] {
    static REGISTRY: OnceLock<Vec<Schema>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        [(FINDINGS_V1, FINDINGS_V1_JSON), (FINDINGS_V2, FINDINGS_V2_JSON)]
            .into_iter()
            .map(|(version, text)| {
                let document: serde_json::Value = serde_json::from_str(text).expect("bundled schema is JSON");
                let validator = jsonschema::validator_for(&document).expect("bundled schema compiles");
                Schema { version, document, validator }
            })
            .collect()
    })
}

fn schema(version: &str) -> Option<&'static Schema> {
    registry().iter().find(|s| s.version == version)
}

/// Whether `version` names a schema this build knows.
pub fn is_known_schema(version: &str) -> bool {
    schema(version).is_some()
}

/// Compiles the bundled schemas now, so no request waits for it (services call this
/// at start).
pub fn warm_up() {
    let _ = registry();
}

pub fn known_schemas() -> Vec<&'static str> {
    registry().iter().map(|s| s.version).collect()
}

/// The schema document, for providers that take a JSON Schema (structured outputs).
pub fn schema_document(version: &str) -> Option<&'static serde_json::Value> {
    schema(version).map(|s| &s.document)
}

/// The schema a review at degraded depth (`changed_hunks`) asks for: the same
/// findings with shorter text (title 120, message 500, evidence and suggested action
/// 300 characters) and no suggested replacement. An answer is still validated against
/// the full schema of its version, which it meets.
pub fn compact_schema_document(version: &str) -> Option<serde_json::Value> {
    let mut doc = schema_document(version)?.clone();
    let props = doc.pointer_mut("/properties/findings/items/properties")?.as_object_mut()?;
    props.remove("suggested_replacement");
    for (field, max) in [("title", 120), ("message", 500), ("evidence", 300), ("suggested_action", 300)] {
        if let Some(p) = props.get_mut(field).and_then(serde_json::Value::as_object_mut) {
            p.insert("maxLength".into(), max.into());
        }
    }
    Some(doc)
}

/// Validates a provider answer against the schema `version` and the submitted `diff`.
pub fn validate(version: &str, output: &str, diff: &Diff) -> Result<Validated, InvalidOutput> {
    let schema = schema(version).ok_or(InvalidOutput::UnknownSchema)?;
    let doc: serde_json::Value = serde_json::from_str(output).map_err(|_| InvalidOutput::NotJson)?;

    // Step 2: JSON Schema. Errors inside /findings/<i> quarantine item i; any other
    // error means the document itself is off.
    let mut bad_items = BTreeSet::new();
    for err in schema.validator.iter_errors(&doc) {
        let path = err.instance_path().to_string();
        match item_index(&path) {
            Some(i) => {
                bad_items.insert(i);
            }
            None => return Err(InvalidOutput::Shape),
        }
    }
    let items = doc.get("findings").and_then(|f| f.as_array()).ok_or(InvalidOutput::Shape)?;

    let mut out = Validated::default();
    for (index, raw) in items.iter().enumerate() {
        let reason = if bad_items.contains(&index) {
            Some(QuarantineReason::Schema)
        } else {
            match serde_json::from_value::<Finding>(raw.clone()) {
                Ok(mut f) => match semantic_check(&f, diff) {
                    Ok(name) => {
                        // The file's own name, however the model wrote it.
                        f.path = name.to_string();
                        f.fingerprint = Some(fingerprint(&f));
                        out.findings.push(f);
                        None
                    }
                    Err(r) => Some(r),
                },
                Err(_) => Some(QuarantineReason::Schema),
            }
        };
        if let Some(reason) = reason {
            out.quarantined.push(Quarantined { index, reason, raw: raw.clone(), truncated: None });
        }
    }
    // An empty review is published only when the model said there were no findings.
    if out.findings.is_empty()
        && !items.is_empty()
        && out.quarantined.iter().all(|q| q.reason == QuarantineReason::Schema)
    {
        return Err(InvalidOutput::AllFindingsInvalid);
    }
    Ok(out)
}

/// Step 3: the finding must point into the diff and quote it: its lines in one hunk
/// on their side, the evidence on that side of that hunk, and a replacement only for
/// lines of the new side. The file's name as the diff has it (`crate::diff::path`).
pub fn semantic_check<'d>(f: &Finding, diff: &'d Diff) -> Result<&'d str, QuarantineReason> {
    let side = f.side();
    let (file, name) = match side {
        Side::New => diff.file_by_new_path(&f.path).map(|file| (file, file.new_path.as_deref())),
        Side::Old => diff.file_by_old_path(&f.path).map(|file| (file, file.old_path.as_deref())),
    }
    .ok_or(QuarantineReason::PathNotInDiff)?;
    let hunk = match side {
        Side::New => file.hunk_for_new_line(f.line),
        Side::Old => file.hunk_for_old_line(f.line),
    }
    .ok_or(QuarantineReason::LineOutsideHunks)?;
    if let Some(end) = f.end_line {
        let last = match side {
            Side::New => file.hunk_for_new_line(end),
            Side::Old => file.hunk_for_old_line(end),
        };
        if end < f.line || !last.is_some_and(|h| std::ptr::eq(h, hunk)) {
            return Err(QuarantineReason::RangeOutsideHunk);
        }
    }
    if !hunk.contains_text(&f.evidence) {
        return Err(QuarantineReason::EvidenceNotInHunk);
    }
    let on_side = match side {
        Side::New => hunk.contains_new_side_text(&f.evidence),
        Side::Old => hunk.contains_old_side_text(&f.evidence),
    };
    if !on_side {
        return Err(QuarantineReason::EvidenceNotOnLineSide);
    }
    if f.suggested_replacement.is_some() && side != Side::New {
        return Err(QuarantineReason::ReplacementNotApplicable);
    }
    Ok(name.unwrap_or_default())
}

/// `/findings/3/severity` -> 3
fn item_index(instance_path: &str) -> Option<usize> {
    let mut parts = instance_path.trim_start_matches('/').split('/');
    if parts.next()? != "findings" {
        return None;
    }
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn diff() -> Diff {
        crate::diff::parse(
            "--- a/src/app.rs\n+++ b/src/app.rs\n@@ -1,2 +1,3 @@\n fn main() {\n+    let x = y.unwrap();\n }\n@@ -20,1 +21,2 @@\n tail();\n+// TODO: later\n",
        )
        .unwrap()
    }

    fn finding(path: &str, line: u32, evidence: &str) -> serde_json::Value {
        json!({"path": path, "line": line, "severity": "medium", "category": "reliability",
               "title": "t", "message": "m", "evidence": evidence})
    }

    #[test]
    fn valid_findings_pass() {
        let out = json!({"findings": [finding("src/app.rs", 2, "y.unwrap()"), finding("src/app.rs", 22, "TODO")]});
        let v = validate(FINDINGS_V1, &out.to_string(), &diff()).unwrap();
        assert_eq!(v.findings.len(), 2);
        assert!(v.quarantined.is_empty());
    }

    #[test]
    fn empty_findings_list_is_valid() {
        let v = validate(FINDINGS_V1, r#"{"findings": []}"#, &diff()).unwrap();
        assert!(v.findings.is_empty() && v.quarantined.is_empty());
    }

    #[test]
    fn semantic_failures_are_quarantined_one_by_one() {
        let out = json!({"findings": [
            finding("src/other.rs", 2, "y.unwrap()"),
            finding("src/app.rs", 10, "y.unwrap()"),
            finding("src/app.rs", 2, "not in the hunk"),
            finding("src/app.rs", 2, "unwrap"),
        ]});
        let v = validate(FINDINGS_V1, &out.to_string(), &diff()).unwrap();
        assert_eq!(v.findings.len(), 1);
        let reasons: Vec<_> = v.quarantined.iter().map(|q| (q.index, q.reason)).collect();
        assert_eq!(
            reasons,
            vec![
                (0, QuarantineReason::PathNotInDiff),
                (1, QuarantineReason::LineOutsideHunks),
                (2, QuarantineReason::EvidenceNotInHunk),
            ]
        );
    }

    #[test]
    fn schema_failures_of_one_item_quarantine_that_item() {
        let mut bad_enum = finding("src/app.rs", 2, "unwrap");
        bad_enum["severity"] = json!("catastrophic");
        let mut extra = finding("src/app.rs", 2, "unwrap");
        extra["confidence"] = json!(0.9);
        let mut missing = finding("src/app.rs", 2, "unwrap");
        missing.as_object_mut().unwrap().remove("evidence");
        let out = json!({"findings": [bad_enum, extra, missing, finding("src/app.rs", 2, "unwrap")]});
        let v = validate(FINDINGS_V1, &out.to_string(), &diff()).unwrap();
        assert_eq!(v.findings.len(), 1);
        assert_eq!(v.quarantined.len(), 3);
        assert!(v.quarantined.iter().all(|q| q.reason == QuarantineReason::Schema));
    }

    #[test]
    fn an_answer_whose_every_finding_fails_the_schema_is_invalid_not_an_empty_review() {
        let mut bad_enum = finding("src/app.rs", 2, "unwrap");
        bad_enum["severity"] = json!("catastrophic");
        let mut missing = finding("src/app.rs", 22, "TODO");
        missing.as_object_mut().unwrap().remove("line");
        let out = json!({"findings": [bad_enum, missing]});
        assert_eq!(validate(FINDINGS_V1, &out.to_string(), &diff()), Err(InvalidOutput::AllFindingsInvalid));
        // Findings quarantined for the diff (not the schema) still make a valid answer.
        let out = json!({"findings": [finding("src/other.rs", 2, "y.unwrap()")]});
        let v = validate(FINDINGS_V1, &out.to_string(), &diff()).unwrap();
        assert_eq!((v.findings.len(), v.quarantined.len()), (0, 1));
    }

    #[test]
    fn evidence_must_be_on_the_side_of_its_line() {
        let d = crate::diff::parse(
            "--- a/src/app.rs\n+++ b/src/app.rs\n@@ -1,3 +1,3 @@\n fn main() {\n-    let old = secret();\n+    let new = token();\n }\n",
        )
        .unwrap();
        // Line 2 on the new side is the added line; quoting only the removed line is wrong.
        let out = json!({"findings": [finding("src/app.rs", 2, "let old = secret();"), finding("src/app.rs", 2, "let new = token();")]});
        let v = validate(FINDINGS_V1, &out.to_string(), &d).unwrap();
        assert_eq!(v.findings.len(), 1);
        assert_eq!(v.findings[0].evidence, "let new = token();");
        assert_eq!(v.quarantined[0].reason, QuarantineReason::EvidenceNotOnLineSide);
        assert_eq!(QuarantineReason::EvidenceNotOnLineSide.as_str(), "evidence_not_on_line_side");
    }

    #[test]
    fn a_name_that_is_not_utf8_is_delivered_as_the_diff_has_it_however_the_model_wrote_it() {
        // `l\xe9gacy.txt` as git quotes it by default, and `caf\xe9.txt` sent as raw bytes.
        let mut raw = b"--- \"a/l\\351gacy.txt\"\n+++ \"b/l\\351gacy.txt\"\n@@ -1 +1,2 @@\n one\n+two\n".to_vec();
        raw.extend_from_slice(b"--- a/caf\xe9.txt\n+++ b/caf\xe9.txt\n@@ -0,0 +1 @@\n+three\n");
        let d = crate::diff::parse_bytes(&raw).unwrap();
        let (legacy, cafe) = ("\"l\\351gacy.txt\"", "\"caf\\351.txt\"");
        let out = json!({"findings": [
            finding(legacy, 2, "two"),
            finding("l\\351gacy.txt", 2, "two"),
            finding("l\u{fffd}gacy.txt", 2, "two"),
            finding("caf\u{fffd}.txt", 1, "three"),
            finding("caf\u{e9}.txt", 1, "three"),
        ]});
        let v = validate(FINDINGS_V1, &out.to_string(), &d).unwrap();
        let paths: Vec<&str> = v.findings.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, [legacy, legacy, legacy, cafe], "{v:?}");
        // One finding, one fingerprint, whichever way the name was written.
        assert!(v.findings[..3].iter().all(|f| f.fingerprint == v.findings[0].fingerprint));
        // A guess at the encoding is no name of the diff.
        assert_eq!(
            v.quarantined.iter().map(|q| (q.index, q.reason)).collect::<Vec<_>>(),
            [(4, QuarantineReason::PathNotInDiff)]
        );
        // Decoded names that two files share name neither.
        let mut two = raw.clone();
        two.extend_from_slice(b"--- a/caf\xe8.txt\n+++ b/caf\xe8.txt\n@@ -0,0 +1 @@\n+three\n");
        let d = crate::diff::parse_bytes(&two).unwrap();
        let out = json!({"findings": [finding("caf\u{fffd}.txt", 1, "three")]});
        assert_eq!(
            validate(FINDINGS_V1, &out.to_string(), &d).unwrap().quarantined[0].reason,
            QuarantineReason::PathNotInDiff
        );
    }

    #[test]
    fn whole_document_failures_are_invalid_output() {
        let d = diff();
        assert_eq!(validate(FINDINGS_V1, "not json {", &d), Err(InvalidOutput::NotJson));
        assert_eq!(validate(FINDINGS_V1, "[]", &d), Err(InvalidOutput::Shape));
        assert_eq!(validate(FINDINGS_V1, r#"{"items": []}"#, &d), Err(InvalidOutput::Shape));
        assert_eq!(validate(FINDINGS_V1, r#"{"findings": [], "extra": 1}"#, &d), Err(InvalidOutput::Shape));
        assert_eq!(validate("findings.v9", r#"{"findings": []}"#, &d), Err(InvalidOutput::UnknownSchema));
    }

    fn v2(path: &str, line: u32, evidence: &str) -> serde_json::Value {
        let mut f = finding(path, line, evidence);
        f["suggested_action"] = json!("Handle the error.");
        f["confidence"] = json!("high");
        f
    }

    #[test]
    fn v2_findings_carry_a_range_a_side_an_action_and_a_fingerprint() {
        let d = crate::diff::parse(
            "--- a/src/app.rs\n+++ b/src/app.rs\n@@ -1,3 +1,4 @@\n fn main() {\n-    let old = secret();\n+    let new = token();\n+    use_it(new);\n }\n",
        )
        .unwrap();
        let mut ranged = v2("src/app.rs", 2, "let new = token();");
        ranged["end_line"] = json!(3);
        ranged["suggested_replacement"] = json!("    let new = token()?;\n    use_it(new);");
        let mut old_side = v2("src/app.rs", 2, "let old = secret();");
        old_side["side"] = json!("old");
        // OpenAI's strict mode sends optional fields as null.
        let mut nulls = v2("src/app.rs", 3, "use_it(new);");
        nulls["end_line"] = json!(null);
        nulls["side"] = json!(null);
        nulls["suggested_replacement"] = json!(null);
        let out = json!({"findings": [ranged, old_side, nulls]});
        let v = validate(FINDINGS_V2, &out.to_string(), &d).unwrap();
        assert!(v.quarantined.is_empty(), "{:?}", v.quarantined);
        assert_eq!(v.findings[0].lines(), 2..=3);
        assert_eq!(v.findings[1].side(), Side::Old);
        assert_eq!(v.findings[0].suggested_action.as_deref(), Some("Handle the error."));
        assert_eq!((v.findings[2].end_line, v.findings[2].side), (None, None));
        // The fingerprint ignores line numbers and whitespace layout, not the evidence.
        let fp = |f: &Finding| f.fingerprint.clone().unwrap();
        let mut moved = v.findings[0].clone();
        moved.line = 40;
        moved.evidence = "let  new =\ttoken();".into();
        assert_eq!(fingerprint(&moved), fp(&v.findings[0]));
        assert_ne!(fp(&v.findings[0]), fp(&v.findings[2]));
        assert_eq!(fp(&v.findings[0]).len(), 32);
    }

    #[test]
    fn v2_ranges_and_replacements_must_fit_the_diff() {
        let d = diff();
        let mut backwards = v2("src/app.rs", 2, "y.unwrap()");
        backwards["end_line"] = json!(1);
        let mut across_hunks = v2("src/app.rs", 2, "y.unwrap()");
        across_hunks["end_line"] = json!(22);
        let mut old_replacement = v2("src/app.rs", 1, "fn main()");
        old_replacement["side"] = json!("old");
        old_replacement["suggested_replacement"] = json!("fn main() -> Result<()> {");
        let mut no_action = v2("src/app.rs", 2, "y.unwrap()");
        no_action.as_object_mut().unwrap().remove("suggested_action");
        let out =
            json!({"findings": [backwards, across_hunks, old_replacement, no_action, v2("src/app.rs", 22, "TODO")]});
        let v = validate(FINDINGS_V2, &out.to_string(), &d).unwrap();
        let reasons: Vec<_> = v.quarantined.iter().map(|q| (q.index, q.reason)).collect();
        assert_eq!(
            reasons,
            vec![
                (0, QuarantineReason::RangeOutsideHunk),
                (1, QuarantineReason::RangeOutsideHunk),
                (2, QuarantineReason::ReplacementNotApplicable),
                (3, QuarantineReason::Schema),
            ]
        );
        assert_eq!(v.findings.len(), 1);
        // v1 stays as it was: the v2 fields are not part of it.
        let out = json!({"findings": [v2("src/app.rs", 2, "y.unwrap()")]});
        assert_eq!(validate(FINDINGS_V1, &out.to_string(), &d), Err(InvalidOutput::AllFindingsInvalid));
    }

    #[test]
    fn the_compact_schema_asks_for_less_and_its_answers_meet_the_full_schema() {
        let compact = compact_schema_document(FINDINGS_V2).unwrap();
        let props = &compact["properties"]["findings"]["items"]["properties"];
        assert!(props.get("suggested_replacement").is_none());
        assert_eq!(props["message"]["maxLength"], 500);
        assert_eq!(props["suggested_action"]["maxLength"], 300);
        // What the compact schema allows, the full one accepts.
        let answer = json!({"findings": [v2("src/app.rs", 2, "y.unwrap()")]});
        assert!(jsonschema::validator_for(&compact).unwrap().is_valid(&answer));
        assert_eq!(validate(FINDINGS_V2, &answer.to_string(), &diff()).unwrap().findings.len(), 1);
    }

    #[test]
    fn registry_knows_v1_and_v2() {
        assert!(is_known_schema("findings.v1"));
        assert!(is_known_schema("findings.v2"));
        assert!(!is_known_schema("findings.v3"));
        assert_eq!(known_schemas(), vec!["findings.v1", "findings.v2"]);
        assert!(schema_document(LATEST_SCHEMA).is_some());
    }

    #[test]
    fn quarantined_raw_items_are_cut_to_the_bound_with_digest_and_length() {
        let raw = serde_json::json!({"message": "é".repeat(100)});
        let q = Quarantined { index: 0, reason: QuarantineReason::Schema, raw: raw.clone(), truncated: None };
        assert_eq!(q.clone().bounded(10_000), q, "small items stay whole");
        let cut = q.bounded(51);
        let text = raw.to_string();
        let kept = cut.raw.as_str().unwrap();
        assert!(kept.len() <= 51 && text.starts_with(kept), "{kept}");
        let t = cut.truncated.unwrap();
        assert_eq!(t.original_bytes, text.len());
        assert_eq!(t.sha256, crate::job_id::sha256_hex(&[text.as_bytes()]));
    }
}
