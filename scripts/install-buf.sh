#!/usr/bin/env bash
# Installs buf (the Protobuf linter and breaking-change checker) into .tools/buf from the
# npm registry when it is missing; prints the binary's path as the last line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=1.75.0
dir=.tools/buf
bin="$dir/node_modules/.bin/buf"
if [[ -x "$bin" ]] && [[ "$("$bin" --version 2>/dev/null)" == "$version" ]]; then
  echo "$PWD/$bin"
  exit 0
fi
if ! command -v npm >/dev/null; then
  echo "install-buf: npm missing; installing Debian's nodejs and npm" >&2
  sudo_cmd=""
  [[ "$(id -u)" -ne 0 ]] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq >&2
  $sudo_cmd apt-get install -y -qq nodejs npm >&2
fi
mkdir -p "$dir"
npm install --silent --no-audit --no-fund --prefix "$dir" "@bufbuild/buf@$version" >&2
"$bin" --version >&2
echo "$PWD/$bin"
