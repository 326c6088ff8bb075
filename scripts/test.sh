#!/usr/bin/env bash
# The whole test suite: installs nats-server 2.12+, promtool, kustomize, checkov,
# kubernetes-validate and buf if missing, checks
# formatting and lints, checks and unit-tests the Prometheus alert rules, then runs
# every unit and integration test (real nats-server processes on free loopback ports;
# never 4222).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
nats_dir="$(bash scripts/install-deps.sh | tail -n1)"
export NATS_SERVER_BIN="$nats_dir/nats-server"
echo "using $("$NATS_SERVER_BIN" --version)"
if rustup component list --installed 2>/dev/null | grep -q '^rustfmt'; then
  cargo fmt --all --check
fi
promtool="$(bash scripts/install-promtool.sh | tail -n1)"
"$promtool" check rules k8s/alerts/reviewlane-rules.yaml
"$promtool" test rules k8s/alerts/reviewlane-rules.test.yaml
# Offline Kubernetes checks (tests/it/kubernetes.rs) find their tools here.
export REVIEWLANE_K8S_TOOLS="$(bash scripts/install-k8s-tools.sh | tail -n1)"
# buf lint and buf breaking of the API (tests/it/proto_api.rs).
export REVIEWLANE_BUF="$(bash scripts/install-buf.sh | tail -n1)"
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked "$@"
