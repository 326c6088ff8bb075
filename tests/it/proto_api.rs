//! The API's compatibility: `buf lint` (the STANDARD rules) on `proto/`, and
//! `buf breaking` (wire and JSON) against the API as it was before the current
//! additions (`tests/vendor/proto-baseline`): every change is additive.

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// `REVIEWLANE_BUF`, else what `scripts/install-buf.sh` installs.
fn buf() -> PathBuf {
    match std::env::var_os("REVIEWLANE_BUF") {
        Some(p) => PathBuf::from(p),
        None => {
            let out = Command::new("bash").arg(root().join("scripts/install-buf.sh")).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            PathBuf::from(String::from_utf8_lossy(&out.stdout).lines().last().unwrap().trim())
        }
    }
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(buf()).args(args).current_dir(root()).output().expect("buf runs");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn the_api_passes_buf_lint_and_breaks_nothing() {
    let (ok, out) = run(&["lint"]);
    assert!(ok, "buf lint:\n{out}");
    let (ok, out) = run(&["breaking", "--against", "tests/vendor/proto-baseline"]);
    assert!(ok, "buf breaking:\n{out}");
}

#[test]
fn buf_breaking_does_catch_a_breaking_change() {
    // The check is not vacuous: the baseline against today's API with a field renamed.
    let dir = tempfile::tempdir().unwrap();
    let proto = std::fs::read_to_string(root().join("proto/reviewlane/v1/review.proto")).unwrap();
    let renamed = proto.replacen("string evidence = 7;", "string quoted = 7;", 1);
    assert_ne!(proto, renamed);
    std::fs::create_dir_all(dir.path().join("reviewlane/v1")).unwrap();
    std::fs::write(dir.path().join("reviewlane/v1/review.proto"), renamed).unwrap();
    let (ok, out) = run(&["breaking", dir.path().to_str().unwrap(), "--against", "proto"]);
    assert!(!ok && out.contains("evidence"), "{out}");
}
