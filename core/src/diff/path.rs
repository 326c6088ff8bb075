//! The one string form of a file name of a diff, everywhere past the parser: findings,
//! deliveries, the API, rdjson.
//!
//! Git's file names are bytes. A name that is UTF-8 is itself (`src/über.rs`); any other
//! (a Latin-1 `l\xe9gacy.txt`) is git's own C-quoted form with its quotes,
//! `"l\351gacy.txt"`, as `git diff` prints it by default (`core.quotePath`). A UTF-8
//! name that begins with `"` is quoted too, so the form is lossless: each string reads
//! back to one name ([`to_bytes`]). SARIF percent-encodes those bytes.

use std::borrow::Cow;

/// The string form of the name `name`.
pub fn from_bytes(name: &[u8]) -> String {
    match std::str::from_utf8(name) {
        Ok(s) if !s.starts_with('"') => s.to_string(),
        _ => quote(name),
    }
}

/// The name a string form stands for. A string that is not one (a quote that does not
/// read back, say) stands for its own UTF-8 bytes.
pub fn to_bytes(path: &str) -> Cow<'_, [u8]> {
    match unquote(path.as_bytes()) {
        Some((bytes, [])) => Cow::Owned(bytes),
        _ => Cow::Borrowed(path.as_bytes()),
    }
}

/// The name as text to show a reader, with replacement characters for bytes that are no
/// UTF-8 (`l\u{fffd}gacy.txt`): what a diff sent as bytes looks like decoded.
pub fn display(path: &str) -> Cow<'_, str> {
    match to_bytes(path) {
        Cow::Borrowed(_) => Cow::Borrowed(path),
        Cow::Owned(bytes) => Cow::Owned(String::from_utf8_lossy(&bytes).into_owned()),
    }
}

/// The name as UTF-8 text, when it is UTF-8 (what an API that takes names as text, such
/// as GitHub's, can be given).
pub fn utf8(path: &str) -> Option<Cow<'_, str>> {
    match to_bytes(path) {
        Cow::Borrowed(_) => Some(Cow::Borrowed(path)),
        Cow::Owned(bytes) => String::from_utf8(bytes).ok().map(Cow::Owned),
    }
}

/// Whether `git diff` would quote the name: a quote, a backslash, a control byte, or
/// bytes that are no UTF-8 (UTF-8 beyond ASCII is left as it is, as with
/// `core.quotePath=false`, so a reader sees `über.rs`).
pub fn needs_quotes(name: &[u8]) -> bool {
    name.iter().any(|&b| b == b'"' || b == b'\\' || b < 0x20 || b == 0x7f) || std::str::from_utf8(name).is_err()
}

/// `name` C-quoted as git quotes it by default: in quotes, `\"`, `\\`, `\t`, `\n` and the
/// other C escapes, and every other control byte and every byte from 0x80 in octal.
pub fn quote(name: &[u8]) -> String {
    let mut q = String::with_capacity(name.len() + 2);
    q.push('"');
    for &b in name {
        match b {
            b'"' => q.push_str("\\\""),
            b'\\' => q.push_str("\\\\"),
            7 => q.push_str("\\a"),
            8 => q.push_str("\\b"),
            b'\t' => q.push_str("\\t"),
            b'\n' => q.push_str("\\n"),
            11 => q.push_str("\\v"),
            12 => q.push_str("\\f"),
            b'\r' => q.push_str("\\r"),
            b if !(0x20..0x7f).contains(&b) => q.push_str(&format!("\\{b:03o}")),
            b => q.push(char::from(b)),
        }
    }
    q.push('"');
    q
}

/// Git's C-style quoting read back: `"..."` with `\\`, `\"`, the C escapes and octal
/// bytes (`\303\274`). The name's bytes and what follows the closing quote; `None` when
/// `s` does not begin with a quote, or the quote is not closed or has a bad escape.
pub fn unquote(s: &[u8]) -> Option<(Vec<u8>, &[u8])> {
    let body = s.strip_prefix(b"\"")?;
    let mut out = Vec::new();
    let mut k = 0;
    while k < body.len() {
        match body[k] {
            b'"' => return Some((out, &body[k + 1..])),
            b'\\' => {
                let c = *body.get(k + 1)?;
                k += 2;
                match c {
                    b'0'..=b'7' => {
                        let digits = body.get(k - 1..k + 2)?;
                        if !digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                            return None;
                        }
                        let v = digits.iter().fold(0u32, |v, d| v * 8 + u32::from(d - b'0'));
                        out.push(u8::try_from(v).ok()?);
                        k += 2;
                    }
                    b'a' => out.push(7),
                    b'b' => out.push(8),
                    b't' => out.push(b'\t'),
                    b'n' => out.push(b'\n'),
                    b'v' => out.push(11),
                    b'f' => out.push(12),
                    b'r' => out.push(b'\r'),
                    b'"' | b'\\' => out.push(c),
                    _ => return None,
                }
            }
            b => {
                out.push(b);
                k += 1;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_names_are_themselves_and_others_are_quoted_as_git_quotes_them() {
        assert_eq!(from_bytes(b"src/\xc3\xbcber rs.rs"), "src/über rs.rs");
        assert_eq!(from_bytes(b"l\xe9gacy.txt"), "\"l\\351gacy.txt\"");
        assert_eq!(from_bytes(b"dir/\xff\tx\"y"), "\"dir/\\377\\tx\\\"y\"");
        // A UTF-8 name that begins with a quote is quoted, so it cannot be read as one.
        assert_eq!(from_bytes(b"\"l\\351gacy.txt\""), "\"\\\"l\\\\351gacy.txt\\\"\"");
    }

    #[test]
    fn every_name_reads_back_to_its_bytes() {
        let names: [&[u8]; 8] = [
            b"src/app.rs",
            b"l\xe9gacy.txt",
            b"\xff\xfe",
            b"\"quoted\"",
            b"\"l\\351gacy.txt\"",
            b"a\\b\x07\x08\t\n\x0b\x0c\r\x1b\x7f.txt",
            "caf\u{e9}/\u{fc}ber.rs".as_bytes(),
            b"",
        ];
        for name in names {
            let path = from_bytes(name);
            assert_eq!(&*to_bytes(&path), name, "{path}");
        }
        // Two different names never share a form.
        let forms: std::collections::HashSet<String> = names.iter().map(|n| from_bytes(n)).collect();
        assert_eq!(forms.len(), names.len());
    }

    #[test]
    fn display_and_utf8_forms() {
        assert_eq!(display("\"l\\351gacy.txt\""), "l\u{fffd}gacy.txt");
        assert_eq!(display("src/über.rs"), "src/über.rs");
        assert_eq!(display("\"\\\"x.rs\""), "\"x.rs");
        assert_eq!(utf8("\"l\\351gacy.txt\"").as_deref(), None);
        assert_eq!(utf8("\"\\\"x.rs\"").as_deref(), Some("\"x.rs"));
        assert_eq!(utf8("src/app.rs").as_deref(), Some("src/app.rs"));
        // Not a form this module writes: the string itself.
        assert_eq!(&*to_bytes("\"open"), b"\"open");
        assert_eq!(&*to_bytes("\"a\" b"), b"\"a\" b");
    }

    #[test]
    fn bad_quotes_are_refused() {
        for bad in [&b"\"open"[..], b"\"bad \\q escape\"", b"\"\\77\"", b"\"\\400\"", b"no quote"] {
            assert_eq!(unquote(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(unquote(b"\"a b\" rest"), Some((b"a b".to_vec(), &b" rest"[..])));
    }
}
