//! Splitting a diff into parts that each fit a model's context: the pure core of
//! reviewing a large pull request as one job.
//!
//! Parts are cut at file and hunk boundaries; a hunk larger than a part is cut by line
//! ranges, each range led by up to `overlap` unchanged lines before it for context.
//! Every part is a unified diff of its own with the original line numbers, so findings
//! on it validate against the whole diff, and every changed line is in exactly one
//! part. Sizes are estimated in tokens from bytes (a documented ratio with a safety
//! margin, for model families without a tokenizer crate) or by the family's tokenizer.

use serde::{Deserialize, Serialize};

use crate::diff::{Diff, Hunk, LineKind, render_run};

/// Counts tokens of a text the way a model family's tokenizer does (or estimates it).
pub trait TokenCount: Send + Sync {
    fn tokens(&self, text: &str) -> usize;
}

/// The documented estimate for model families without a tokenizer crate: bytes divided
/// by a bytes-per-token ratio, rounded up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// About 3.5 for code with OpenAI's and Anthropic's tokenizers; lower is safer.
    pub bytes_per_token: f64,
}

impl TokenCount for Estimate {
    fn tokens(&self, text: &str) -> usize {
        (text.len() as f64 / self.bytes_per_token).ceil() as usize
    }
}

/// How large a part may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartLimits {
    /// The model's context budget for the diff, in tokens.
    pub max_tokens: usize,
    /// Percentage of `max_tokens` a part may fill (the rest is the count's error margin).
    pub fill_percent: usize,
    /// Unchanged lines repeated before a hunk's later ranges, for context.
    pub overlap: usize,
}

impl Default for PartLimits {
    fn default() -> Self {
        PartLimits { max_tokens: 100_000, fill_percent: 80, overlap: 3 }
    }
}

impl PartLimits {
    /// The tokens a part may hold.
    pub fn budget(&self) -> usize {
        (self.max_tokens * self.fill_percent / 100).max(1)
    }
}

/// How token counts are made for a model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Tokenizer {
    /// `Estimate` with this many thousandths of a byte per token.
    Estimate { milli_bytes_per_token: u32 },
    /// OpenAI's `o200k_base` (GPT-4o, GPT-4.1, o-series).
    O200k,
    /// OpenAI's `cl100k_base` (GPT-4, GPT-3.5).
    Cl100k,
}

impl Default for Tokenizer {
    /// The estimate at 3 bytes per token.
    fn default() -> Self {
        Tokenizer::Estimate { milli_bytes_per_token: 3000 }
    }
}

impl Tokenizer {
    pub fn as_str(self) -> &'static str {
        match self {
            Tokenizer::Estimate { .. } => "estimate",
            Tokenizer::O200k => "o200k",
            Tokenizer::Cl100k => "cl100k",
        }
    }
}

/// What a review is split with: stored with the job, so every holder splits it alike
/// even if the configuration changed meanwhile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub limits: PartLimits,
    pub tokenizer: Tokenizer,
}

/// One part: a unified diff and its counted size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub text: String,
    pub tokens: usize,
}

/// Splits `diff` into parts within `limits`, in file and hunk order, counting with
/// `count` (each line counted once: linear in the diff's size). A single line larger
/// than a part is a part of its own (it cannot be cut further).
pub fn split(diff: &Diff, limits: &PartLimits, count: &dyn TokenCount) -> Vec<Part> {
    let budget = limits.budget();
    let mut parts = Vec::new();
    let mut current = String::new();
    let mut current_tokens = 0;
    let mut flush = |current: &mut String, current_tokens: &mut usize| {
        if !current.is_empty() {
            parts.push(Part { text: std::mem::take(current), tokens: std::mem::take(current_tokens) });
        }
    };
    for f in diff.files.iter().filter(|f| !f.hunks.is_empty()) {
        let header = f.header();
        let header_tokens = count.tokens(&header);
        let mut in_current = false;
        for h in &f.hunks {
            for (piece, piece_tokens) in hunk_pieces(h, header_tokens, budget, limits, count) {
                let extra = piece_tokens + if in_current { 0 } else { header_tokens };
                if !current.is_empty() && current_tokens + extra > budget {
                    flush(&mut current, &mut current_tokens);
                    in_current = false;
                }
                if !in_current {
                    current.push_str(&header);
                    current_tokens += header_tokens;
                }
                current.push_str(&piece);
                current_tokens += piece_tokens;
                in_current = true;
            }
        }
    }
    flush(&mut current, &mut current_tokens);
    parts
}

/// The hunk as one piece, or cut into line ranges that each fit with the file header;
/// each with its tokens (the range's hunk header counted as the whole hunk's, which is
/// never shorter).
fn hunk_pieces(
    h: &Hunk,
    header_tokens: usize,
    budget: usize,
    limits: &PartLimits,
    count: &dyn TokenCount,
) -> Vec<(String, usize)> {
    let numbered = h.numbered();
    let line_tokens: Vec<usize> = numbered.iter().map(|n| count.tokens(&render_line(n.0))).collect();
    let whole = render_run(&numbered);
    let hh_tokens = count.tokens(whole.lines().next().unwrap_or_default()) + 1;
    let whole_tokens = hh_tokens + line_tokens.iter().sum::<usize>();
    if header_tokens + whole_tokens <= budget {
        return vec![(whole, whole_tokens)];
    }
    let mut pieces = Vec::new();
    let mut start = 0;
    while start < numbered.len() {
        // Up to `overlap` unchanged lines before the range, for context.
        let lead =
            (0..start).rev().take(limits.overlap).take_while(|&i| numbered[i].0.kind == LineKind::Context).count();
        let mut tokens = hh_tokens + line_tokens[start - lead..=start].iter().sum::<usize>();
        let mut end = start + 1;
        while end < numbered.len() && header_tokens + tokens + line_tokens[end] <= budget {
            tokens += line_tokens[end];
            end += 1;
        }
        pieces.push((render_run(&numbered[start - lead..end]), tokens));
        start = end;
    }
    pieces
}

/// One line as a hunk holds it.
fn render_line(l: &crate::diff::HunkLine) -> String {
    let mark = match l.kind {
        LineKind::Context => ' ',
        LineKind::Added => '+',
        LineKind::Removed => '-',
    };
    format!("{mark}{}\n", l.text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diff::parse;

    const EST: Estimate = Estimate { bytes_per_token: 3.5 };

    fn file(name: &str, lines: usize) -> String {
        let body: String = (0..lines).map(|i| format!("+let value_{i} = compute({i});\n")).collect();
        format!("diff --git a/{name} b/{name}\n--- /dev/null\n+++ b/{name}\n@@ -0,0 +1,{lines} @@\n{body}")
    }

    #[test]
    fn small_diffs_are_one_part_and_large_ones_are_cut_within_the_budget() {
        let small = parse(&file("a.rs", 10)).unwrap();
        assert_eq!(split(&small, &PartLimits::default(), &EST).len(), 1);

        // 40 files of 500 lines (~0.6 MB): many parts, each within the budget.
        let text: String = (0..40).map(|i| file(&format!("src/f{i}.rs"), 500)).collect();
        let big = parse(&text).unwrap();
        let limits = PartLimits { max_tokens: 20_000, ..Default::default() };
        let parts = split(&big, &limits, &EST);
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
        let limits = PartLimits { max_tokens: 200, fill_percent: 100, overlap: 2 };
        let parts = split(&d, &limits, &Estimate { bytes_per_token: 1.0 });
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
