//! Merging a split review (see `chunk`): the validated findings of every part become
//! one result — deduplicated across parts, sorted, capped — published once like the
//! result of a review of one part.

use std::collections::HashMap;

use crate::findings::{Finding, Validated};

/// The merged result, and how many findings the cap left out.
#[derive(Debug, Clone, PartialEq)]
pub struct Merged {
    pub validated: Validated,
    pub dropped: u32,
}

use crate::findings::severity_rank as rank;

/// Evidence compared without its whitespace layout.
fn normalised(evidence: &str) -> String {
    evidence.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Two findings are one when they are on the same path and of the same category, and
/// either cover the same lines or overlapping lines with overlapping evidence (one
/// quotes the other): parts repeat context lines, and a model may report the same
/// problem from either side.
fn same(a: &Finding, b: &Finding) -> bool {
    let (a_lines, b_lines) = (a.lines(), b.lines());
    if a_lines == b_lines {
        return true;
    }
    let overlap = a_lines.start() <= b_lines.end() && b_lines.start() <= a_lines.end();
    let (ea, eb) = (normalised(&a.evidence), normalised(&b.evidence));
    overlap && !ea.is_empty() && !eb.is_empty() && (ea.contains(&eb) || eb.contains(&ea))
}

/// Merges the parts' results in part order: a duplicate keeps the more severe finding
/// (the earlier one on a tie); findings are sorted by severity (highest first), path,
/// line and category; at most `cap` are kept. Quarantined findings are all kept (they
/// are never delivered).
pub fn merge(parts: impl IntoIterator<Item = Validated>, cap: usize) -> Merged {
    let mut kept: Vec<Finding> = Vec::new();
    // Findings by (path, category): duplicates are looked for only among these.
    let mut groups: HashMap<(String, String), Vec<usize>> = HashMap::new();
    let mut quarantined = Vec::new();
    for part in parts {
        for f in part.findings {
            let group = groups.entry((f.path.clone(), f.category.clone())).or_default();
            match group.iter().copied().find(|&i| same(&kept[i], &f)) {
                Some(i) if rank(&f.severity) > rank(&kept[i].severity) => kept[i] = f,
                Some(_) => {}
                None => {
                    group.push(kept.len());
                    kept.push(f);
                }
            }
        }
        quarantined.extend(part.quarantined);
    }
    kept.sort_by(|a, b| {
        rank(&b.severity)
            .cmp(&rank(&a.severity))
            .then_with(|| a.path.cmp(&b.path))
            .then_with(|| a.line.cmp(&b.line))
            .then_with(|| a.category.cmp(&b.category))
    });
    let dropped = kept.len().saturating_sub(cap);
    kept.truncate(cap);
    Merged { validated: Validated { findings: kept, quarantined }, dropped: dropped as u32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(path: &str, line: u32, severity: &str, category: &str, evidence: &str) -> Finding {
        Finding {
            path: path.into(),
            line,
            severity: severity.into(),
            category: category.into(),
            title: "t".into(),
            message: "m".into(),
            evidence: evidence.into(),
            ..Finding::default()
        }
    }

    fn part(findings: Vec<Finding>) -> Validated {
        Validated { findings, quarantined: Vec::new() }
    }

    #[test]
    fn duplicates_across_parts_are_merged_keeping_the_more_severe() {
        let merged = merge(
            [
                part(vec![f("a.rs", 10, "low", "security", "let x = y;"), f("a.rs", 20, "low", "style", "z")]),
                // The same line and category from the next part's context: one finding.
                part(vec![f("a.rs", 10, "high", "security", "let   x = y;")]),
                // Same line, other category; other path: kept.
                part(vec![f("a.rs", 10, "low", "performance", "let x = y;"), f("b.rs", 10, "low", "security", "x")]),
            ],
            100,
        );
        let got: Vec<_> = merged
            .validated
            .findings
            .iter()
            .map(|f| (f.path.as_str(), f.line, f.severity.as_str(), f.category.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a.rs", 10, "high", "security"),
                ("a.rs", 10, "low", "performance"),
                ("a.rs", 20, "low", "style"),
                ("b.rs", 10, "low", "security"),
            ]
        );
        assert_eq!(merged.dropped, 0);
    }

    #[test]
    fn overlapping_lines_are_one_finding_only_when_the_evidence_overlaps() {
        let mut wide = f("a.rs", 10, "medium", "correctness", "if a {\n    b();\n}");
        wide.end_line = Some(12);
        let inner = f("a.rs", 11, "medium", "correctness", "b();");
        let unrelated = f("a.rs", 12, "medium", "correctness", "something else");
        let merged = merge([part(vec![wide.clone()]), part(vec![inner, unrelated.clone()])], 100);
        assert_eq!(merged.validated.findings, vec![wide, unrelated]);
    }

    #[test]
    fn the_cap_keeps_the_most_severe_and_reports_the_rest() {
        let many: Vec<Finding> = (1..=10)
            .map(|i| f("a.rs", i, if i % 5 == 0 { "critical" } else { "info" }, "style", &format!("e{i}")))
            .collect();
        let merged = merge([part(many)], 3);
        let lines: Vec<(u32, &str)> = merged.validated.findings.iter().map(|f| (f.line, f.severity.as_str())).collect();
        assert_eq!(lines, vec![(5, "critical"), (10, "critical"), (1, "info")]);
        assert_eq!(merged.dropped, 7);
    }
}
