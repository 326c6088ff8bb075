#!/usr/bin/env bash
# Makes the offline Kubernetes checks' tools available (tests/it/kubernetes.rs):
# `kubectl` (for `kubectl kustomize`; the one on PATH, else the Debian/Ubuntu `kubectl`
# package unpacked into .tools/), and a Python virtualenv in .tools/venv with checkov
# (policy checks) and kubernetes-validate (schemas of the Kubernetes API), pinned.
# Prints the virtualenv's bin directory last.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
log() { echo "install-k8s-tools: $*" >&2; }
mkdir -p "$tools"

if ! command -v kubectl >/dev/null 2>&1 && [ ! -x "$tools/usr/bin/kubectl" ]; then
  command -v apt-get >/dev/null || { log "need kubectl on PATH, or apt-get to fetch it"; exit 1; }
  dl="$tools/apt-kubectl"
  mkdir -p "$dl"
  if ! (cd "$dl" && apt-get download kubectl >&2); then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq >&2
    (cd "$dl" && apt-get download kubectl >&2)
  fi
  dpkg -x "$(ls -t "$dl"/kubectl_*.deb | head -n1)" "$tools"
fi

venv="$tools/venv"
if [ ! -x "$venv/bin/checkov" ] || [ ! -x "$venv/bin/kubernetes-validate" ]; then
  log "installing checkov and kubernetes-validate into .tools/venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "checkov==3.3.30" "kubernetes-validate==1.37.0" >&2
fi
echo "$venv/bin"
