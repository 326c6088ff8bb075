//! Properties of the diff parser and the validator over generated input: nothing
//! panics on arbitrary input, every line of a generated diff is found where it is, and a
//! finding that quotes a generated diff validates against it.

use proptest::prelude::*;
use reviewlane_core::diff::{self, LineKind};
use reviewlane_core::findings::{self, LATEST_SCHEMA};

/// One generated line of a hunk.
#[derive(Debug, Clone)]
enum Gen {
    Context(String),
    Added(String),
    Removed(String),
}

/// Text of a line: printable ASCII and some non-ASCII letters, no newline.
fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 _(){};=+\\-*/\"'.,üé中]{0,40}"
}

fn hunk_lines() -> impl Strategy<Value = Vec<Gen>> {
    prop::collection::vec(
        prop_oneof![text().prop_map(Gen::Context), text().prop_map(Gen::Added), text().prop_map(Gen::Removed)],
        1..30,
    )
    .prop_filter("a hunk changes something", |ls| ls.iter().any(|l| !matches!(l, Gen::Context(_))))
}

/// A file path of one to three segments.
fn path() -> impl Strategy<Value = String> {
    prop::collection::vec("[a-z][a-z0-9_]{0,8}", 1..4).prop_map(|s| format!("{}.rs", s.join("/")))
}

/// A generated diff: distinct files, each with hunks at increasing positions, and for
/// each added line (path, new line number, text).
fn generated_diff() -> impl Strategy<Value = (String, Vec<(String, u32, String)>)> {
    prop::collection::btree_map(path(), prop::collection::vec((0u32..50, hunk_lines()), 1..4), 1..5).prop_map(|files| {
        let mut out = String::new();
        let mut added = Vec::new();
        for (path, hunks) in files {
            out.push_str(&format!("diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"));
            let (mut old_at, mut new_at) = (1u32, 1u32);
            for (gap, lines) in hunks {
                old_at += gap;
                new_at += gap;
                let old_len = lines.iter().filter(|l| !matches!(l, Gen::Added(_))).count() as u32;
                let new_len = lines.iter().filter(|l| !matches!(l, Gen::Removed(_))).count() as u32;
                out.push_str(&format!("@@ -{old_at},{old_len} +{new_at},{new_len} @@\n"));
                let mut n = new_at;
                for l in &lines {
                    match l {
                        Gen::Context(t) => {
                            out.push_str(&format!(" {t}\n"));
                            n += 1;
                        }
                        Gen::Added(t) => {
                            out.push_str(&format!("+{t}\n"));
                            added.push((path.clone(), n, t.clone()));
                            n += 1;
                        }
                        Gen::Removed(t) => out.push_str(&format!("-{t}\n")),
                    }
                }
                old_at += old_len;
                new_at += new_len;
            }
        }
        (out, added)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_parser_never_panics_on_arbitrary_text(input in "(?s).{0,400}") {
        let _ = diff::parse(&input);
    }

    #[test]
    fn the_parser_never_panics_on_diff_shaped_text(
        lines in prop::collection::vec(prop_oneof![
            "diff --git [ab]/[a-z\" \\\\]{0,6} [ab]/[a-z\" ]{0,6}",
            "(---|\\+\\+\\+) ([ab]/[a-z]{0,5}|/dev/null|\"[a-z\\\\0-7]{0,6}\"?)",
            "@@ -[0-9]{0,11}(,[0-9]{0,11})? \\+[0-9]{0,11}(,[0-9]{0,11})? @@.{0,5}",
            "[ +\\-\\\\][a-z]{0,5}",
            "(rename|copy) (from|to) [a-z./\"]{0,6}",
            "(new|deleted) file mode 100644",
            "Binary files .{0,6} differ",
        ], 0..40)
    ) {
        let _ = diff::parse(&lines.join("\n"));
    }

    #[test]
    fn every_added_line_of_a_generated_diff_is_found_at_its_number((text, added) in generated_diff()) {
        let parsed = diff::parse(&text).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        let found: Vec<(String, u32, String)> = parsed
            .added_lines()
            .map(|(f, _, l)| (f.new_path.clone().unwrap(), l.new_line.unwrap(), l.text.clone()))
            .collect();
        prop_assert_eq!(found, added);
        // Removed lines have no new-side number; every other line has one.
        for f in &parsed.files {
            for l in f.hunks.iter().flat_map(|h| &h.lines) {
                prop_assert_eq!(l.new_line.is_none(), l.kind == LineKind::Removed);
            }
        }
    }

    #[test]
    fn a_finding_quoting_an_added_line_of_a_generated_diff_validates(
        (text, added) in generated_diff(),
        pick in any::<prop::sample::Index>(),
    ) {
        let eligible: Vec<_> = added.iter().filter(|(_, _, t)| !t.trim().is_empty()).collect();
        if eligible.is_empty() {
            return Ok(());
        }
        let (path, line, quoted) = eligible[pick.index(eligible.len())].clone();
        let parsed = diff::parse(&text).unwrap();
        let output = serde_json::json!({"findings": [{
            "path": path, "line": line, "severity": "low", "category": "style",
            "title": "t", "message": "m", "evidence": quoted.trim(),
        }]})
        .to_string();
        let v = findings::validate(LATEST_SCHEMA, &output, &parsed).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(v.findings.len(), 1, "quarantined: {:?}", v.quarantined);
    }

    #[test]
    fn the_validator_never_panics_on_arbitrary_output((text, _) in generated_diff(), output in "(?s).{0,300}") {
        let parsed = diff::parse(&text).unwrap();
        let _ = findings::validate(LATEST_SCHEMA, &output, &parsed);
    }

    #[test]
    fn the_validator_never_panics_on_json_shaped_output(
        (text, added) in generated_diff(),
        line in any::<i64>(),
        evidence in "(?s).{0,30}",
        severity in "(info|low|high|dire|)",
    ) {
        let parsed = diff::parse(&text).unwrap();
        let path = added.first().map(|a| a.0.clone()).unwrap_or_default();
        let output = serde_json::json!({"findings": [{
            "path": path, "line": line, "severity": severity, "category": "style",
            "title": "t", "message": "m", "evidence": evidence,
        }]})
        .to_string();
        let _ = findings::validate(LATEST_SCHEMA, &output, &parsed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// The degraded view of a diff keeps every added line, under its path and number.
    #[test]
    fn changed_lines_only_keeps_every_added_line((text, added) in generated_diff(), context in 0usize..3) {
        let small = diff::changed_lines_only(&diff::parse(&text).unwrap(), context);
        let trimmed = diff::parse(&small).map_err(|e| TestCaseError::fail(format!("{e}\n{small}")))?;
        let found: Vec<(String, u32, String)> = trimmed
            .added_lines()
            .map(|(f, _, l)| (f.new_path.clone().unwrap(), l.new_line.unwrap(), l.text.clone()))
            .collect();
        prop_assert_eq!(found, added);
        prop_assert!(small.len() <= text.len() + 64 * trimmed.files.len());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Parts of any size: every added line in exactly one part, at its number; every part
    /// parses; a part over the budget holds a single line that cannot be cut.
    #[test]
    fn parts_cover_every_added_line_once((text, added) in generated_diff(), max_tokens in 20usize..400) {
        use reviewlane_core::parts::{Estimate, PartLimits, split};
        let limits = PartLimits { max_tokens, fill_percent: 100, overlap: 2 };
        let parts = split(&diff::parse(&text).unwrap(), &limits, &Estimate { bytes_per_token: 1.0 });
        let mut found = Vec::new();
        for p in &parts {
            let d = diff::parse(&p.text).map_err(|e| TestCaseError::fail(format!("{e}\n{}", p.text)))?;
            found.extend(d.added_lines().map(|(f, _, l)| (f.new_path.clone().unwrap(), l.new_line.unwrap(), l.text.clone())));
            let lines: usize = d.files.iter().flat_map(|f| &f.hunks).map(|h| h.lines.len()).sum();
            prop_assert!(p.tokens <= max_tokens || lines <= 1 + limits.overlap, "{} tokens, {} lines", p.tokens, lines);
        }
        prop_assert_eq!(found, added);
    }
}
