#!/usr/bin/env bash
# Makes the offline Kubernetes checks' tools available (tests/it/kubernetes.rs):
# kustomize (`kubectl kustomize` from a kubectl on PATH, else a standalone kustomize,
# fetched from Debian trixie into .tools/ when there is none), and a Python virtualenv in .tools/venv with checkov
# (policy checks) and kubernetes-validate (schemas of the Kubernetes API), pinned.
# Prints the virtualenv's bin directory last.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
log() { echo "install-k8s-tools: $*" >&2; }
mkdir -p "$tools"

# kustomize renders the package: a kubectl on PATH has it built in; else Debian
# trixie's standalone kustomize (Debian 12 has none recent enough).
if ! command -v kubectl >/dev/null 2>&1 && ! command -v kustomize >/dev/null 2>&1 \
  && [ ! -x "$tools/usr/bin/kustomize" ]; then
  command -v apt-get >/dev/null || { log "need kubectl or kustomize on PATH, or apt-get to fetch kustomize"; exit 1; }
  log "fetching Debian trixie's kustomize into $tools"
  bash "$root/scripts/fetch-debian.sh" trixie kustomize
fi

venv="$tools/venv"
if [ ! -x "$venv/bin/checkov" ] || [ ! -x "$venv/bin/kubernetes-validate" ]; then
  # Debian and Ubuntu ship Python without venv/ensurepip unless python3-venv is installed.
  if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    command -v apt-get >/dev/null || { log "need python3 with venv"; exit 1; }
    log "installing python3-venv"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3 python3-venv >&2
  fi
  log "installing checkov and kubernetes-validate into .tools/venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "checkov==3.3.30" "kubernetes-validate==1.37.0" >&2
fi
echo "$venv/bin"
