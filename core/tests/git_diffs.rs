//! The diff parser against real `git diff` output: each case builds a temporary
//! repository with `git`, and the parsed files and line counts are checked against what
//! git itself reports (`git diff --name-status -z` and `git diff --numstat -z`).

use std::process::Command;

use reviewlane_core::diff::{self, Diff, LineKind};

struct Repo {
    dir: tempfile::TempDir,
}

impl Repo {
    fn new() -> Repo {
        let repo = Repo { dir: tempfile::tempdir().unwrap() };
        repo.git(&["init", "-q", "-b", "main"]);
        repo.git(&["config", "user.email", "t@example.invalid"]);
        repo.git(&["config", "user.name", "t"]);
        repo.git(&["config", "core.autocrlf", "false"]);
        repo
    }

    fn path(&self, p: &str) -> std::path::PathBuf {
        self.dir.path().join(p)
    }

    fn write(&self, p: &str, content: &[u8]) {
        let path = self.path(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }

    fn git(&self, args: &[&str]) -> Vec<u8> {
        let out = Command::new("git")
            .args(args)
            .current_dir(self.dir.path())
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", self.dir.path())
            .output()
            .expect("git runs");
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    fn commit(&self) {
        self.git(&["add", "-A"]);
        self.git(&["commit", "-q", "--allow-empty", "-m", "c"]);
    }

    /// The staged change as `git diff` writes it with `flags`, and what git says about
    /// it: (status, old path, new path) per file and (added, removed) line counts
    /// (`None` for binary).
    fn staged(&self, flags: &[&str]) -> (Vec<u8>, Vec<Entry>) {
        self.git(&["add", "-A"]);
        let diff = self.git(&[&["diff", "--cached"], flags].concat());
        let names = self.git(&[&["diff", "--cached", "--name-status", "-z"], flags].concat());
        let nums = self.git(&[&["diff", "--cached", "--numstat", "-z"], flags].concat());
        (diff, entries(&names, &nums))
    }
}

#[derive(Debug)]
struct Entry {
    status: char,
    old: Option<String>,
    new: Option<String>,
    counts: Option<(usize, usize)>,
}

/// Joins `--name-status -z` and `--numstat -z` output (same order of files); names in
/// their string form (`diff::path`).
fn entries(names: &[u8], nums: &[u8]) -> Vec<Entry> {
    let s = diff::path::from_bytes;
    let mut names = names.split(|b| *b == 0).filter(|f| !f.is_empty());
    let mut out = Vec::new();
    while let Some(status) = names.next() {
        let status = status[0] as char;
        let (old, new) = match status {
            'R' | 'C' => (Some(s(names.next().unwrap())), Some(s(names.next().unwrap()))),
            'A' => (None, Some(s(names.next().unwrap()))),
            'D' => (Some(s(names.next().unwrap())), None),
            _ => {
                let p = s(names.next().unwrap());
                (Some(p.clone()), Some(p))
            }
        };
        out.push(Entry { status, old, new, counts: None });
    }
    // numstat -z: `added\tremoved\tpath\0`, or `added\tremoved\t\0old\0new\0` for a move.
    let mut fields = nums.split(|b| *b == 0);
    for e in &mut out {
        let head = String::from_utf8_lossy(fields.next().unwrap());
        let mut cols = head.splitn(3, '\t');
        let (a, r, path) = (cols.next().unwrap(), cols.next().unwrap(), cols.next().unwrap_or(""));
        if path.is_empty() {
            fields.next();
            fields.next();
        }
        e.counts = if a == "-" { None } else { Some((a.parse().unwrap(), r.parse().unwrap())) };
    }
    out
}

/// Parses the diff (as the ingress does a `diff_bytes` request) and checks it against
/// git's own account of the same change.
fn check(raw: &[u8], git: &[Entry]) -> Diff {
    let parsed = diff::parse_bytes(raw).unwrap_or_else(|e| panic!("{e}\n{}", String::from_utf8_lossy(raw)));
    assert_eq!(parsed.files.len(), git.len(), "files: {parsed:#?}\nvs git: {git:#?}");
    for (f, e) in parsed.files.iter().zip(git) {
        assert_eq!((&f.old_path, &f.new_path), (&e.old, &e.new), "paths of {e:?}");
        match e.counts {
            None => assert!(f.binary, "{e:?} is binary"),
            Some((added, removed)) => {
                let count = |k| f.hunks.iter().flat_map(|h| &h.lines).filter(|l| l.kind == k).count();
                assert_eq!((count(LineKind::Added), count(LineKind::Removed)), (added, removed), "{e:?}");
            }
        }
    }
    parsed
}

/// New-side line numbers of every added line, in order, from the file itself: the
/// parser's numbering must point at the line git added.
fn added_lines_match_file(repo: &Repo, parsed: &Diff) {
    for (file, _, line) in parsed.added_lines() {
        let Some(path) = file.new_path.as_deref() else { continue };
        let path = repo
            .dir
            .path()
            .join(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&diff::path::to_bytes(path)));
        if file.binary || std::fs::symlink_metadata(&path).is_ok_and(|m| !m.is_file()) {
            continue;
        }
        let Ok(content) = std::fs::read(&path) else { continue };
        let content = String::from_utf8_lossy(&content);
        let at = content.split('\n').nth(line.new_line.unwrap() as usize - 1).unwrap();
        assert_eq!(at.strip_suffix('\r').unwrap_or(at), line.text.strip_suffix('\r').unwrap_or(&line.text));
    }
}

#[test]
fn quoted_non_ascii_and_odd_names() {
    let repo = Repo::new();
    repo.write("keep.txt", b"x\n");
    repo.commit();
    for name in ["src/\u{fc}ber.rs", "dir with space/a b.rs", "we\"ird.rs", "tab\there.rs", "back\\slash.rs"] {
        repo.write(name, b"fn f() {}\nlet y = 1;\n");
    }
    // core.quotePath on (the default: octal escapes) and off (raw UTF-8).
    for flags in [&[][..], &["-c", "core.quotePath=false"][..]] {
        let (raw, git) = if flags.is_empty() {
            repo.staged(&[])
        } else {
            repo.git(&["add", "-A"]);
            let d = repo.git(&[flags, &["diff", "--cached"]].concat());
            let n = repo.git(&[flags, &["diff", "--cached", "--name-status", "-z"]].concat());
            let s = repo.git(&[flags, &["diff", "--cached", "--numstat", "-z"]].concat());
            (d, entries(&n, &s))
        };
        let parsed = check(&raw, &git);
        added_lines_match_file(&repo, &parsed);
        assert!(parsed.file_by_new_path("src/\u{fc}ber.rs").is_some());
    }
}

#[test]
fn renames_and_copies_with_and_without_edits() {
    let repo = Repo::new();
    let body: String = (1..=40).map(|i| format!("line {i}\n")).collect();
    repo.write("a/old name.rs", body.as_bytes());
    repo.write("b/moved.rs", body.as_bytes());
    repo.write("c/source.rs", body.as_bytes());
    repo.commit();
    std::fs::rename(repo.path("a/old name.rs"), repo.path("a/new name.rs")).unwrap();
    std::fs::remove_file(repo.path("b/moved.rs")).unwrap();
    repo.write("b/elsewhere/moved.rs", body.replace("line 20\n", "line twenty\n").as_bytes());
    repo.write("c/copy.rs", body.replace("line 3\n", "line three\n").as_bytes());
    let (raw, git) = repo.staged(&["-M", "-C", "--find-copies-harder"]);
    assert!(git.iter().any(|e| e.status == 'R') && git.iter().any(|e| e.status == 'C'), "{git:?}");
    let parsed = check(&raw, &git);
    added_lines_match_file(&repo, &parsed);
}

#[test]
fn binary_mode_symlink_submodule_and_deletions() {
    let repo = Repo::new();
    repo.write("img.png", &[0x89, b'P', b'N', b'G', 0, 1, 2, 3]);
    repo.write("run.sh", b"echo hi\n");
    repo.write("gone.txt", b"a\nb\n");
    repo.write("gone.bin", &[0, 1, 2]);
    repo.commit();
    repo.write("img.png", &[0x89, b'P', b'N', b'G', 0, 9, 9, 9]);
    repo.write("new.bin", &[0, 0, 7]);
    std::fs::set_permissions(repo.path("run.sh"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("run.sh", repo.path("link")).unwrap();
    std::fs::remove_file(repo.path("gone.txt")).unwrap();
    std::fs::remove_file(repo.path("gone.bin")).unwrap();
    repo.git(&["add", "-A"]);
    // A submodule: a gitlink entry pointing at a commit.
    let sha = "1234567890abcdef1234567890abcdef12345678";
    repo.git(&["update-index", "--add", "--cacheinfo", &format!("160000,{sha},vendor/lib")]);
    let (raw, git) = {
        let d = repo.git(&["diff", "--cached"]);
        let n = repo.git(&["diff", "--cached", "--name-status", "-z"]);
        let s = repo.git(&["diff", "--cached", "--numstat", "-z"]);
        (d, entries(&n, &s))
    };
    let parsed = check(&raw, &git);
    let mode = parsed.files.iter().find(|f| f.new_path.as_deref() == Some("run.sh")).unwrap();
    assert!(mode.hunks.is_empty() && !mode.binary);
    let sub = parsed.file_by_new_path("vendor/lib").unwrap();
    assert!(sub.hunks[0].lines[0].text.starts_with("Subproject commit "));
}

#[test]
fn crlf_missing_final_newline_and_non_utf8_content() {
    let repo = Repo::new();
    repo.write("win.txt", b"one\r\ntwo\r\n");
    repo.write("tail.txt", b"a\nb");
    repo.write("latin1.txt", b"caf\xe9\n");
    repo.commit();
    repo.write("win.txt", b"one\r\nTWO\r\nthree\r\n");
    repo.write("tail.txt", b"a\nB");
    repo.write("latin1.txt", b"caf\xe9\nna\xefve\n");
    let (raw, git) = repo.staged(&[]);
    assert!(std::str::from_utf8(&raw).is_err(), "the diff carries raw Latin-1 bytes");
    let parsed = check(&raw, &git);
    added_lines_match_file(&repo, &parsed);
    let latin = parsed.file_by_new_path("latin1.txt").unwrap();
    assert!(latin.hunks[0].lines.iter().any(|l| l.text == "na\u{fffd}ve"));
}

#[test]
fn mnemonic_and_no_prefix() {
    let repo = Repo::new();
    repo.write("src/lib.rs", b"a\n");
    repo.write("docs/x y.md", b"a\n");
    repo.commit();
    repo.write("src/lib.rs", b"a\nb\n");
    repo.write("docs/x y.md", b"b\n");
    repo.git(&["add", "src"]);
    // Index against the tree (c/ i/), work tree against the index (i/ w/), no prefix.
    for flags in [
        vec!["-c", "diff.mnemonicPrefix=true", "diff", "--cached"],
        vec!["-c", "diff.mnemonicPrefix=true", "diff"],
        vec!["diff", "--cached", "--no-prefix"],
    ] {
        let raw = repo.git(&flags);
        let stat_flags: Vec<&str> = flags.iter().copied().filter(|f| *f != "--no-prefix").collect();
        let n = repo.git(&[&stat_flags[..], &["--name-status", "-z"]].concat());
        let s = repo.git(&[&stat_flags[..], &["--numstat", "-z"]].concat());
        // git's names carry no prefix: the parser removed each kind.
        let parsed = check(&raw, &entries(&n, &s));
        assert!(!parsed.files.is_empty(), "{flags:?}");
    }
}

#[test]
fn a_type_change_is_one_file() {
    let repo = Repo::new();
    repo.write("target.txt", b"hello\n");
    repo.write("link", b"was a file\nof two lines\n");
    repo.commit();
    std::fs::remove_file(repo.path("link")).unwrap();
    std::os::unix::fs::symlink("target.txt", repo.path("link")).unwrap();
    let (raw, git) = repo.staged(&[]);
    assert_eq!(git.iter().map(|e| e.status).collect::<String>(), "T", "{git:?}");
    let text = String::from_utf8_lossy(&raw);
    assert_eq!(text.matches("diff --git a/link b/link").count(), 2, "git prints two entries: {text}");
    let parsed = check(&raw, &git);
    let link = parsed.file_by_new_path("link").unwrap();
    assert_eq!(parsed.file_by_old_path("link").map(|f| f.new_path.as_deref()), Some(Some("link")));
    assert!(link.hunk_for_new_line(1).is_some() && link.hunk_for_old_line(2).is_some());
}

#[test]
fn custom_prefixes_are_recognised_from_the_diff_git_line() {
    let repo = Repo::new();
    repo.write("src/app.rs", b"fn a() {}\n");
    repo.write("docs/x y.md", b"a\n");
    repo.commit();
    repo.write("src/moved.rs", b"fn m() {}\nfn mm() {}\nfn mmm() {}\n");
    repo.commit();
    repo.write("src/app.rs", b"fn a() {}\nfn b() {}\n");
    repo.write("docs/x y.md", b"b\n");
    repo.write("src/new.rs", b"fn n() {}\n");
    std::fs::remove_file(repo.path("src/moved.rs")).unwrap();
    repo.write("lib/moved.rs", b"fn m() {}\nfn mm() {}\nfn mmm() {}\nfn more() {}\n");
    for flags in [
        vec!["diff", "--cached", "-M", "--src-prefix=old/", "--dst-prefix=new/"],
        vec!["-c", "diff.srcPrefix=before/", "-c", "diff.dstPrefix=after/", "diff", "--cached", "-M"],
    ] {
        repo.git(&["add", "-A"]);
        let raw = repo.git(&flags);
        let stat: Vec<&str> =
            flags.iter().copied().filter(|f| !f.to_lowercase().contains("prefix") && *f != "-c").collect();
        let n = repo.git(&[&stat[..], &["--name-status", "-z"]].concat());
        let s = repo.git(&[&stat[..], &["--numstat", "-z"]].concat());
        let parsed = check(&raw, &entries(&n, &s));
        assert!(parsed.file_by_new_path("src/new.rs").is_some(), "{flags:?}: {parsed:#?}");
        assert!(parsed.file_by_new_path("docs/x y.md").is_some(), "{flags:?}");
        assert_eq!(parsed.file_by_new_path("lib/moved.rs").unwrap().old_path.as_deref(), Some("src/moved.rs"));
        added_lines_match_file(&repo, &parsed);
    }
}

#[test]
fn colours_are_stripped_and_combined_and_word_diffs_are_refused_by_name() {
    let repo = Repo::new();
    repo.write("src/lib.rs", b"fn a() {}\nlet x = 1;\n");
    repo.commit();
    repo.write("src/lib.rs", b"fn a() {}\nlet x = 2;\nlet y = 3;\n");
    repo.git(&["add", "-A"]);
    let plain = repo.git(&["diff", "--cached"]);
    let coloured = repo.git(&["diff", "--cached", "--color=always"]);
    assert!(coloured.contains(&0x1b), "git wrote colours");
    let cleaned = diff::strip_colours(&coloured).expect("colours found");
    assert_eq!(cleaned, plain);
    assert_eq!(diff::strip_colours(&plain), None);

    for (flags, form) in [(&["--word-diff"][..], "word-diff"), (&["--word-diff=porcelain"][..], "word-diff")] {
        let raw = repo.git(&[&["diff", "--cached"], flags].concat());
        let err = diff::parse(&String::from_utf8_lossy(&raw)).unwrap_err();
        assert!(matches!(err, diff::DiffError::WordDiff { .. }), "{flags:?}: {err}");
        assert!(err.to_string().contains(form) && err.to_string().contains("send a line diff"), "{err}");
    }

    // A merge whose result differs from both parents: `git show --cc` prints a
    // combined diff.
    repo.git(&["commit", "-qm", "main"]);
    repo.git(&["checkout", "-qb", "side", "HEAD~1"]);
    repo.write("src/lib.rs", b"fn a() {}\nlet x = 9;\n");
    repo.git(&["commit", "-qam", "side"]);
    repo.git(&["checkout", "-q", "main"]);
    let _ = Command::new("git").args(["merge", "-q", "side"]).current_dir(repo.dir.path()).output();
    repo.write("src/lib.rs", b"fn a() {}\nlet x = 5;\nlet y = 3;\n");
    repo.git(&["commit", "-qam", "merged"]);
    let combined = repo.git(&["show", "--cc", "--format="]);
    let text = String::from_utf8_lossy(&combined);
    assert!(text.contains("diff --cc"), "{text}");
    let err = diff::parse(&text).unwrap_err();
    assert!(matches!(err, diff::DiffError::CombinedDiff { line: 1 }), "{err}");
    assert!(err.to_string().contains("git diff <first parent> <merge>"), "{err}");
}

/// A file whose lines hold terminal escape codes, as ripgrep's tests of coloured output
/// do (`ESC[0m1ESC[0m:ESC[0mESC[31m...`), changed in every way git marks up a line.
const ESCAPES_BEFORE: &[u8] = b"fn main() {\n\x1b[0m1\x1b[0m:\x1b[0m\x1b[31mold\x1b[0m\n  keep \x1b[1mbold\x1b[m\nplain\n\x1b[32mgone\x1b[m\n\x1b[0m3\x1b[0m:context\ntail\nfn \x1b[31msecond\x1b[m() {\n  a\n  b\n  c\n  d\n  e\n";
const ESCAPES_AFTER: &[u8] = b"fn main() {\n\x1b[0m1\x1b[0m:\x1b[0m\x1b[31mSherlock\x1b[0m\n  keep \x1b[1mbold\x1b[m\n\x1b[mstarts with a reset\n\tindented \x1b[4m\x1b[m  \n \tspace before tab\x1b[m\nends in a code\x1b[1m\ncr\x1b[m\r\n   \n\n        eight spaces\x1b[m\n\x1b[0m3\x1b[0m:context\ntail\nfn \x1b[31msecond\x1b[m() {\n  a\n  b\n  c\n  d\n  \x1b[1mE\x1b[m\n\x1b[0m2\x1b[0m:no newline\x1b[0m";

/// The real shapes of both: a plain diff of a file whose lines hold escape codes is
/// never changed, and the same diff as git colours it loses git's codes only.
#[test]
fn escape_codes_are_content_and_only_gits_colours_are_stripped() {
    let repo = Repo::new();
    repo.write("tests/colour.txt", ESCAPES_BEFORE);
    repo.commit();
    repo.write("tests/colour.txt", ESCAPES_AFTER);
    let (plain, git) = repo.staged(&[]);
    assert!(plain.contains(&0x1b), "the plain diff carries the file's codes");
    assert_eq!(diff::strip_colours(&plain), None, "a plain diff is not changed");
    let parsed = check(&plain, &git);
    added_lines_match_file(&repo, &parsed);
    let added: Vec<&str> = parsed.added_lines().map(|(_, _, l)| l.text.as_str()).collect();
    assert!(added.contains(&"\x1b[0m1\x1b[0m:\x1b[0m\x1b[31mSherlock\x1b[0m"), "{added:?}");
    assert!(
        String::from_utf8_lossy(&plain).contains(" @@ fn \x1b[31msecond\x1b[m() {\n"),
        "a function name with codes"
    );
    // git's defaults, and settings that change how it marks lines up: moved lines,
    // whitespace errors on every line or none, colours with attributes.
    for flags in [
        vec!["diff", "--cached", "--color=always"],
        vec!["diff", "--cached", "--color=always", "--color-moved=zebra"],
        vec!["diff", "--cached", "--color=always", "--ws-error-highlight=all"],
        vec!["diff", "--cached", "--color=always", "--ws-error-highlight=none"],
        vec![
            "-c",
            "color.diff.new=bold green",
            "-c",
            "color.diff.old=red reverse",
            "diff",
            "--cached",
            "--color=always",
        ],
        vec!["-c", "color.diff.meta=normal", "diff", "--cached", "--color=always"],
    ] {
        let coloured = repo.git(&flags);
        assert_ne!(coloured, plain, "{flags:?}: git wrote colours");
        let cleaned = diff::strip_colours(&coloured).unwrap_or_else(|| panic!("{flags:?}: colours found"));
        assert_eq!(String::from_utf8_lossy(&cleaned), String::from_utf8_lossy(&plain), "{flags:?}");
    }
}

/// Latin-1 file names (`l\xe9gacy.txt`): bytes that are no UTF-8, quoted by git by
/// default and written raw with `core.quotePath=false`.
#[test]
fn a_file_name_that_is_not_utf8_is_kept_exactly() {
    use std::os::unix::ffi::OsStrExt;
    let repo = Repo::new();
    let on_disk = |name: &[u8]| repo.dir.path().join(std::ffi::OsStr::from_bytes(name));
    std::fs::write(on_disk(b"l\xe9gacy.txt"), b"one\n").unwrap();
    std::fs::write(on_disk(b"old na\xefve.txt"), b"a\nb\nc\nd\ne\n").unwrap();
    repo.commit();
    std::fs::write(on_disk(b"l\xe9gacy.txt"), b"one\ntwo\n").unwrap();
    std::fs::rename(on_disk(b"old na\xefve.txt"), on_disk(b"new na\xefve.txt")).unwrap();
    std::fs::write(on_disk(b"new na\xefve.txt"), b"a\nb\nc\nd\ne\nf\n").unwrap();
    for flags in [&[][..], &["-c", "core.quotePath=false"][..]] {
        repo.git(&["add", "-A"]);
        let raw = repo.git(&[flags, &["diff", "--cached", "-M"]].concat());
        let n = repo.git(&[flags, &["diff", "--cached", "-M", "--name-status", "-z"]].concat());
        let s = repo.git(&[flags, &["diff", "--cached", "-M", "--numstat", "-z"]].concat());
        // git quotes the names by default (an ASCII diff), or writes their bytes.
        assert_eq!(std::str::from_utf8(&raw).is_ok(), flags.is_empty(), "{flags:?}");
        let parsed = check(&raw, &entries(&n, &s));
        // git's own quoted form, which reads back to the bytes on disk.
        let legacy = parsed.file_by_new_path("\"l\\351gacy.txt\"").expect("the quoted form");
        assert_eq!(legacy.hunks[0].lines.last().unwrap().text, "two");
        let renamed = parsed.file_by_new_path("\"new na\\357ve.txt\"").expect("the quoted form");
        assert_eq!(renamed.old_path.as_deref(), Some("\"old na\\357ve.txt\""));
        for f in &parsed.files {
            assert!(on_disk(&diff::path::to_bytes(f.new_path.as_deref().unwrap())).is_file(), "{f:?}");
        }
        added_lines_match_file(&repo, &parsed);
    }
}
