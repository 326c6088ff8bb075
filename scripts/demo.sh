#!/usr/bin/env bash
# The main job end to end: installs nats-server if missing, builds the services, starts
# two regional nats-servers and the five services, submits the sample diffs (one US and
# one EU tenant) with the built-in analyzer, prints the findings, runs the US review
# again through reviewctl as SARIF, sweeps the ingress's own sources at HEAD through
# `reviewctl sweep` and shows the sweep's progress and items (`reviewctl sweeps get`,
# `sweeps items`), stops everything. `--keep` keeps the working directory (logs, sink
# files, the SARIF files).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
nats_dir="$(bash scripts/install-deps.sh | tail -n1)"
export NATS_SERVER_BIN="$nats_dir/nats-server"
cargo build --quiet --bins -p reviewlane-ingress -p reviewlane-extractor -p reviewlane-publisher \
  -p reviewlane-shared -p loadtest -p reviewctl
exec target/debug/reviewlane-demo "$@"
