//! Terminal colours in a pasted diff (`git diff --color=always`): whether git coloured
//! the diff, and git's codes taken out again.
//!
//! Only a diff git coloured loses codes: one where a line from the first file header on
//! begins with a colour code. Every line of a plain diff begins with a marker or a
//! header word, so a plain diff is never changed, whatever escape codes its lines hold
//! (test data for coloured output, say): those are the files' own.
//!
//! In a coloured diff, header lines lose every code (git quotes control characters in
//! names, so their codes are all git's). A hunk header loses git's codes around
//! `@@ ... @@` and the blank after it; the function name git appends keeps its own
//! text, less git's final reset. A line of a hunk loses git's markup only, read by the
//! shape git writes (`diff.c` `emit_line_0`, `ws.c` `ws_check_emit`):
//!
//! - `<set>±<reset>`, then the text: whitespace at its start plain or marked as an error
//!   (`<ws> <reset>`), the rest `<set>text<reset>`, trailing whitespace marked
//!   (`<ws>  <reset>`) — lines git checks whitespace on (added lines by default);
//! - `<set>±text<reset>` — the others (removed and context lines by default).
//!
//! The text between git's codes is kept byte for byte, the file's own codes with it. A
//! line that fits neither shape keeps all but git's codes at its two ends.

/// Git's reset (`GIT_COLOR_RESET`).
const RESET: &[u8] = b"\x1b[m";

/// A diff pasted from a terminal without git's colours; `None` when git did not colour
/// it (see the module's header). Works on bytes, so a `diff_bytes` diff that is not
/// UTF-8 is cleaned alike.
pub fn strip_colours(input: &[u8]) -> Option<Vec<u8>> {
    if !coloured_by_git(input) {
        return None;
    }
    let bare = context_checked(input);
    let mut out = Vec::with_capacity(input.len());
    for (k, line) in input.split(|b| *b == b'\n').enumerate() {
        if k > 0 {
            out.push(b'\n');
        }
        strip_line(line, bare, &mut out);
    }
    Some(out)
}

/// The lines from the first file header on.
fn diff_lines(input: &[u8]) -> impl Iterator<Item = &[u8]> {
    input.split(|b| *b == b'\n').skip_while(|l| {
        let t = skip_sgrs(l);
        !(t.starts_with(b"diff ") || t.starts_with(b"--- "))
    })
}

/// Whether a line from the first file header on begins with a colour code.
fn coloured_by_git(input: &[u8]) -> bool {
    diff_lines(input).any(|l| sgr_len(l).is_some())
}

/// Whether git checked whitespace on context lines (`--ws-error-highlight=context`,
/// `all`), which have no colour of their own by default: then each begins `␣<reset>`.
fn context_checked(input: &[u8]) -> bool {
    let mut context = diff_lines(input).filter(|l| l.starts_with(b" ") && l.len() > 1 + RESET.len()).peekable();
    context.peek().is_some() && context.all(|l| l[1..].starts_with(RESET))
}

/// Length of the SGR sequence (`ESC [ params m`) at the start of `s`.
fn sgr_len(s: &[u8]) -> Option<usize> {
    let rest = s.strip_prefix(b"\x1b[")?;
    let params = rest.iter().take_while(|b| b.is_ascii_digit() || **b == b';' || **b == b':').count();
    (rest.get(params) == Some(&b'm')).then_some(params + 3)
}

/// `s` after the SGR sequences at its start.
fn skip_sgrs(mut s: &[u8]) -> &[u8] {
    while let Some(n) = sgr_len(s) {
        s = &s[n..];
    }
    s
}

/// Where the SGR sequence that ends `s` starts, if one does.
fn sgr_ending(s: &[u8]) -> Option<usize> {
    let start = s.iter().rposition(|b| *b == 0x1b)?;
    (sgr_len(&s[start..]) == Some(s.len() - start)).then_some(start)
}

/// `bare`: a line whose marker has no colour may still have been whitespace-checked
/// (see [`context_checked`]).
fn strip_line(line: &[u8], bare: bool, out: &mut Vec<u8>) {
    // Git writes a line's carriage return after its reset.
    let (body, cr) = match line.strip_suffix(b"\r") {
        Some(body) => (body, true),
        None => (line, false),
    };
    let text = skip_sgrs(body);
    let set = &body[..body.len() - text.len()];
    match text.first() {
        Some(&sign @ (b'+' | b'-' | b' ')) => {
            out.push(sign);
            marker_line(set, bare, &text[1..], out);
        }
        Some(b'@') => hunk_header(body, out),
        _ => strip_all(body, out),
    }
    if cr {
        out.push(b'\r');
    }
}

/// The text of a line after its marker (`rest`), which git began with `set`.
fn marker_line(set: &[u8], bare: bool, rest: &[u8], out: &mut Vec<u8>) {
    if (bare || !set.is_empty())
        && let Some(text) = rest.strip_prefix(RESET).and_then(|r| checked_text(r, set.is_empty()))
    {
        out.extend_from_slice(&text);
        return;
    }
    // `<set>±text<reset>`.
    out.extend_from_slice(rest.strip_suffix(RESET).unwrap_or(rest));
}

/// The text of a line git wrote through its whitespace check; `None` when `s` is not of
/// that shape. `bare`: the line's colour is empty, so its text has no code before it.
fn checked_text(s: &[u8], bare: bool) -> Option<Vec<u8>> {
    let is_blank = |b: &u8| matches!(b, b' ' | b'\t' | b'\r');
    // Trailing whitespace marked as an error: `<ws>  <reset>` at the end.
    let (mut s, tail) = match s.strip_suffix(RESET) {
        Some(body) => {
            let blanks = body.iter().rev().take_while(|b| is_blank(b)).count();
            match sgr_ending(&body[..body.len() - blanks]) {
                Some(start) if blanks > 0 => (&body[..start], &body[body.len() - blanks..]),
                _ => (s, &[][..]),
            }
        }
        None => (s, &[][..]),
    };
    let mut out = Vec::with_capacity(s.len());
    while let Some(&b) = s.first() {
        if is_blank(&b) {
            out.push(b);
            s = &s[1..];
            continue;
        }
        let code = sgr_len(s);
        let after = &s[code.unwrap_or(0)..];
        let blanks = after.iter().take_while(|b| is_blank(b)).count();
        match after[blanks..].strip_prefix(RESET) {
            // Leading whitespace marked as an error.
            Some(rest) if code.is_some() && blanks > 0 => {
                out.extend_from_slice(&after[..blanks]);
                s = rest;
            }
            // `<set>text<reset>` to the end.
            _ => {
                let text = if bare { s } else { code.map(|_| after)? };
                out.extend_from_slice(text.strip_suffix(RESET)?);
                s = &[];
            }
        }
    }
    out.extend_from_slice(tail);
    Some(out)
}

/// `<frag>@@ -a,b +c,d @@<reset>`, then the blank `<context> <reset>` and the function
/// name `<func>name<reset>` when git found one.
fn hunk_header(body: &[u8], out: &mut Vec<u8>) {
    let text = skip_sgrs(body);
    let close = text.get(2..).and_then(|t| t.windows(2).position(|w| w == b"@@")).map(|p| p + 4);
    let Some(rest) = close.and_then(|c| text[c..].strip_prefix(RESET)) else {
        return strip_all(body, out);
    };
    out.extend_from_slice(&text[..close.unwrap_or_default()]);
    let after = &rest[sgr_len(rest).unwrap_or(0)..];
    let blanks = after.iter().take_while(|b| matches!(b, b' ' | b'\t')).count();
    let rest = match after[blanks..].strip_prefix(RESET) {
        Some(name) if blanks > 0 => {
            out.extend_from_slice(&after[..blanks]);
            name
        }
        _ => rest,
    };
    out.extend_from_slice(rest.strip_suffix(RESET).unwrap_or(rest));
}

/// Every SGR and erase-line (`ESC [ K`) sequence removed.
fn strip_all(line: &[u8], out: &mut Vec<u8>) {
    let mut k = 0;
    while k < line.len() {
        if line[k] == 0x1b && line.get(k + 1) == Some(&b'[') {
            let params = line[k + 2..].iter().take_while(|b| b.is_ascii_digit() || **b == b';' || **b == b':').count();
            if let Some(b'm' | b'K') = line.get(k + 2 + params) {
                k += 3 + params;
                continue;
            }
        }
        out.push(line[k]);
        k += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Escape codes of a file, as ripgrep's tests of coloured output hold them.
    const RG: &str = "\x1b[0m1\x1b[0m:\x1b[0m\x1b[31mSherlock\x1b[0m";

    fn strip(s: &str) -> Option<String> {
        strip_colours(s.as_bytes()).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn a_plain_diff_is_never_changed() {
        let plain =
            format!("diff --git a/t.txt b/t.txt\n--- a/t.txt\n+++ b/t.txt\n@@ -1,2 +1,2 @@\n {RG}\n-old\n+{RG}\n");
        assert_eq!(strip(&plain), None);
        // A commit message before the first header is not the diff: its codes decide
        // nothing.
        assert_eq!(strip(&format!("\x1b[31mred\x1b[m subject\n\n{plain}")), None);
        assert_eq!(strip("no diff at all \x1b[1m\n"), None);
    }

    #[test]
    fn gits_markup_goes_and_the_files_codes_stay() {
        let g = "\x1b[32m";
        let r = "\x1b[31m";
        let ws = "\x1b[41m";
        let m = "\x1b[m";
        let coloured = [
            format!("\x1b[1mdiff --git a/t.txt b/t.txt{m}"),
            format!("\x1b[1m--- a/t.txt{m}"),
            format!("\x1b[1m+++ b/t.txt{m}"),
            format!("\x1b[36m@@ -1,3 +1,6 @@{m} {m}fn {r}main{m}() {{{m}"),
            format!(" {RG}{m}"),
            format!("{r}-{RG}{m}"),
            format!("{g}+{m}{g}{RG}{m}"),
            format!("{g}+{m}\t{g}x {RG}{m}{ws}  {m}"),
            format!("{g}+{m}{ws} {m}\t{g}{m}y{m}"),
            format!("{g}+{m}{g}cr{m}{ws}\r{m}"),
            format!("{g}+{m}"),
        ]
        .join("\n");
        let plain = [
            "diff --git a/t.txt b/t.txt".to_string(),
            "--- a/t.txt".into(),
            "+++ b/t.txt".into(),
            format!("@@ -1,3 +1,6 @@ fn {r}main{m}() {{"),
            format!(" {RG}"),
            format!("-{RG}"),
            format!("+{RG}"),
            format!("+\tx {RG}  "),
            format!("+ \t{m}y"),
            "+cr\r".into(),
            "+".into(),
        ]
        .join("\n");
        assert_eq!(strip(&coloured).as_deref(), Some(plain.as_str()));
    }

    #[test]
    fn lines_without_whitespace_checks_and_odd_lines() {
        let m = "\x1b[m";
        // `--ws-error-highlight=none`: an added line as `<set>+text<reset>`, its text
        // starting with the file's own reset.
        let coloured =
            format!("\x1b[1m--- a/x{m}\n\x1b[1m+++ b/x{m}\n\x1b[32m+{m}text{m}\r\n\x1b[32m+\x1b[1mb{m}{m}\n");
        assert_eq!(strip(&coloured).as_deref(), Some(format!("--- a/x\n+++ b/x\n+{m}text\r\n+\x1b[1mb{m}\n").as_str()));
        // A line of no known shape loses every code; an erase-line code goes too.
        assert_eq!(
            strip(&format!("\x1b[1mdiff --git a/x b/x{m}\n\x1b[33m@ odd\x1b[K{m}\n")).unwrap(),
            "diff --git a/x b/x\n@ odd\n"
        );
    }
}
