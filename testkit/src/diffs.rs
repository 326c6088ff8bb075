//! Diffs the tests and scenarios submit.

/// `files` new files of `lines` added lines each (about 56 bytes a line); `salt` makes
/// the content (and so the review) distinct.
pub fn large_salted(files: usize, lines: usize, salt: &str) -> String {
    let mut out = String::new();
    for f in 0..files {
        let path = format!("src/module_{f:02}.rs");
        out.push_str(&format!(
            "diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{lines} @@\n"
        ));
        for i in 0..lines {
            out.push_str(&format!("+    let value_{i:04} = compute_{f:02}({i}, \"padding for size{salt}\");\n"));
        }
    }
    out
}

/// `files` new files of `lines` added lines each (about 56 bytes a line).
pub fn large(files: usize, lines: usize) -> String {
    large_salted(files, lines, "")
}
