//! Splitting a diff into parts that each fit a model's context: the pure core of
//! reviewing a large pull request as one job.
//!
//! Parts are cut at file and hunk boundaries; a hunk larger than a part is cut by line
//! ranges, each range led by up to `overlap` unchanged lines before it for context.
//! Every part is a unified diff of its own with the original line numbers, so findings
//! on it validate against the whole diff, and every changed line is in exactly one
//! part. Sizes are estimated in tokens from bytes (a documented ratio with a safety
//! margin, for model families without a tokenizer crate).

use crate::diff::{Diff, Hunk, LineKind, render_run};

/// How large a part may be.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartLimits {
    /// The model's context budget for the diff, in tokens.
    pub max_tokens: usize,
    /// Bytes per token of the model family's tokenizer (about 3.5 for code with
    /// OpenAI's and Anthropic's tokenizers; lower is safer).
    pub bytes_per_token: f64,
    /// Share of `max_tokens` a part may fill (the rest is the estimate's error margin).
    pub fill: f64,
    /// Unchanged lines repeated before a hunk's later ranges, for context.
    pub overlap: usize,
}

impl Default for PartLimits {
    fn default() -> Self {
        PartLimits { max_tokens: 100_000, bytes_per_token: 3.5, fill: 0.8, overlap: 3 }
    }
}

impl PartLimits {
    /// The estimated tokens of `text`.
    pub fn tokens(&self, text: &str) -> usize {
        (text.len() as f64 / self.bytes_per_token).ceil() as usize
    }

    fn budget(&self) -> usize {
        ((self.max_tokens as f64) * self.fill).max(1.0) as usize
    }
}

/// One part: a unified diff and its estimated size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub text: String,
    pub tokens: usize,
}

/// Splits `diff` into parts within `limits`, in file and hunk order. A single line
/// larger than a part is a part of its own (it cannot be cut further).
pub fn split(diff: &Diff, limits: &PartLimits) -> Vec<Part> {
    let budget = limits.budget();
    let mut parts = Vec::new();
    let mut current = String::new();
    let flush = |current: &mut String, parts: &mut Vec<Part>| {
        if !current.is_empty() {
            let text = std::mem::take(current);
            parts.push(Part { tokens: limits.tokens(&text), text });
        }
    };
    for f in diff.files.iter().filter(|f| !f.hunks.is_empty()) {
        let header = f.header();
        let mut in_current = false;
        for h in &f.hunks {
            for piece in hunk_pieces(h, &header, budget, limits) {
                let extra = if in_current { piece.clone() } else { format!("{header}{piece}") };
                if !current.is_empty() && limits.tokens(&current) + limits.tokens(&extra) > budget {
                    flush(&mut current, &mut parts);
                    in_current = false;
                }
                if !in_current {
                    current.push_str(&header);
                }
                current.push_str(&piece);
                in_current = true;
            }
        }
    }
    flush(&mut current, &mut parts);
    parts
}

/// The hunk as one piece, or cut into line ranges that each fit with the file header.
fn hunk_pieces(h: &Hunk, header: &str, budget: usize, limits: &PartLimits) -> Vec<String> {
    let numbered = h.numbered();
    let whole = render_run(&numbered);
    if limits.tokens(header) + limits.tokens(&whole) <= budget {
        return vec![whole];
    }
    let mut pieces = Vec::new();
    let mut start = 0;
    while start < numbered.len() {
        // Up to `overlap` unchanged lines before the range, for context.
        let lead =
            (0..start).rev().take(limits.overlap).take_while(|&i| numbered[i].0.kind == LineKind::Context).count();
        let mut end = start + 1;
        while end < numbered.len()
            && limits.tokens(header) + limits.tokens(&render_run(&numbered[start - lead..end + 1])) <= budget
        {
            end += 1;
        }
        pieces.push(render_run(&numbered[start - lead..end]));
        start = end;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diff::parse;

    fn file(name: &str, lines: usize) -> String {
        let body: String = (0..lines).map(|i| format!("+let value_{i} = compute({i});\n")).collect();
        format!("diff --git a/{name} b/{name}\n--- /dev/null\n+++ b/{name}\n@@ -0,0 +1,{lines} @@\n{body}")
    }

    #[test]
    fn small_diffs_are_one_part_and_large_ones_are_cut_within_the_budget() {
        let small = parse(&file("a.rs", 10)).unwrap();
        assert_eq!(split(&small, &PartLimits::default()).len(), 1);

        // 40 files of 500 lines (~0.6 MB): many parts, each within the budget.
        let text: String = (0..40).map(|i| file(&format!("src/f{i}.rs"), 500)).collect();
        let big = parse(&text).unwrap();
        let limits = PartLimits { max_tokens: 20_000, ..Default::default() };
        let parts = split(&big, &limits);
        assert!(parts.len() > 10, "{}", parts.len());
        for p in &parts {
            assert!(p.tokens <= limits.budget(), "{} > {}", p.tokens, limits.budget());
            parse(&p.text).unwrap();
        }
    }

    #[test]
    fn a_hunk_larger_than_a_part_is_cut_by_lines_with_context_before_each_range() {
        let ctx: String = (0..30).map(|i| format!(" fn keep_{i}() {{}}\n")).collect();
        let adds: String = (0..30).map(|i| format!("+fn add_{i}() {{ body(); }}\n")).collect();
        let text = format!("--- a/x.rs\n+++ b/x.rs\n@@ -1,60 +1,90 @@\n{ctx}{adds}{ctx}");
        let d = parse(&text).unwrap();
        let limits = PartLimits { max_tokens: 200, bytes_per_token: 1.0, fill: 1.0, overlap: 2 };
        let parts = split(&d, &limits);
        assert!(parts.len() > 3);
        let mut seen = Vec::new();
        for p in &parts {
            let pd = parse(&p.text).unwrap_or_else(|e| panic!("{e}\n{}", p.text));
            seen.extend(pd.added_lines().map(|(_, _, l)| l.new_line.unwrap()));
        }
        let all: Vec<u32> = d.added_lines().map(|(_, _, l)| l.new_line.unwrap()).collect();
        assert_eq!(seen, all, "every added line once, in order, at its number");
    }
}
