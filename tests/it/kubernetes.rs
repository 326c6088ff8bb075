//! The Kubernetes package, checked offline: every kustomization renders
//! (kustomize, standalone or in kubectl), every object is valid against the Kubernetes API schemas
//! (kubernetes-validate) or its CRD's schema (vendored), checkov finds no failed check,
//! and the properties the package promises hold object by object: default-deny network
//! policies, secrets as files, images by digest, hardened containers, region placement.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where `scripts/install-k8s-tools.sh` put checkov and kubernetes-validate.
fn tools() -> PathBuf {
    match std::env::var_os("REVIEWLANE_K8S_TOOLS") {
        Some(p) => PathBuf::from(p),
        None => {
            let out = Command::new("bash").arg(root().join("scripts/install-k8s-tools.sh")).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            PathBuf::from(String::from_utf8_lossy(&out.stdout).lines().last().unwrap().trim())
        }
    }
}

/// The command that renders a kustomization: a standalone kustomize in .tools/ (what
/// `scripts/install-k8s-tools.sh` fetches when the machine has no kubectl), else
/// `kubectl kustomize`.
fn kustomize() -> Command {
    let local = root().join(".tools/usr/bin/kustomize");
    if local.exists() {
        let mut c = Command::new(local);
        c.arg("build");
        return c;
    }
    let mut c = Command::new("kubectl");
    c.arg("kustomize");
    c
}

const KUSTOMIZATIONS: [&str; 5] =
    ["k8s/regions/us", "k8s/regions/eu", "k8s/ingress", "k8s/monitoring", "k8s/dashboards"];

/// The rendered YAML of a kustomization, and its objects as JSON.
fn render(dir: &str) -> (String, Vec<Value>) {
    let out = kustomize().arg(dir).current_dir(root()).output().expect("kustomize runs");
    assert!(out.status.success(), "{dir}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let objects = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde_json::to_value(<serde_yaml_ng::Value as serde::Deserialize>::deserialize(d).unwrap()).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect();
    (text, objects)
}

fn rendered_file(dir: &str, text: &str, tmp: &Path) -> PathBuf {
    let p = tmp.join(format!("{}.yaml", dir.replace('/', "_")));
    std::fs::write(&p, text).unwrap();
    p
}

fn kind(o: &Value) -> &str {
    o["kind"].as_str().unwrap_or_default()
}

fn name(o: &Value) -> String {
    format!("{}/{}", kind(o), o["metadata"]["name"].as_str().unwrap_or_default())
}

fn pod_spec(o: &Value) -> Option<&Value> {
    match kind(o) {
        "Deployment" | "StatefulSet" | "Job" => Some(&o["spec"]["template"]["spec"]),
        _ => None,
    }
}

#[test]
fn every_object_is_valid_against_its_schema() {
    let tmp = tempfile::tempdir().unwrap();
    let crd = |file: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(root().join("tests/vendor/crds").join(file)).unwrap()).unwrap()
    };
    let crds = [
        ("ScaledObject", crd("keda.sh_scaledobject_v1alpha1.json")),
        ("PodMonitor", crd("monitoring.coreos.com_podmonitor_v1.json")),
        ("PrometheusRule", crd("monitoring.coreos.com_prometheusrule_v1.json")),
    ];
    for dir in KUSTOMIZATIONS {
        let (text, objects) = render(dir);
        assert!(!objects.is_empty(), "{dir} renders nothing");
        let out = Command::new(tools().join("kubernetes-validate"))
            .args(["--strict", "-k", "1.30.0", "--quiet"])
            .arg(rendered_file(dir, &text, tmp.path()))
            .output()
            .unwrap();
        let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && !report.contains("ERROR"), "{dir}: {report}");
        for o in &objects {
            if let Some((_, schema)) = crds.iter().find(|(k, _)| *k == kind(o)) {
                let v = jsonschema::validator_for(schema).unwrap();
                let errors: Vec<String> = v.iter_errors(o).map(|e| format!("{e} at {}", e.instance_path())).collect();
                assert!(errors.is_empty(), "{dir} {}: {errors:#?}", name(o));
            } else {
                assert!(
                    !report.contains(&format!("Couldn't find schema for kind {}", kind(o))),
                    "{dir}: {} unchecked",
                    name(o)
                );
            }
        }
    }
}

#[test]
fn checkov_finds_no_failed_check() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in KUSTOMIZATIONS {
        let (text, _) = render(dir);
        let file = rendered_file(dir, &text, tmp.path());
        let out = Command::new(tools().join("checkov"))
            .args(["--framework", "kubernetes", "--compact", "--quiet", "--skip-download", "-o", "json", "-f"])
            .arg(&file)
            .env("BC_SKIP_MAPPING", "TRUE")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let report: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{dir}: {e}: {stdout}"));
        // One report, or one per framework; a file with nothing to check says so.
        let reports: Vec<&Value> = match &report {
            Value::Array(a) => a.iter().collect(),
            other => vec![other],
        };
        for r in reports {
            let failed = r["summary"]["failed"].as_u64().unwrap_or(0);
            let checks: Vec<String> = r["results"]["failed_checks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| format!("{} {}", c["check_id"], c["resource"]))
                .collect();
            assert_eq!(failed, 0, "{dir}: {checks:#?}");
        }
    }
}

#[test]
fn the_package_keeps_its_promises_object_by_object() {
    for dir in KUSTOMIZATIONS {
        let (_, objects) = render(dir);
        let namespaced = objects.iter().any(|o| kind(o) == "Deployment");
        if namespaced {
            // Default deny, in and out, wherever workloads run.
            let deny = objects.iter().find(|o| kind(o) == "NetworkPolicy" && o["metadata"]["name"] == "default-deny");
            let deny = deny.unwrap_or_else(|| panic!("{dir}: no default-deny policy"));
            assert_eq!(deny["spec"]["podSelector"], serde_json::json!({}));
            assert_eq!(deny["spec"]["policyTypes"], serde_json::json!(["Ingress", "Egress"]));
        }
        for o in objects.iter().filter(|o| kind(o) == "ServiceAccount") {
            assert_eq!(o["automountServiceAccountToken"], false, "{dir} {}", name(o));
        }
        for o in &objects {
            let Some(spec) = pod_spec(o) else { continue };
            assert_eq!(spec["automountServiceAccountToken"], false, "{dir} {}", name(o));
            assert_eq!(spec["securityContext"]["runAsNonRoot"], true, "{dir} {}", name(o));
            for c in spec["containers"].as_array().unwrap() {
                let what = format!("{dir} {} container {}", name(o), c["name"]);
                let image = c["image"].as_str().unwrap();
                assert!(image.contains("@sha256:"), "{what}: image {image} not by digest");
                assert!(
                    c["resources"]["limits"]["memory"].is_string() && c["resources"]["requests"].is_object(),
                    "{what}"
                );
                let sc = &c["securityContext"];
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}");
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}");
                assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]), "{what}");
                if kind(o) != "Job" {
                    assert!(c["livenessProbe"].is_object() && c["readinessProbe"].is_object(), "{what}: probes");
                }
                // Secrets as files: no credential in a plain value or from a Secret as a variable.
                for e in c["env"].as_array().into_iter().flatten() {
                    let var = e["name"].as_str().unwrap();
                    assert!(e["valueFrom"]["secretKeyRef"].is_null(), "{what}: {var} from a Secret as a variable");
                    let secretish = ["PASSWORD", "TOKEN", "API_KEY", "SECRET"].iter().any(|s| var.contains(s));
                    assert!(!secretish || var.ends_with("_FILE"), "{what}: {var} carries a secret as a value");
                }
                for e in c["envFrom"].as_array().into_iter().flatten() {
                    assert!(e["secretRef"].is_null(), "{what}: a Secret as variables");
                }
            }
        }
        // A region's pods run on its nodes and send its content to its own endpoint.
        if let Some(region) = dir.strip_prefix("k8s/regions/") {
            for o in &objects {
                let Some(spec) = pod_spec(o) else { continue };
                let term = &spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                    [0]["matchExpressions"][0];
                assert_eq!(term["values"], serde_json::json!([region]), "{dir} {}: placement", name(o));
            }
            let provider = objects
                .iter()
                .find(|o| {
                    kind(o) == "ConfigMap" && o["metadata"]["name"].as_str().unwrap().starts_with("reviewlane-provider")
                })
                .unwrap();
            assert_eq!(provider["data"]["REVIEWLANE_PROVIDER_REGION"], region, "{dir}");
            let regional = objects
                .iter()
                .find(|o| {
                    kind(o) == "ConfigMap" && o["metadata"]["name"].as_str().unwrap().starts_with("reviewlane-region")
                })
                .unwrap();
            assert_eq!(regional["data"]["REVIEWLANE_REGION"], region);
            // The layout is provisioning's alone: the services' config carries none of it.
            let layout = objects
                .iter()
                .find(|o| {
                    kind(o) == "ConfigMap" && o["metadata"]["name"].as_str().unwrap().starts_with("reviewlane-layout")
                })
                .unwrap_or_else(|| panic!("{dir}: no layout config"));
            assert_eq!(layout["data"]["REVIEWLANE_STREAM_REPLICAS"], "3");
            for name in reviewlane_core::env::LAYOUT {
                assert!(regional["data"][name].is_null(), "{dir}: {name} in the services' region config");
            }
            let job = objects.iter().find(|o| kind(o) == "Job").unwrap_or_else(|| panic!("{dir}: no provisioning job"));
            let env_from = job["spec"]["template"]["spec"]["containers"][0]["envFrom"].to_string();
            assert!(env_from.contains("reviewlane-layout"), "{dir}: the provisioning job reads the layout");
            for pdb in ["reviewlane-extractor", "reviewlane-publisher", "nats"] {
                assert!(
                    objects.iter().any(|o| kind(o) == "PodDisruptionBudget" && o["metadata"]["name"] == pdb),
                    "{dir}: PDB {pdb}"
                );
            }
            let sts = objects.iter().find(|o| kind(o) == "StatefulSet").unwrap();
            assert_eq!(sts["spec"]["replicas"], 3, "{dir}: NATS nodes");
            // The Go runtime collects before the container is killed: its heap limit is
            // below the container's memory limit.
            let nats = &sts["spec"]["template"]["spec"]["containers"][0];
            let limit = bytes(nats["resources"]["limits"]["memory"].as_str().unwrap());
            let go = nats["env"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == "GOMEMLIMIT")
                .and_then(|e| e["value"].as_str())
                .unwrap_or_else(|| panic!("{dir}: NATS sets no GOMEMLIMIT"));
            let go = bytes(&go.replace("iB", "i"));
            assert!(go < limit && go >= limit / 2, "{dir}: GOMEMLIMIT {go} against a {limit}-byte limit");
            let scaled = objects.iter().find(|o| kind(o) == "ScaledObject").unwrap();
            assert!(
                scaled["spec"]["maxReplicaCount"].as_u64().unwrap() <= 4,
                "{dir}: beyond what the provider key can use"
            );
        }
        // The ingress reaches both regions' NATS and DNS, nothing else.
        if dir == "k8s/ingress" {
            let np = objects
                .iter()
                .find(|o| kind(o) == "NetworkPolicy" && o["metadata"]["name"] == "reviewlane-ingress")
                .unwrap();
            let namespaces: Vec<&str> = np["spec"]["egress"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|rule| rule["to"].as_array().unwrap())
                .map(|peer| peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"].as_str().unwrap())
                .collect();
            assert_eq!(namespaces, ["reviewlane-us", "reviewlane-eu", "kube-system"]);
        }
    }
}

#[test]
fn the_operator_rules_are_the_rules_promtool_tests() {
    let plain: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(root().join("k8s/alerts/reviewlane-rules.yaml")).unwrap())
            .unwrap();
    let (_, objects) = render("k8s/monitoring");
    let rule = objects.iter().find(|o| kind(o) == "PrometheusRule").unwrap();
    assert_eq!(rule["spec"]["groups"], serde_json::to_value(&plain["groups"]).unwrap());
}

/// Kubernetes quantities and NATS sizes, in bytes (`20Gi`, `18GB`: the decimal reading
/// for NATS's `GB`, the smaller of the two, so the check errs on the safe side).
fn bytes(q: &str) -> u64 {
    let (n, unit) = q.trim().split_at(q.trim().find(|c: char| !c.is_ascii_digit()).unwrap_or(q.trim().len()));
    let n: u64 = n.parse().unwrap();
    n * match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => panic!("unit {other}"),
    }
}

#[test]
fn every_regions_stream_byte_limits_fit_its_nats_nodes() {
    // JetStream reserves each byte-limited stream's limit on every node holding a
    // replica: both lanes, the results stream and its object store.
    let defaults = reviewlane_shared::layout::LayoutConfig::default();
    for dir in ["k8s/regions/us", "k8s/regions/eu"] {
        let (_, objects) = render(dir);
        let region = objects
            .iter()
            .find(|o| kind(o) == "ConfigMap" && o["data"]["REVIEWLANE_STREAM_REPLICAS"].is_string())
            .unwrap_or_else(|| panic!("{dir}: no layout config"));
        let limit = |var: &str, default: i64| {
            region["data"][var].as_str().map_or(default as u64, |v| v.parse::<u64>().unwrap())
        };
        let reserved = 2 * limit("REVIEWLANE_LANE_MAX_BYTES", defaults.lane_max_bytes)
            + 2 * limit("REVIEWLANE_FINDINGS_MAX_BYTES", defaults.findings_max_bytes);
        let conf = objects
            .iter()
            .find_map(|o| o["data"]["nats.conf"].as_str())
            .unwrap_or_else(|| panic!("{dir}: no nats.conf"));
        let store = conf
            .lines()
            .find_map(|l| l.trim().strip_prefix("max_file_store:"))
            .map(bytes)
            .unwrap_or_else(|| panic!("{dir}: nats.conf sets no max_file_store"));
        assert!(reserved <= store, "{dir}: streams reserve {reserved} bytes, max_file_store is {store}");
        let volume = objects
            .iter()
            .find(|o| kind(o) == "StatefulSet")
            .and_then(|s| s["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"].as_str())
            .map(bytes)
            .unwrap_or_else(|| panic!("{dir}: no NATS volume"));
        assert!(store <= volume, "{dir}: max_file_store {store} is larger than the volume {volume}");
    }
}
