#!/usr/bin/env bash
# Unpacks Debian trixie's package <name> into .tools/ of this checkout, through a private
# apt sources list (the system's sources and installed packages are not touched): for
# tools whose Debian 12 package is too old or missing (nats-server, kustomize).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
pkg="$1"
apt_dir="$tools/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial"
echo "deb http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
      -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::archives=$apt_dir/archives"
      -o "APT::Get::List-Cleanup=0")
apt-get "${opts[@]}" update -qq >&2
(cd "$apt_dir" && apt-get "${opts[@]}" download "$pkg" >&2)
dpkg -x "$(ls -t "$apt_dir/${pkg}"_*.deb | head -n1)" "$tools"
