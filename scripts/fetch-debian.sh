#!/usr/bin/env bash
# Usage: fetch-debian.sh <suite> <package>
# Unpacks Debian <suite>'s package <package> into .tools/ of this checkout, through a
# private apt sources list (the system's sources and installed packages are not
# touched): for tools whose Debian 12 package is too old or missing (nats-server from
# forky, kustomize from trixie). Both are static Go binaries.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
suite="$1"
pkg="$2"
apt_dir="$tools/apt-$suite"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial"
echo "deb http://deb.debian.org/debian $suite main" > "$apt_dir/sources.list"
opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
      -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::archives=$apt_dir/archives"
      -o "APT::Get::List-Cleanup=0")
apt-get "${opts[@]}" update -qq >&2
(cd "$apt_dir" && apt-get "${opts[@]}" download "$pkg" >&2)
dpkg -x "$(ls -t "$apt_dir/${pkg}"_*.deb | head -n1)" "$tools"
