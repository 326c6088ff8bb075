//! Unified diff parser: the one reading of a diff that ingress validation, the built-in
//! analyzer and the semantic checks of findings all share.
//!
//! Errors carry line numbers and kinds only, never text of the diff, so they can be
//! returned to callers and logged.

mod colours;
pub mod path;

use std::borrow::Cow;

pub use colours::strip_colours;

/// A parsed unified diff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diff {
    pub files: Vec<FileDiff>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDiff {
    /// Path on the old side; `None` for an added file.
    pub old_path: Option<String>,
    /// Path on the new side; `None` for a deleted file.
    pub new_path: Option<String>,
    pub hunks: Vec<Hunk>,
    pub binary: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hunk {
    pub old_start: u32,
    pub old_len: u32,
    pub new_start: u32,
    pub new_len: u32,
    pub lines: Vec<HunkLine>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineKind {
    Context,
    Added,
    Removed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HunkLine {
    pub kind: LineKind,
    /// The line without its `+`/`-`/` ` marker.
    pub text: String,
    /// Line number on the new side (context and added lines).
    pub new_line: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiffError {
    #[error("diff is empty")]
    Empty,
    #[error("no file header (`diff --git` or `---`/`+++`) found")]
    NoFiles,
    #[error("line {line}: malformed hunk header")]
    MalformedHunkHeader { line: usize },
    #[error("line {line}: hunk header numbers out of range (start plus length overflows)")]
    HunkOutOfRange { line: usize },
    #[error("line {line}: hunk header appears before any `+++` file header")]
    HunkWithoutFile { line: usize },
    #[error("line {line}: `---` header not followed by `+++`")]
    MissingNewHeader { line: usize },
    #[error("line {line}: hunk ends early (header announced more lines than present)")]
    TruncatedHunk { line: usize },
    #[error("line {line}: unexpected line inside a hunk")]
    UnexpectedHunkLine { line: usize },
    #[error("file {file}: has neither hunks nor a rename, mode change or binary marker")]
    EmptyFile { file: usize },
    #[error("line {line}: path is absolute, has a `..` segment, or holds a control character")]
    UnsafePath { line: usize },
    #[error("line {line}: a quoted path is not closed or has a bad escape")]
    BadQuotedPath { line: usize },
    #[error(
        "file {file}: appears more than once (a patch series or `git log -p`); send one diff of the combined change"
    )]
    DuplicateFile { file: usize },
    #[error(
        "line {line}: a combined diff of a merge (`git show --cc`, `git diff --cc`: one column per parent); send a two-way diff instead, such as `git diff <first parent> <merge>`"
    )]
    CombinedDiff { line: usize },
    #[error(
        "line {line}: word-diff output (`--word-diff`) has no line markers; send a line diff (`git diff` without `--word-diff`)"
    )]
    WordDiff { line: usize },
}

impl Diff {
    /// The file whose new side has the name `name` (see [`Diff::file_named`]).
    pub fn file_by_new_path(&self, name: &str) -> Option<&FileDiff> {
        self.file_named(name, |f| f.new_path.as_deref())
    }

    /// The file whose old side is `name` (a deleted or renamed file by its old name).
    pub fn file_by_old_path(&self, name: &str) -> Option<&FileDiff> {
        self.file_named(name, |f| f.old_path.as_deref())
    }

    /// The file whose name on one side is `name`: in its string form (see [`path`]), or
    /// as a reader copies a name that is not UTF-8 from the diff — git's quoted form
    /// without the quotes (`l\351gacy.txt`, from a `diff --git` line), or decoded with
    /// replacement characters (`l\u{fffd}gacy.txt`, from a diff sent as bytes) when that
    /// fits one file only.
    fn file_named<'a>(&'a self, name: &str, side: impl Fn(&'a FileDiff) -> Option<&'a str>) -> Option<&'a FileDiff> {
        let exact = |n: &str| self.files.iter().find(|f| side(f) == Some(n));
        if let Some(f) = exact(name).or_else(|| exact(&format!("\"{name}\""))) {
            return Some(f);
        }
        let mut shown = self.files.iter().filter(|f| side(f).is_some_and(|p| p != name && path::display(p) == name));
        match (shown.next(), shown.next()) {
            (Some(f), None) => Some(f),
            _ => None,
        }
    }

    /// Added lines of the diff, in order: (file, hunk, line).
    pub fn added_lines(&self) -> impl Iterator<Item = (&FileDiff, &Hunk, &HunkLine)> {
        self.files.iter().flat_map(|f| {
            f.hunks
                .iter()
                .flat_map(move |h| h.lines.iter().filter(|l| l.kind == LineKind::Added).map(move |l| (f, h, l)))
        })
    }
}

impl FileDiff {
    /// The hunk whose new side covers `line`.
    pub fn hunk_for_new_line(&self, line: u32) -> Option<&Hunk> {
        self.hunks.iter().find(|h| h.covers_new_line(line))
    }

    pub fn hunk_for_old_line(&self, line: u32) -> Option<&Hunk> {
        self.hunks.iter().find(|h| h.covers_old_line(line))
    }
}

impl Hunk {
    pub fn covers_new_line(&self, line: u32) -> bool {
        self.lines.iter().any(|l| l.new_line == Some(line))
    }

    pub fn covers_old_line(&self, line: u32) -> bool {
        self.numbered().iter().any(|(l, old, _)| l.kind != LineKind::Added && *old == line)
    }

    /// Whether `needle` occurs in the old side of this hunk (context and removed lines).
    pub fn contains_old_side_text(&self, needle: &str) -> bool {
        Self::contains(self.lines.iter().filter(|l| l.kind != LineKind::Added), needle)
    }

    /// Whether `needle` occurs in the text of this hunk (either side, one line or
    /// across lines).
    pub fn contains_text(&self, needle: &str) -> bool {
        Self::contains(self.lines.iter(), needle)
    }

    /// Whether `needle` occurs in the new side of this hunk (context and added lines,
    /// one line or across lines): what a finding on a new-side line may quote.
    pub fn contains_new_side_text(&self, needle: &str) -> bool {
        Self::contains(self.lines.iter().filter(|l| l.kind != LineKind::Removed), needle)
    }

    fn contains<'a>(lines: impl Iterator<Item = &'a HunkLine> + Clone, needle: &str) -> bool {
        let needle = needle.trim();
        if needle.is_empty() {
            return false;
        }
        if lines.clone().any(|l| l.text.contains(needle)) {
            return true;
        }
        let joined: Vec<&str> = lines.map(|l| l.text.as_str()).collect();
        joined.join("\n").contains(needle)
    }
}

/// Whether a line that is not a hunk line is one of `--word-diff` output: the plain
/// form's `[-removed-]` / `{+added+}` marks, or the porcelain form's `~` line ends.
fn is_word_diff_line(line: &str) -> bool {
    line == "~" || (line.contains("{+") && line.contains("+}")) || (line.contains("[-") && line.contains("-]"))
}

/// Parses `git diff` style unified diffs. Text before the first file header (a commit
/// message from `git format-patch`, say) is ignored. A combined merge diff and
/// word-diff output are refused by name.
pub fn parse(input: &str) -> Result<Diff, DiffError> {
    parse_lines(input.as_bytes(), input)
}

/// [`parse`] of a diff as bytes (`diff_bytes`: files in a legacy encoding, names git
/// took as they are): the lines decoded with replacement characters, as the model is
/// shown them, and the file names exact (see [`path`]).
pub fn parse_bytes(input: &[u8]) -> Result<Diff, DiffError> {
    parse_lines(input, &String::from_utf8_lossy(input))
}

/// `text` is `raw` decoded: its lines for everything but file names, which are read
/// from the bytes (the same lines: a newline is never part of a replaced sequence).
fn parse_lines(raw: &[u8], input: &str) -> Result<Diff, DiffError> {
    if input.trim().is_empty() {
        return Err(DiffError::Empty);
    }
    let lines: Vec<&str> = input.split('\n').collect();
    let raw_lines: Vec<&[u8]> = raw.split(|b| *b == b'\n').collect();
    // Line `i` from byte `from` on, without its carriage return: where a name is read.
    let bytes = |i: usize, from: usize| -> &[u8] {
        let l = raw_lines[i];
        l.strip_suffix(b"\r").unwrap_or(l).get(from..).unwrap_or_default()
    };
    // A trailing newline leaves one empty element that is not a line.
    let n = if input.ends_with('\n') { lines.len() - 1 } else { lines.len() };
    let mut files: Vec<FileDiff> = Vec::new();
    // Whether the current file has header facts besides hunks (rename, mode, binary).
    let mut cur: Option<(FileDiff, bool)> = None;
    // The side prefixes the last `diff --git` line used (`a/`/`b/`, mnemonic, none).
    let mut prefixes = Prefixes::DEFAULT;
    let mut i = 0;
    let finish = |cur: &mut Option<(FileDiff, bool)>, files: &mut Vec<FileDiff>| -> Result<(), DiffError> {
        if let Some((f, has_meta)) = cur.take() {
            if f.hunks.is_empty() && !f.binary && !has_meta {
                return Err(DiffError::EmptyFile { file: files.len() + 1 });
            }
            files.push(f);
        }
        Ok(())
    };
    while i < n {
        let line = lines[i].strip_suffix('\r').unwrap_or(lines[i]);
        let lno = i + 1;
        if line.starts_with("diff --cc ") || line.starts_with("diff --combined ") || line.starts_with("@@@ ") {
            return Err(DiffError::CombinedDiff { line: lno });
        }
        if line.starts_with("diff --git ") {
            finish(&mut cur, &mut files)?;
            let (old, new, found) =
                split_git_paths(bytes(i, "diff --git ".len())).ok_or(DiffError::BadQuotedPath { line: lno })?;
            prefixes = found;
            let (old, new) = (checked(Some(old), lno)?, checked(Some(new), lno)?);
            cur = Some((FileDiff { old_path: old, new_path: new, hunks: Vec::new(), binary: false }, false));
            i += 1;
            continue;
        }
        if line.starts_with("--- ") && i + 1 < n && lines[i + 1].starts_with("+++ ") {
            let old = header_path(bytes(i, 4), &prefixes).ok_or(DiffError::BadQuotedPath { line: lno })?;
            let new = header_path(bytes(i + 1, 4), &prefixes).ok_or(DiffError::BadQuotedPath { line: lno + 1 })?;
            let (old, new) = (checked(old, lno)?, checked(new, lno + 1)?);
            match &mut cur {
                // `diff --git` (and its rename or copy lines, unprefixed) already named
                // the file; the ---/+++ pair adds only which side is /dev/null (an added
                // or deleted file).
                Some((f, _)) if f.hunks.is_empty() => {
                    if old.is_none() {
                        f.old_path = None;
                    }
                    if new.is_none() {
                        f.new_path = None;
                    }
                }
                _ => {
                    finish(&mut cur, &mut files)?;
                    cur = Some((FileDiff { old_path: old, new_path: new, hunks: Vec::new(), binary: false }, false));
                }
            }
            i += 2;
            continue;
        }
        if line.starts_with("--- ") && cur.as_ref().is_some_and(|(f, _)| f.hunks.is_empty()) {
            return Err(DiffError::MissingNewHeader { line: lno });
        }
        if line.starts_with("@@") {
            let Some((file, _)) = cur.as_mut() else {
                return Err(DiffError::HunkWithoutFile { line: lno });
            };
            let (old_start, old_len, new_start, new_len) =
                parse_hunk_header(line).ok_or(DiffError::MalformedHunkHeader { line: lno })?;
            // Every line number of the hunk must fit: start + length, on both sides.
            if old_start.checked_add(old_len).is_none() || new_start.checked_add(new_len).is_none() {
                return Err(DiffError::HunkOutOfRange { line: lno });
            }
            let mut hunk = Hunk { old_start, old_len, new_start, new_len, lines: Vec::new() };
            let (mut old_left, mut new_left) = (old_len, new_len);
            let mut new_no = new_start;
            i += 1;
            while old_left > 0 || new_left > 0 {
                if i >= n {
                    return Err(DiffError::TruncatedHunk { line: i });
                }
                let l = lines[i].strip_suffix('\r').unwrap_or(lines[i]);
                let (kind, text) = match l.as_bytes().first() {
                    Some(b'+') => (LineKind::Added, &l[1..]),
                    Some(b'-') => (LineKind::Removed, &l[1..]),
                    Some(b' ') => (LineKind::Context, &l[1..]),
                    // Some tools strip the space of an empty context line.
                    None => (LineKind::Context, ""),
                    Some(b'\\') => {
                        i += 1;
                        continue;
                    }
                    // Word-diff output: its context lines have no marker either, so
                    // look for its marks in what follows.
                    Some(_) if lines[i..n.min(i + 200)].iter().any(|l| is_word_diff_line(l)) => {
                        return Err(DiffError::WordDiff { line: i + 1 });
                    }
                    Some(_) => return Err(DiffError::UnexpectedHunkLine { line: i + 1 }),
                };
                let new_line = match kind {
                    LineKind::Removed => {
                        if old_left == 0 {
                            return Err(DiffError::UnexpectedHunkLine { line: i + 1 });
                        }
                        old_left -= 1;
                        None
                    }
                    LineKind::Added => {
                        if new_left == 0 {
                            return Err(DiffError::UnexpectedHunkLine { line: i + 1 });
                        }
                        new_left -= 1;
                        new_no = new_no.checked_add(1).ok_or(DiffError::HunkOutOfRange { line: lno })?;
                        Some(new_no - 1)
                    }
                    LineKind::Context => {
                        if old_left == 0 || new_left == 0 {
                            return Err(DiffError::UnexpectedHunkLine { line: i + 1 });
                        }
                        old_left -= 1;
                        new_left -= 1;
                        new_no = new_no.checked_add(1).ok_or(DiffError::HunkOutOfRange { line: lno })?;
                        Some(new_no - 1)
                    }
                };
                hunk.lines.push(HunkLine { kind, text: text.to_string(), new_line });
                i += 1;
            }
            // "\ No newline at end of file" right after the last line.
            if i < n && lines[i].starts_with('\\') {
                i += 1;
            }
            file.hunks.push(hunk);
            continue;
        }
        if let Some((file, has_meta)) = cur.as_mut()
            && file.hunks.is_empty()
        {
            // Extended header lines of `git diff`, between `diff --git` and the first hunk.
            if line.starts_with("Binary files ") || line.starts_with("GIT binary patch") {
                file.binary = true;
            } else if line.starts_with("new file mode ") {
                file.old_path = None;
                *has_meta = true;
            } else if line.starts_with("deleted file mode ") {
                file.new_path = None;
                *has_meta = true;
            } else if let Some(k) = ["rename from ", "copy from "].iter().find(|p| line.starts_with(**p)) {
                // Unprefixed, possibly quoted, and unambiguous where the `diff --git` line
                // with spaces in both names is not.
                let name = header_name(bytes(i, k.len())).ok_or(DiffError::BadQuotedPath { line: lno })?;
                file.old_path = checked(Some(name), lno)?;
                *has_meta = true;
            } else if let Some(k) = ["rename to ", "copy to "].iter().find(|p| line.starts_with(**p)) {
                let name = header_name(bytes(i, k.len())).ok_or(DiffError::BadQuotedPath { line: lno })?;
                file.new_path = checked(Some(name), lno)?;
                *has_meta = true;
            } else if ["old mode ", "new mode ", "similarity index ", "dissimilarity index "]
                .iter()
                .any(|p| line.starts_with(p))
            {
                *has_meta = true;
            }
        }
        i += 1;
    }
    finish(&mut cur, &mut files)?;
    if files.is_empty() {
        return Err(DiffError::NoFiles);
    }
    let files = join_type_changes(files);
    // One file once: findings are validated against one version of each file.
    let mut seen = std::collections::HashSet::new();
    for (k, f) in files.iter().enumerate() {
        if let Some(p) = f.new_path.as_ref().or(f.old_path.as_ref())
            && !seen.insert(p.as_str())
        {
            return Err(DiffError::DuplicateFile { file: k + 1 });
        }
    }
    Ok(Diff { files })
}

/// A type change (a file becoming a symlink, say) is one change that git prints as two
/// entries for one path: the old one deleted, then the new one added. They become one
/// file, as `git diff --name-status` counts it (`T`): the removed lines and the added.
fn join_type_changes(files: Vec<FileDiff>) -> Vec<FileDiff> {
    let mut out: Vec<FileDiff> = Vec::with_capacity(files.len());
    for f in files {
        if let Some(prev) = out.last_mut()
            && prev.new_path.is_none()
            && f.old_path.is_none()
            && prev.old_path.is_some()
            && prev.old_path == f.new_path
        {
            prev.new_path = f.new_path;
            prev.binary |= f.binary;
            prev.hunks.extend(f.hunks);
            continue;
        }
        out.push(f);
    }
    out
}

/// The side prefixes of a `diff --git` line: `a/` and `b/` by default, `c/`, `i/`,
/// `w/`, `o/` with `diff.mnemonicPrefix`, none with `--no-prefix`, or custom ones
/// (`--src-prefix`/`--dst-prefix`, `diff.srcPrefix`/`diff.dstPrefix`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Prefixes {
    old: Cow<'static, [u8]>,
    new: Cow<'static, [u8]>,
}

impl Prefixes {
    const DEFAULT: Prefixes = Prefixes { old: Cow::Borrowed(b"a/"), new: Cow::Borrowed(b"b/") };
    const OLD: [&'static [u8]; 4] = [b"a/", b"c/", b"i/", b"o/"];
    const NEW: [&'static [u8]; 4] = [b"b/", b"i/", b"w/", b"c/"];
    const NONE: Prefixes = Prefixes { old: Cow::Borrowed(b""), new: Cow::Borrowed(b"") };
}

/// Old and new name of a `diff --git` line, each possibly C-quoted, and the prefixes it
/// used. Unquoted names with spaces are split where both halves name the same file.
fn split_git_paths(rest: &[u8]) -> Option<(Vec<u8>, Vec<u8>, Prefixes)> {
    let (left, right) = if rest.starts_with(b"\"") {
        let (l, after) = path::unquote(rest)?;
        let after = after.strip_prefix(b" ")?;
        let r = if after.starts_with(b"\"") { path::unquote(after)?.0 } else { after.to_vec() };
        (l, r)
    } else if let Some(q) = rest.windows(2).position(|w| w == b" \"") {
        (rest[..q].to_vec(), path::unquote(&rest[q + 1..])?.0)
    } else {
        // `a/x y b/x y`: the split whose halves are the same path; else the first space.
        let spaces: Vec<usize> = (0..rest.len()).filter(|&k| rest[k] == b' ').collect();
        let (l, r) = (|k: usize| &rest[..k], |k: usize| &rest[k + 1..]);
        let k = spaces
            .iter()
            .copied()
            .find(|&k| unprefixed(l(k)).0 == unprefixed(r(k)).0)
            .or_else(|| spaces.iter().copied().find(|&k| custom_prefixes(l(k), r(k)).is_some()))
            .or(spaces.first().copied())?;
        (rest[..k].to_vec(), rest[k + 1..].to_vec())
    };
    let (old, old_prefix) = unprefixed(&left);
    let (new, new_prefix) = unprefixed(&right);
    let (old, new, prefixes) = match (old_prefix, new_prefix) {
        (Some(o), Some(n)) => (old.to_vec(), new.to_vec(), Prefixes { old: o.into(), new: n.into() }),
        _ => match custom_prefixes(&left, &right) {
            Some((o, n)) => {
                let (old, new) = (left[o.len()..].to_vec(), right[n.len()..].to_vec());
                (old, new, Prefixes { old: o.into(), new: n.into() })
            }
            // `--no-prefix`: names as they are.
            None => (left, right, Prefixes::NONE),
        },
    };
    Some((old, new, prefixes))
}

/// Custom side prefixes, as git reads a `diff --git` line: the two names are different
/// leading directories before the same path (`old/src/app.rs new/src/app.rs`). The
/// longest such path wins; the prefixes each end in `/`. `None` when the names are the
/// same (`--no-prefix`) or share no path after a `/` in both.
fn custom_prefixes(left: &[u8], right: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    (0..left.len()).filter(|&k| left[k] == b'/').map(|k| k + 1).find_map(|k| {
        let suffix = &left[k..];
        let n = right.len().checked_sub(suffix.len())?;
        let (l, r) = (&left[..k], &right[..n]);
        (!suffix.is_empty() && right.ends_with(suffix) && r.ends_with(b"/") && l != r).then(|| (l.to_vec(), r.to_vec()))
    })
}

/// `name` without a side prefix git writes, and which one.
fn unprefixed(name: &[u8]) -> (&[u8], Option<&'static [u8]>) {
    for p in Prefixes::OLD.iter().chain(Prefixes::NEW.iter()) {
        if let Some(rest) = name.strip_prefix(*p) {
            return (rest, Some(p));
        }
    }
    (name, None)
}

/// A `---`/`+++` name: `/dev/null` is none; a quoted name is unquoted; a trailing tab
/// and timestamp are dropped; the side's prefix is removed. `None` outside: bad quoting.
fn header_path(raw: &[u8], prefixes: &Prefixes) -> Option<Option<Vec<u8>>> {
    let p = if raw.starts_with(b"\"") {
        path::unquote(raw)?.0
    } else {
        // Drop a trailing tab and timestamp (`--- a/x\t2024-01-01 ...`).
        let name = raw.split(|b| *b == b'\t').next().unwrap_or(raw);
        name.trim_ascii_end().to_vec()
    };
    if p == b"/dev/null" {
        return Some(None);
    }
    let stripped = [&prefixes.old, &prefixes.new]
        .into_iter()
        .find_map(|pre| p.strip_prefix(&pre[..]).filter(|_| !pre.is_empty()))
        .unwrap_or(&p);
    Some(Some(stripped.to_vec()))
}

/// A name on a `rename from`/`copy to` line: as it is, or C-quoted.
fn header_name(raw: &[u8]) -> Option<Vec<u8>> {
    if raw.starts_with(b"\"") { path::unquote(raw).map(|(p, _)| p) } else { Some(raw.to_vec()) }
}

/// Refuses names a finding could use to point outside the repository, or that carry
/// control characters (a tab, which git allows in names, excepted); the rest in their
/// string form (see [`path`]).
fn checked(name: Option<Vec<u8>>, line: usize) -> Result<Option<String>, DiffError> {
    let Some(name) = name else { return Ok(None) };
    let text = String::from_utf8_lossy(&name);
    if text.starts_with('/')
        || text.split('/').any(|seg| seg == "..")
        || text.chars().any(|c| c.is_control() && c != '\t')
    {
        return Err(DiffError::UnsafePath { line });
    }
    Ok(Some(path::from_bytes(&name)))
}

/// The diff with at most `context` unchanged lines around each change, hunks split where
/// the unchanged run between changes is longer than twice that: what a review at
/// degraded depth shows the model. Line numbers stay those of the original, so findings
/// on it validate against the original; files without hunks (binary, mode or rename
/// only) are left out.
pub fn changed_lines_only(diff: &Diff, context: usize) -> String {
    let mut out = String::new();
    for f in diff.files.iter().filter(|f| !f.hunks.is_empty()) {
        out.push_str(&f.header());
        for h in &f.hunks {
            let numbered = h.numbered();
            // Keep changed lines and `context` lines either side of each.
            // Distance to the nearest changed line, in two linear passes.
            let n = numbered.len();
            let mut near = vec![usize::MAX; n];
            let mut last = None;
            for (i, (l, _, _)) in numbered.iter().enumerate() {
                if l.kind != LineKind::Context {
                    last = Some(i);
                }
                near[i] = last.map_or(usize::MAX, |c| i - c);
            }
            let mut next = None;
            for i in (0..n).rev() {
                if numbered[i].0.kind != LineKind::Context {
                    next = Some(i);
                }
                near[i] = near[i].min(next.map_or(usize::MAX, |c| c - i));
            }
            let keep = |i: usize| near[i] <= context;
            let mut i = 0;
            while i < numbered.len() {
                if !keep(i) {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < numbered.len() && keep(i) {
                    i += 1;
                }
                out.push_str(&render_run(&numbered[start..i]));
            }
        }
    }
    out
}

impl FileDiff {
    /// The file's `diff --git` and `---`/`+++` lines, names quoted as git quotes them.
    pub fn header(&self) -> String {
        let old = self.old_path.as_deref().map(|p| side_name("a/", p));
        let new = self.new_path.as_deref().map(|p| side_name("b/", p));
        let either = old.clone().or(new.clone()).unwrap_or_default();
        format!(
            "diff --git {} {}\n--- {}\n+++ {}\n",
            old.as_deref().unwrap_or(&either),
            new.as_deref().unwrap_or(&either),
            old.as_deref().unwrap_or("/dev/null"),
            new.as_deref().unwrap_or("/dev/null"),
        )
    }
}

impl Hunk {
    /// Each line with its old- and new-side numbers.
    pub fn numbered(&self) -> Vec<(&HunkLine, u32, u32)> {
        let (mut o, mut n) = (self.old_start, self.new_start);
        self.lines
            .iter()
            .map(|l| {
                let at = (l, o, n);
                match l.kind {
                    LineKind::Context => (o, n) = (o.saturating_add(1), n.saturating_add(1)),
                    LineKind::Added => n = n.saturating_add(1),
                    LineKind::Removed => o = o.saturating_add(1),
                }
                at
            })
            .collect()
    }
}

/// A run of numbered lines (see `Hunk::numbered`) as one hunk, with its header.
pub fn render_run(run: &[(&HunkLine, u32, u32)]) -> String {
    let old_len = run.iter().filter(|(l, _, _)| l.kind != LineKind::Added).count();
    let new_len = run.iter().filter(|(l, _, _)| l.kind != LineKind::Removed).count();
    let (_, old_start, new_start) = run[0];
    let mut out = format!("@@ -{old_start},{old_len} +{new_start},{new_len} @@\n");
    for (l, _, _) in run {
        out.push(match l.kind {
            LineKind::Context => ' ',
            LineKind::Added => '+',
            LineKind::Removed => '-',
        });
        out.push_str(&l.text);
        out.push('\n');
    }
    out
}

/// A name with its side prefix as `git diff` writes it: C-quoted when it holds a quote,
/// a backslash or a control character, or is not UTF-8.
fn side_name(prefix: &str, name: &str) -> String {
    let bytes = [prefix.as_bytes(), &path::to_bytes(name)].concat();
    if path::needs_quotes(&bytes) { path::quote(&bytes) } else { format!("{prefix}{name}") }
}

/// `@@ -a[,b] +c[,d] @@ ...`
fn parse_hunk_header(line: &str) -> Option<(u32, u32, u32, u32)> {
    let rest = line.strip_prefix("@@ -")?;
    let end = rest.find(" @@")?;
    let mut sides = rest[..end].split(" +");
    let old = sides.next()?;
    let new = sides.next()?;
    if sides.next().is_some() {
        return None;
    }
    let range = |s: &str| -> Option<(u32, u32)> {
        match s.split_once(',') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => Some((s.parse().ok()?, 1)),
        }
    };
    let (a, b) = range(old)?;
    let (c, d) = range(new)?;
    Some((a, b, c, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_lines_only_keeps_the_numbers_and_drops_the_rest() {
        let ctx: String = (1..=50).map(|i| format!(" keep {i}\n")).collect();
        let d = format!(
            "diff --git a/src/x y.rs b/src/x y.rs\n--- a/src/x y.rs\n+++ b/src/x y.rs\n@@ -1,101 +1,101 @@\n{ctx}-old\n+new\n{ctx}"
        );
        let full = parse(&d).unwrap();
        let small = changed_lines_only(&full, 1);
        let trimmed = parse(&small).unwrap_or_else(|e| panic!("{e}\n{small}"));
        assert!(small.len() * 4 < d.len(), "{small}");
        let f = &trimmed.files[0];
        assert_eq!(f.new_path.as_deref(), Some("src/x y.rs"));
        assert_eq!((f.hunks[0].old_start, f.hunks[0].new_start, f.hunks[0].lines.len()), (50, 50, 4));
        // The added line keeps its number.
        let (_, _, added) = trimmed.added_lines().next().unwrap();
        assert_eq!(added.new_line, full.added_lines().next().unwrap().2.new_line);
        // Two changes far apart: two hunks.
        let d2 = format!("--- a/y\n+++ b/y\n@@ -1,102 +1,102 @@\n-a\n+b\n{ctx}{ctx}-c\n+d\n");
        let two = parse(&changed_lines_only(&parse(&d2).unwrap(), 1)).unwrap();
        assert_eq!(two.files[0].hunks.len(), 2);
        assert_eq!(two.files[0].hunks[1].new_start, 101);
    }

    const SAMPLE: &str = "diff --git a/src/lib.rs b/src/lib.rs
index 1111111..2222222 100644
--- a/src/lib.rs
+++ b/src/lib.rs
@@ -1,3 +1,4 @@
 fn a() {}
-fn b() {}
+fn b() { x.unwrap(); }
+fn c() {}
 fn d() {}
@@ -10,2 +11,2 @@ impl X {
-    old();
+    new();
     tail();
diff --git a/new.py b/new.py
new file mode 100644
--- /dev/null
+++ b/new.py
@@ -0,0 +1,2 @@
+print('x')
+eval(y)
";

    #[test]
    fn parses_files_hunks_and_new_line_numbers() {
        let d = parse(SAMPLE).unwrap();
        assert_eq!(d.files.len(), 2);
        let f = &d.files[0];
        assert_eq!(f.new_path.as_deref(), Some("src/lib.rs"));
        assert_eq!(f.hunks.len(), 2);
        let added: Vec<_> = f.hunks[0].lines.iter().filter(|l| l.kind == LineKind::Added).collect();
        assert_eq!(added[0].new_line, Some(2));
        assert_eq!(added[1].new_line, Some(3));
        assert_eq!(f.hunks[1].lines[1].new_line, Some(11));
        assert_eq!(f.hunks[1].lines[2].new_line, Some(12));
        let g = &d.files[1];
        assert_eq!(g.old_path, None);
        assert_eq!(g.new_path.as_deref(), Some("new.py"));
        assert_eq!(d.added_lines().count(), 5);
    }

    #[test]
    fn hunk_coverage_and_evidence() {
        let d = parse(SAMPLE).unwrap();
        let f = d.file_by_new_path("src/lib.rs").unwrap();
        assert!(f.hunk_for_new_line(2).is_some());
        assert!(f.hunk_for_new_line(4).is_some()); // context line `fn d`
        assert!(f.hunk_for_new_line(7).is_none()); // between hunks
        let h = f.hunk_for_new_line(2).unwrap();
        assert!(h.contains_text("x.unwrap()"));
        assert!(!h.contains_text("new();"));
        assert!(!h.contains_text("   "));
        assert!(d.file_by_new_path("src/other.rs").is_none());
    }

    #[test]
    fn plain_unified_diff_without_git_header() {
        let d = parse("--- a.txt\t2024-01-01\n+++ b.txt\n@@ -1 +1 @@\n-a\n+b\n").unwrap();
        assert_eq!(d.files[0].new_path.as_deref(), Some("b.txt"));
        assert_eq!(d.files[0].hunks[0].lines[1].new_line, Some(1));
    }

    #[test]
    fn deleted_file_has_no_new_path() {
        let d = parse("diff --git a/x b/x\ndeleted file mode 100644\n--- a/x\n+++ /dev/null\n@@ -1 +0,0 @@\n-gone\n")
            .unwrap();
        assert_eq!(d.files[0].new_path, None);
    }

    #[test]
    fn rename_without_hunks_is_valid() {
        let d = parse("diff --git a/x b/y\nsimilarity index 100%\nrename from x\nrename to y\n").unwrap();
        assert_eq!(d.files[0].new_path.as_deref(), Some("y"));
    }

    #[test]
    fn no_newline_marker_is_skipped() {
        let d = parse(
            "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n\\ No newline at end of file\n+b\n\\ No newline at end of file\n",
        )
        .unwrap();
        assert_eq!(d.files[0].hunks[0].lines.len(), 2);
    }

    #[test]
    fn rejects_what_is_not_a_diff() {
        assert_eq!(parse(""), Err(DiffError::Empty));
        assert_eq!(parse("  \n\n"), Err(DiffError::Empty));
        assert_eq!(parse("hello world\nthis is prose\n"), Err(DiffError::NoFiles));
        assert_eq!(parse("@@ -1 +1 @@\n-a\n+b\n"), Err(DiffError::HunkWithoutFile { line: 1 }));
        assert_eq!(parse("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n+b\n"), Err(DiffError::TruncatedHunk { line: 5 }));
        assert_eq!(parse("--- a/x\n+++ b/x\n@@ -x +1 @@\n-a\n+b\n"), Err(DiffError::MalformedHunkHeader { line: 3 }));
        assert_eq!(parse("--- a/x\n+++ b/x\n@@ -1 +1 @@\n*a\n+b\n"), Err(DiffError::UnexpectedHunkLine { line: 4 }));
        assert_eq!(parse("diff --git a/x b/x\nindex 1..2\n"), Err(DiffError::EmptyFile { file: 1 }));
    }

    #[test]
    fn errors_never_echo_diff_text() {
        let canary = "CANARY-7f3e";
        let err = parse(&format!("--- a/{canary}\n+++ b/{canary}\n@@ -1 +1 @@\n*{canary}\n")).unwrap_err();
        assert!(!err.to_string().contains(canary));
    }

    #[test]
    fn hunk_numbers_that_overflow_are_refused_with_the_header_line() {
        for header in ["@@ -1,1 +4294967295,2 @@", "@@ -4294967295,2 +1,1 @@", "@@ -1 +4294967295,4294967295 @@"] {
            let d = format!("diff --git a/x b/x\n--- a/x\n+++ b/x\n{header}\n-a\n+b\n+c\n");
            assert_eq!(parse(&d), Err(DiffError::HunkOutOfRange { line: 4 }), "{header}");
        }
        // Numbers that do not fit the type at all stay malformed headers.
        let d = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +99999999999 @@\n+b\n";
        assert_eq!(parse(d), Err(DiffError::MalformedHunkHeader { line: 4 }));
        // The largest hunk that fits parses.
        let d = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -0,0 +4294967294,1 @@\n+b\n";
        assert_eq!(parse(d).unwrap().files[0].hunks[0].lines[0].new_line, Some(4294967294));
    }

    fn one_file(d: &str) -> FileDiff {
        let parsed = parse(d).unwrap_or_else(|e| panic!("{e}: {d}"));
        assert_eq!(parsed.files.len(), 1);
        parsed.files[0].clone()
    }

    #[test]
    fn git_quoted_paths_are_unquoted() {
        // `core.quotePath` octal escapes (ü), a tab and a quote in names.
        let f = one_file(
            "diff --git \"a/src/\\303\\274ber.rs\" \"b/src/\\303\\274ber.rs\"\nindex 1..2 100644\n--- \"a/src/\\303\\274ber.rs\"\n+++ \"b/src/\\303\\274ber.rs\"\n@@ -1 +1 @@\n-a\n+b\n",
        );
        assert_eq!(f.new_path.as_deref(), Some("src/über.rs"));
        assert_eq!(f.old_path.as_deref(), Some("src/über.rs"));
        let f = one_file(
            "diff --git \"a/x\\ty \\\"q\\\".py\" \"b/x\\ty \\\"q\\\".py\"\n--- \"a/x\\ty \\\"q\\\".py\"\n+++ \"b/x\\ty \\\"q\\\".py\"\n@@ -0,0 +1 @@\n+z\n",
        );
        assert_eq!(f.new_path.as_deref(), Some("x\ty \"q\".py"));
        // An unclosed quote or a bad escape is refused with its line.
        assert_eq!(
            parse("diff --git \"a/x b/x\n--- a/x\n+++ b/x\n@@ -0,0 +1 @@\n+z\n"),
            Err(DiffError::BadQuotedPath { line: 1 })
        );
    }

    #[test]
    fn names_that_are_not_utf8_keep_their_bytes() {
        // `l\xe9gacy.txt` as git quotes it by default, and as its bytes
        // (`core.quotePath=false`); a rename among such names.
        let quoted = "diff --git \"a/l\\351gacy.txt\" \"b/l\\351gacy.txt\"\n--- \"a/l\\351gacy.txt\"\n+++ \"b/l\\351gacy.txt\"\n@@ -1 +1 @@\n-a\n+b\n";
        let raw = b"diff --git a/l\xe9gacy.txt b/l\xe9gacy.txt\n--- a/l\xe9gacy.txt\n+++ b/l\xe9gacy.txt\n@@ -1 +1 @@\n-a\n+b\n";
        let want = "\"l\\351gacy.txt\"";
        assert_eq!(one_file(quoted).new_path.as_deref(), Some(want));
        let from_bytes = parse_bytes(raw).unwrap();
        assert_eq!(from_bytes.files[0].new_path.as_deref(), Some(want));
        assert_eq!(from_bytes, parse(quoted).unwrap());
        assert_eq!(&*path::to_bytes(want), b"l\xe9gacy.txt");
        // Written back as git writes it, and read back the same.
        let header = from_bytes.files[0].header();
        assert!(header.starts_with("diff --git \"a/l\\351gacy.txt\" \"b/l\\351gacy.txt\"\n"), "{header}");
        assert_eq!(parse(&changed_lines_only(&from_bytes, 3)).unwrap(), from_bytes);
        let renamed = parse_bytes(
            b"diff --git a/old name\xff b/new name\xff\nsimilarity index 100%\nrename from old name\xff\nrename to new name\xff\n",
        )
        .unwrap();
        let f = &renamed.files[0];
        assert_eq!(
            (f.old_path.as_deref(), f.new_path.as_deref()),
            (Some("\"old name\\377\""), Some("\"new name\\377\""))
        );
        // A reader's copy of the name finds the file: quoted, without the quotes, decoded.
        for name in ["\"l\\351gacy.txt\"", "l\\351gacy.txt", "l\u{fffd}gacy.txt"] {
            assert!(from_bytes.file_by_new_path(name).is_some(), "{name}");
        }
        assert!(from_bytes.file_by_new_path("l\u{e9}gacy.txt").is_none());
    }

    #[test]
    fn names_with_spaces_mnemonic_prefixes_and_no_prefix() {
        let f =
            one_file("diff --git a/my file.rs b/my file.rs\n--- a/my file.rs\n+++ b/my file.rs\n@@ -1 +1 @@\n-a\n+b\n");
        assert_eq!(f.new_path.as_deref(), Some("my file.rs"));
        // diff.mnemonicPrefix: index and work tree.
        let f = one_file("diff --git i/src/x.rs w/src/x.rs\n--- i/src/x.rs\n+++ w/src/x.rs\n@@ -1 +1 @@\n-a\n+b\n");
        assert_eq!((f.old_path.as_deref(), f.new_path.as_deref()), (Some("src/x.rs"), Some("src/x.rs")));
        // --no-prefix: the paths as they are.
        let f = one_file("diff --git src/x.rs src/x.rs\n--- src/x.rs\n+++ src/x.rs\n@@ -1 +1 @@\n-a\n+b\n");
        assert_eq!(f.new_path.as_deref(), Some("src/x.rs"));
    }

    #[test]
    fn unsafe_paths_are_refused() {
        for (d, line) in [
            (
                "diff --git a/../etc/passwd b/../etc/passwd\n--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-a\n+b\n",
                1,
            ),
            ("--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", 1),
            ("--- a/x\n+++ \"b/x\\001y\"\n@@ -1 +1 @@\n-a\n+b\n", 2),
        ] {
            assert_eq!(parse(d), Err(DiffError::UnsafePath { line }), "{d}");
        }
    }

    #[test]
    fn a_file_that_appears_twice_is_refused() {
        let once = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n";
        assert_eq!(parse(&format!("{once}{once}")), Err(DiffError::DuplicateFile { file: 2 }));
    }

    #[test]
    fn crlf_diffs_parse_like_lf() {
        let lf = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n ctx\n-a\n+b\n";
        assert_eq!(parse(&lf.replace('\n', "\r\n")).unwrap(), parse(lf).unwrap());
    }
}
