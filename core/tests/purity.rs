//! The core stays pure: the compiler keeps it so only while its manifest names no
//! crate that does I/O. This holds the manifest to that.

#[test]
fn the_core_depends_on_no_runtime_network_or_store_crate() {
    let manifest = include_str!("../Cargo.toml");
    let deps = manifest.split("[dependencies]").nth(1).expect("a [dependencies] table");
    let deps = deps.split("\n[").next().unwrap_or(deps);
    let names: Vec<&str> = deps
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split(['.', ' ', '=']).next())
        .collect();
    assert!(names.contains(&"serde"), "the table was read: {names:?}");
    for banned in ["async-nats", "tokio", "tokio-util", "futures", "tonic", "hyper", "reqwest", "reviewlane-shared"] {
        assert!(!names.contains(&banned), "reviewlane-core depends on {banned}");
    }
}
