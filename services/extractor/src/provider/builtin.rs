//! The built-in analyzer: deterministic rules over the added lines of a diff, no
//! network, no key. It is the local stack's default provider and answers in the same
//! JSON a model would, so its output goes through the same validation.
//!
//! Rules: hard-coded secrets, debug prints left in, `unwrap`/`expect`/`panic!` in
//! non-test Rust, `eval`, SQL built by string concatenation or formatting, TODO/FIXME.

use std::sync::LazyLock;

use futures::FutureExt;
use futures::future::BoxFuture;
use regex::Regex;
use reviewlane_core::diff::{Diff, LineKind};
use reviewlane_core::job::ReviewDepth;
use reviewlane_shared::Region;
use serde_json::json;

use super::{Provider, ProviderRequest, REFUSED_OTHER_REGION};
use crate::upstream::UpstreamOutcome;

/// Files a rule looks at.
#[derive(Clone, Copy)]
enum Scope {
    Any,
    NonTestRust,
    Rust,
    Script,
    Python,
    Java,
}

struct Rule {
    scope: Scope,
    pattern: Regex,
    /// A second pattern the line must also match.
    and: Option<Regex>,
    severity: &'static str,
    category: &'static str,
    title: &'static str,
    message: &'static str,
}

fn rule(
    scope: Scope,
    pattern: &str,
    severity: &'static str,
    category: &'static str,
    title: &'static str,
    message: &'static str,
) -> Rule {
    Rule {
        scope,
        pattern: Regex::new(pattern).expect("rule pattern compiles"),
        and: None,
        severity,
        category,
        title,
        message,
    }
}

static RULES: LazyLock<Vec<Rule>> = LazyLock::new(|| {
    vec![
        rule(
            Scope::Any,
            r"-----BEGIN (RSA |EC |DSA |OPENSSH )?PRIVATE KEY-----",
            "critical",
            "security",
            "Private key committed",
            "A private key is added to the repository. Remove it, rotate the key, and load it from a secret store.",
        ),
        rule(
            Scope::Any,
            r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",
            "critical",
            "security",
            "AWS access key committed",
            "An AWS access key id is hard-coded. Revoke it and read credentials from the environment or a secret store.",
        ),
        rule(
            Scope::Any,
            r"\b(sk-[A-Za-z0-9_-]{20,}|ghp_[A-Za-z0-9]{30,}|xox[baprs]-[A-Za-z0-9-]{10,})",
            "critical",
            "security",
            "API token committed",
            "An API token is hard-coded. Revoke it and inject it at run time.",
        ),
        rule(
            Scope::Any,
            r#"(?i)\b[a-z_]*(password|passwd|secret|api_?key|token|access_?token|auth_?token)\b["']?\s*[:=]\s*["'][^"'\s]{8,}["']"#,
            "high",
            "security",
            "Hard-coded secret",
            "A credential is assigned a literal value. Read it from configuration or a secret store instead.",
        ),
        rule(
            Scope::Rust,
            r"\bdbg!\(",
            "low",
            "maintainability",
            "Debug macro left in",
            "`dbg!` prints to stderr and is meant for local debugging; remove it before merging.",
        ),
        rule(
            Scope::Script,
            r"\bconsole\.(log|debug|trace)\(",
            "low",
            "maintainability",
            "Debug print left in",
            "Console logging left in shipped code; remove it or use the project's logger.",
        ),
        rule(
            Scope::Python,
            r"^\s*(print\(|breakpoint\(\)|import pdb|pdb\.set_trace\(\))",
            "low",
            "maintainability",
            "Debug print left in",
            "A debug print or breakpoint is left in; remove it or use logging.",
        ),
        rule(
            Scope::Java,
            r"System\.(out|err)\.print(ln)?\(|\.printStackTrace\(\)",
            "low",
            "maintainability",
            "Debug print left in",
            "Printing to stdout/stderr bypasses logging; use the logger.",
        ),
        rule(
            Scope::NonTestRust,
            r"\.unwrap\(\)|\.expect\(",
            "medium",
            "reliability",
            "unwrap/expect in non-test code",
            "This panics on the error path. Propagate the error with `?` or handle it.",
        ),
        rule(
            Scope::NonTestRust,
            r"\b(panic|unimplemented|todo)!\(",
            "medium",
            "reliability",
            "panic in non-test code",
            "This aborts the task at run time. Return an error instead.",
        ),
        rule(
            Scope::Any,
            r"(^|[^.\w])eval\s*\(",
            "high",
            "security",
            "Use of eval",
            "`eval` runs arbitrary code built from data; parse the input or dispatch explicitly.",
        ),
        Rule {
            and: Some(
                Regex::new(
                    r#"["'`]\s*(\+|\.\.|\|\||%\s)|\+\s*["'`]|format!\(|\bf["']|\.format\(|sprintf\(|\$\{|%s|\{\}"#,
                )
                .expect("compiles"),
            ),
            ..rule(
                Scope::Any,
                r#"(?i)["'`]\s*(select\s.*\bfrom|insert\s+into|update\s+\w+\s+set|delete\s+from)\b"#,
                "high",
                "security",
                "SQL built from strings",
                "The query is assembled from strings, which invites SQL injection. Use bound parameters.",
            )
        },
        rule(
            Scope::Any,
            r"\b(TODO|FIXME|XXX)\b",
            "info",
            "maintainability",
            "TODO/FIXME left in",
            "An open TODO/FIXME is added; track it in an issue or resolve it before merging.",
        ),
    ]
});

fn in_scope(scope: Scope, path: &str) -> bool {
    // A name that is no UTF-8 comes in git's quoted form: its extension is the shown one's.
    let shown = reviewlane_core::diff::path::display(path);
    let path = shown.as_ref();
    let ext = path.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
    match scope {
        Scope::Any => true,
        Scope::Rust => ext == "rs",
        Scope::NonTestRust => ext == "rs" && !is_rust_test_path(path),
        Scope::Script => matches!(ext, "js" | "jsx" | "ts" | "tsx" | "mjs" | "cjs"),
        Scope::Python => ext == "py",
        Scope::Java => matches!(ext, "java" | "kt"),
    }
}

fn is_rust_test_path(path: &str) -> bool {
    let p = format!("/{path}");
    p.contains("/tests/")
        || p.contains("/benches/")
        || p.contains("/examples/")
        || p.ends_with("_test.rs")
        || p.ends_with("/tests.rs")
}

/// Evidence: the trimmed line, cut at 200 characters (on a char boundary), so it is
/// always a substring of the hunk.
fn evidence(text: &str) -> String {
    text.trim().chars().take(200).collect()
}

/// Runs every rule over every added line. Deterministic: same diff, same answer.
pub fn analyze(diff: &Diff) -> serde_json::Value {
    analyze_at(diff, ReviewDepth::Full)
}

/// The fix a rule's message gives (its sentences after the first), for `findings.v2`'s
/// `suggested_action`.
fn action(message: &str) -> &str {
    match message.split_once(". ") {
        Some((_, rest)) if !rest.trim().is_empty() => rest.trim(),
        _ => message,
    }
}

/// `analyze_at` for a schema version: `findings.v2` answers also carry a suggested
/// action and a confidence (high for the credential patterns, which rarely misfire).
pub fn analyze_for(diff: &Diff, depth: ReviewDepth, schema_version: &str) -> serde_json::Value {
    let mut out = analyze_at(diff, depth);
    if schema_version == reviewlane_core::findings::FINDINGS_V2 {
        for f in out["findings"].as_array_mut().into_iter().flatten() {
            let message = f["message"].as_str().unwrap_or_default().to_string();
            f["suggested_action"] = json!(action(&message));
            f["confidence"] = json!(if f["severity"] == "critical" { "high" } else { "medium" });
        }
    }
    out
}

/// At depth `changed_hunks` (admission degraded the review under load) only findings
/// of medium severity and above are reported.
pub fn analyze_at(diff: &Diff, depth: ReviewDepth) -> serde_json::Value {
    let mut findings = Vec::new();
    'files: for file in &diff.files {
        let Some(path) = file.new_path.as_deref() else { continue };
        if file.binary {
            continue;
        }
        // Lines after a `#[cfg(test)]` seen in the file's new side count as test code.
        let mut in_test_module = false;
        for hunk in &file.hunks {
            for line in &hunk.lines {
                if line.kind != LineKind::Removed && line.text.trim_start().starts_with("#[cfg(test)]") {
                    in_test_module = true;
                }
                if line.kind != LineKind::Added || line.text.trim().is_empty() {
                    continue;
                }
                let new_line = line.new_line.expect("added lines have a new line number");
                for r in RULES.iter() {
                    if !in_scope(r.scope, path) || (matches!(r.scope, Scope::NonTestRust) && in_test_module) {
                        continue;
                    }
                    if depth == ReviewDepth::ChangedHunks && matches!(r.severity, "info" | "low") {
                        continue;
                    }
                    if r.pattern.is_match(&line.text) && r.and.as_ref().is_none_or(|a| a.is_match(&line.text)) {
                        findings.push(json!({
                            "path": path,
                            "line": new_line,
                            "severity": r.severity,
                            "category": r.category,
                            "title": r.title,
                            "message": r.message,
                            "evidence": evidence(&line.text),
                        }));
                        if findings.len() >= 200 {
                            break 'files;
                        }
                    }
                }
            }
        }
    }
    json!({ "findings": findings })
}

pub struct BuiltinAnalyzer {
    region: Region,
}

impl BuiltinAnalyzer {
    pub fn new(region: Region) -> Self {
        BuiltinAnalyzer { region }
    }
}

impl Provider for BuiltinAnalyzer {
    fn name(&self) -> &'static str {
        "builtin"
    }

    fn region(&self) -> Region {
        self.region
    }

    fn review<'a>(&'a self, req: &'a ProviderRequest<'a>) -> BoxFuture<'a, UpstreamOutcome> {
        let outcome = if req.region != self.region {
            UpstreamOutcome::Permanent { status: REFUSED_OTHER_REGION }
        } else {
            UpstreamOutcome::Ok {
                output: analyze_for(req.diff, req.review_depth, req.schema_version).to_string(),
                slow_down: None,
                // No model, no tokens.
                usage: None,
                meter: Default::default(),
            }
        };
        futures::future::ready(outcome).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reviewlane_core::diff::parse;
    use reviewlane_core::findings::{FINDINGS_V1, FINDINGS_V2, validate};

    #[test]
    fn v2_answers_carry_an_action_and_a_confidence_and_validate() {
        let text = "--- a/src/lib.rs\n+++ b/src/lib.rs\n@@ -1,1 +1,3 @@\n fn a() {}\n+let v = x.unwrap();\n+let key = \"AKIAABCDEFGHIJKLMNOP\";\n";
        let d = parse(text).unwrap();
        let out = analyze_for(&d, ReviewDepth::Full, FINDINGS_V2);
        let v = validate(FINDINGS_V2, &out.to_string(), &d).unwrap();
        assert!(v.quarantined.is_empty() && v.findings.len() >= 2, "{v:?}");
        let unwrap = v.findings.iter().find(|f| f.title.starts_with("unwrap")).unwrap();
        assert_eq!(unwrap.suggested_action.as_deref(), Some("Propagate the error with `?` or handle it."));
        assert!(v.findings.iter().any(|f| f.confidence.as_deref() == Some("high")));
        // v1 answers stay v1.
        assert!(
            validate(FINDINGS_V1, &analyze_for(&d, ReviewDepth::Full, FINDINGS_V1).to_string(), &d)
                .unwrap()
                .quarantined
                .is_empty()
        );
    }

    fn titles(diff: &str) -> Vec<(String, u64, String)> {
        let d = parse(diff).unwrap();
        analyze(&d)["findings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                (
                    f["path"].as_str().unwrap().to_string(),
                    f["line"].as_u64().unwrap(),
                    f["title"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    fn one_file(path: &str, added: &[&str]) -> String {
        let mut s = format!("--- a/{path}\n+++ b/{path}\n@@ -10,1 +10,{} @@\n ctx\n", added.len() + 1);
        for a in added {
            s.push('+');
            s.push_str(a);
            s.push('\n');
        }
        s
    }

    #[test]
    fn finds_each_rule_on_the_right_line() {
        let f = titles(&one_file(
            "src/db.rs",
            &[
                "let pw = \"hunter2hunter2\"; let password = \"hunter2hunter2\";",
                "let v = map.get(k).unwrap();",
                "dbg!(v);",
                "let q = format!(\"SELECT * FROM users WHERE id = {}\", id);",
                "// TODO: handle errors",
                "let fine = 1 + 2;",
            ],
        ));
        assert_eq!(
            f,
            vec![
                ("src/db.rs".into(), 11, "Hard-coded secret".into()),
                ("src/db.rs".into(), 12, "unwrap/expect in non-test code".into()),
                ("src/db.rs".into(), 13, "Debug macro left in".into()),
                ("src/db.rs".into(), 14, "SQL built from strings".into()),
                ("src/db.rs".into(), 15, "TODO/FIXME left in".into()),
            ]
        );
    }

    #[test]
    fn script_rules() {
        let f = titles(&one_file(
            "web/app.js",
            &[
                "console.log(user)",
                "const r = eval(input)",
                "db.query(\"SELECT * FROM t WHERE name = '\" + name + \"'\")",
                "const key = \"AKIAABCDEFGHIJKLMNOP\"",
            ],
        ));
        let t: Vec<_> = f.iter().map(|x| x.2.as_str()).collect();
        assert_eq!(t, vec!["Debug print left in", "Use of eval", "SQL built from strings", "AWS access key committed"]);
    }

    #[test]
    fn unwrap_in_tests_is_fine() {
        assert!(titles(&one_file("tests/it.rs", &["x.unwrap();"])).is_empty());
        // A name that is no UTF-8, in git's quoted form, keeps its language's rules.
        let latin1 = "--- \"a/src/l\\351gacy.rs\"\n+++ \"b/src/l\\351gacy.rs\"\n@@ -1,1 +1,2 @@\n ctx\n+x.unwrap();\n";
        assert_eq!(titles(latin1).len(), 1, "{:?}", titles(latin1));
        assert!(titles(&one_file("src/a.rs", &["#[cfg(test)]", "mod tests { fn t() { x.unwrap(); } }"])).is_empty());
        assert!(titles(&one_file("src/a.py", &["x.unwrap()"])).is_empty());
        // Removed lines are not reviewed.
        assert!(titles("--- a/src/a.rs\n+++ b/src/a.rs\n@@ -1,1 +1,1 @@\n-x.unwrap();\n+x?;\n").is_empty());
    }

    #[test]
    fn output_always_validates_against_the_diff() {
        let diff = one_file(
            "src/lib.rs",
            &[&format!("    let token = \"{}\"; // TODO {}", "a".repeat(40), "é".repeat(300)), "panic!(\"boom\")"],
        );
        let d = parse(&diff).unwrap();
        let out = analyze(&d).to_string();
        let v = validate(FINDINGS_V1, &out, &d).unwrap();
        assert!(v.quarantined.is_empty(), "{:?}", v.quarantined);
        assert_eq!(v.findings.len(), 3);
    }

    #[test]
    fn deterministic() {
        let d = parse(&one_file("a.py", &["print(x)", "eval(y)"])).unwrap();
        assert_eq!(analyze(&d), analyze(&d));
    }
}

#[cfg(test)]
mod sample_tests {
    use super::*;
    use reviewlane_core::diff::parse;
    use reviewlane_core::findings::{FINDINGS_V1, validate};

    /// The demo's sample diffs parse, and every rule family shows up in them.
    #[test]
    fn sample_diffs_yield_valid_findings_of_every_rule_family() {
        let mut titles = std::collections::BTreeSet::new();
        for text in [
            include_str!("../../../../samples/us-payments.diff"),
            include_str!("../../../../samples/eu-analytics.diff"),
        ] {
            let d = parse(text).expect("sample parses");
            let v = validate(FINDINGS_V1, &analyze(&d).to_string(), &d).unwrap();
            assert!(v.quarantined.is_empty());
            titles.extend(v.findings.into_iter().map(|f| f.title));
        }
        for t in [
            "Hard-coded secret",
            "API token committed",
            "Debug macro left in",
            "Debug print left in",
            "unwrap/expect in non-test code",
            "Use of eval",
            "SQL built from strings",
            "TODO/FIXME left in",
        ] {
            assert!(titles.contains(t), "missing `{t}` in {titles:?}");
        }
    }
}
