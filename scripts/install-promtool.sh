#!/usr/bin/env bash
# Makes `promtool` (Prometheus's rule checker) available for the alert-rule checks:
# the one on PATH, else the Debian/Ubuntu `prometheus` package unpacked into .tools/
# (downloaded, not installed: no service is set up). Prints promtool's path last.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
log() { echo "install-promtool: $*" >&2; }

if [ -x "$tools/usr/bin/promtool" ]; then echo "$tools/usr/bin/promtool"; exit 0; fi
if command -v promtool >/dev/null 2>&1; then command -v promtool; exit 0; fi
if [ "$(uname)" = Darwin ]; then brew install prometheus >&2; command -v promtool; exit 0; fi
command -v apt-get >/dev/null || { log "need apt-get (Debian/Ubuntu) or promtool on PATH"; exit 1; }

dl="$tools/apt-prometheus"
mkdir -p "$dl"
if ! (cd "$dl" && apt-get download prometheus >&2); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  (cd "$dl" && apt-get download prometheus >&2)
fi
deb="$(ls -t "$dl"/prometheus_*.deb | head -n1)"
dpkg -x "$deb" "$tools"
log "$("$tools/usr/bin/promtool" --version 2>&1 | head -n1)"
echo "$tools/usr/bin/promtool"
