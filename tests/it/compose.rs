//! `docker-compose.yml`, proved without Docker: it is valid against the Compose
//! Specification's schema; every `depends_on` waits on a health condition that exists;
//! and every service built from this repository loads its whole config (`--check-config`)
//! with exactly the environment and files compose gives it — a missing variable or file
//! fails here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml_ng::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The compose file with YAML merge keys applied (nested merges too).
fn compose() -> Value {
    let text = std::fs::read_to_string(root().join("docker-compose.yml")).unwrap();
    let mut v: Value = serde_yaml_ng::from_str(&text).unwrap();
    for _ in 0..4 {
        v.apply_merge().unwrap();
    }
    assert!(!serde_yaml_ng::to_string(&v).unwrap().contains("<<"), "merge keys left");
    v
}

fn services(c: &Value) -> Vec<(String, Value)> {
    c["services"].as_mapping().unwrap().iter().map(|(k, v)| (k.as_str().unwrap().to_string(), v.clone())).collect()
}

#[test]
fn the_compose_file_is_valid_against_the_compose_specification() {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/vendor/compose-spec/compose-spec.json")).unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let doc: serde_json::Value = serde_json::to_value(compose()).unwrap();
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    assert!(errors.is_empty(), "{errors:#?}");
}

#[test]
fn every_dependency_waits_on_a_condition_the_dependency_can_meet() {
    let c = compose();
    let all: BTreeMap<String, Value> = services(&c).into_iter().collect();
    for (name, svc) in &all {
        let Some(deps) = svc.get("depends_on") else { continue };
        let deps = deps.as_mapping().unwrap_or_else(|| panic!("{name}: depends_on must name conditions"));
        for (dep, cond) in deps {
            let dep = dep.as_str().unwrap();
            let condition = cond["condition"].as_str().unwrap_or_else(|| panic!("{name} -> {dep}: no condition"));
            match condition {
                "service_healthy" => {
                    assert!(
                        all[dep].get("healthcheck").is_some(),
                        "{name} waits for {dep} to be healthy; it has no healthcheck"
                    )
                }
                "service_completed_successfully" => {
                    assert_eq!(all[dep]["restart"].as_str(), Some("no"), "{dep} is a one-shot step")
                }
                other => panic!("{name} -> {dep}: condition {other} is not a health condition"),
            }
        }
    }
}

/// How compose would run a service built from this repository: its binary, arguments,
/// environment, and the host paths behind its container paths.
struct Run {
    binary: String,
    args: Vec<String>,
    env: BTreeMap<String, String>,
}

fn runs(c: &Value, named_volumes: &Path) -> Vec<(String, Run)> {
    let mut out = Vec::new();
    for (name, svc) in services(c) {
        if svc.get("build").is_none() {
            continue;
        }
        let command: Vec<String> =
            svc["command"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect();
        // Container path -> host path, for each volume.
        let mut mounts = Vec::new();
        for v in svc.get("volumes").and_then(Value::as_sequence).into_iter().flatten() {
            let spec = v.as_str().unwrap();
            let mut parts = spec.split(':');
            let (source, target) = (parts.next().unwrap(), parts.next().unwrap());
            let host = if source.starts_with("./") {
                let p = root().join(source);
                assert!(p.exists(), "{name}: mounts {source}, which does not exist");
                p
            } else {
                let p = named_volumes.join(source);
                std::fs::create_dir_all(&p).unwrap();
                p
            };
            mounts.push((target.to_string(), host));
        }
        let env: BTreeMap<String, String> = svc
            .get("environment")
            .and_then(Value::as_mapping)
            .into_iter()
            .flatten()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => s.clone(),
                    other => serde_yaml_ng::to_string(other).unwrap().trim().to_string(),
                };
                let v = mounts
                    .iter()
                    .find(|(target, _)| v.starts_with(target.as_str()))
                    .map(|(target, host)| format!("{}{}", host.display(), &v[target.len()..]))
                    .unwrap_or(v);
                (k.as_str().unwrap().to_string(), v)
            })
            .collect();
        out.push((name, Run { binary: command[0].clone(), args: command[1..].to_vec(), env }));
    }
    out
}

fn check_config(run: &Run) -> std::process::Output {
    let bin = reviewlane_testkit::procs::bin_dir().unwrap().join(&run.binary);
    assert!(bin.exists(), "{} is not built", bin.display());
    Command::new(bin).args(&run.args).arg("--check-config").env_clear().envs(&run.env).output().unwrap()
}

#[test]
fn every_service_loads_its_whole_config_with_what_compose_gives_it() {
    reviewlane_testkit::procs::ensure_built().unwrap();
    let volumes = tempfile::tempdir().unwrap();
    let c = compose();
    let runs = runs(&c, volumes.path());
    let names: Vec<&str> = runs.iter().map(|(n, _)| n.as_str()).collect();
    for expected in ["provision-us", "ingress", "extractor-us", "extractor-eu", "publisher-eu", "sim-us"] {
        assert!(names.contains(&expected), "{names:?}");
    }
    for (name, run) in &runs {
        let out = check_config(run);
        assert!(
            out.status.success(),
            "{name}: {} {:?} --check-config exited {:?}: {}",
            run.binary,
            run.args,
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The check is real: without the tenants file an extractor's config is refused (64).
    let (_, extractor) = runs.iter().find(|(n, _)| n == "extractor-us").unwrap();
    let mut broken = Run { binary: extractor.binary.clone(), args: extractor.args.clone(), env: extractor.env.clone() };
    broken.env.remove("REVIEWLANE_TENANTS_FILE");
    let out = check_config(&broken);
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("REVIEWLANE_TENANTS_FILE"));
}

#[test]
fn health_checks_probe_the_port_each_service_serves() {
    let c = compose();
    for (name, svc) in services(&c) {
        let Some(test) = svc.get("healthcheck").and_then(|h| h["test"].as_sequence()) else { continue };
        let test: Vec<&str> = test.iter().filter_map(Value::as_str).collect();
        if test.get(1) != Some(&"reviewlane-admin") {
            continue;
        }
        let port = test[3].rsplit(':').next().unwrap();
        let bound = ["REVIEWLANE_ADMIN_ADDR", "REVIEWLANE_SIM_ADDR"]
            .iter()
            .filter_map(|k| svc["environment"].get(*k).and_then(Value::as_str))
            .any(|addr| addr.ends_with(&format!(":{port}")) && addr.starts_with("0.0.0.0"));
        assert!(bound, "{name}: probes port {port}, which it does not serve on all interfaces");
    }
}
