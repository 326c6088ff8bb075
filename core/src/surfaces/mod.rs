//! Review surfaces: a review's findings in the formats other tools read — SARIF 2.1.0
//! for code scanning, reviewdog's Diagnostic Format (rdjson, rdjsonl). Pure functions
//! of the review; the CLI and the file sink write what they return.

pub mod rdjson;
pub mod sarif;

use crate::findings::Finding;

/// What a report is made of.
#[derive(Debug, Clone, Copy)]
pub struct Report<'a> {
    pub job_id: &'a str,
    pub schema_version: &'a str,
    /// The repository and revision reviewed (as the caller named them).
    pub repository: &'a str,
    pub head_revision: &'a str,
    pub findings: &'a [Finding],
}

/// The schema's categories, in a fixed order (SARIF rule indexes).
pub const CATEGORIES: [(&str, &str); 6] = [
    ("security", "A security problem: secrets, injection, unsafe evaluation."),
    ("correctness", "The code does not do what it means to."),
    ("reliability", "A failure waiting to happen: panics, unchecked errors, leaks."),
    ("performance", "Needless work or resources."),
    ("maintainability", "Harder to read or change than it needs to be; leftover notes and debug output."),
    ("style", "Formatting and naming."),
];

/// The message a reader sees: the title, the explanation, and what to do.
fn message_text(f: &Finding) -> String {
    let mut text = format!("{}: {}", f.title, f.message);
    if let Some(action) = &f.suggested_action {
        text.push_str("\n\nSuggested action: ");
        text.push_str(action);
    }
    text
}
