#!/usr/bin/env bash
# Installs what reviewlane's local stack and tests need and is not yet on the machine:
# nats-server 2.12 or newer (2.10 and 2.11 work, but keep each stream's flushed write
# cache until it expires: docs/operations.md, "NATS memory"). When the machine has
# none, it fetches Debian forky's package (2.15) through a private apt sources list and
# unpacks it into .tools/ of this checkout, without touching the system's sources;
# should that fail, Debian trixie's 2.10. Prints the directory holding nats-server on
# its last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
mkdir -p "$tools"

at_least() { # MAJOR MINOR LOWEST_MINOR_OF_2: is MAJOR.MINOR at least 2.LOWEST?
  [ "$1" -gt 2 ] || { [ "$1" -eq 2 ] && [ "$2" -ge "$3" ]; }
}

version_ok() { # $1 = path to nats-server, $2 = lowest minor of 2.x (default 12)
  local v
  v="$("$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p')"
  [ -n "$v" ] || return 1
  at_least $v "${2:-12}"
}

log() { echo "install-deps: $*" >&2; }

# A C compiler: ring (TLS for NATS and HTTPS) builds a little C. Rust's own
# installation usually brought one.
if ! command -v cc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  log "installing a C compiler (build-essential)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq build-essential >&2
fi

if [ -x "$tools/usr/sbin/nats-server" ] && version_ok "$tools/usr/sbin/nats-server"; then
  echo "$tools/usr/sbin"; exit 0
fi
if command -v nats-server >/dev/null 2>&1 && version_ok "$(command -v nats-server)"; then
  dirname "$(command -v nats-server)"; exit 0
fi

if [ "$(uname)" = Darwin ]; then
  brew install nats-server >&2
  dirname "$(command -v nats-server)"; exit 0
fi
command -v apt-get >/dev/null || { log "need apt-get (Debian/Ubuntu) or a nats-server >= 2.12 on PATH"; exit 1; }
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

# The distribution's own package first, when it is new enough.
$SUDO apt-get update -qq >&2 || true
cand="$(apt-cache policy nats-server 2>/dev/null | sed -n 's/.*Candidate: *\([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p')"
if [ -n "$cand" ] && at_least $cand 12; then
  log "installing nats-server from the distribution"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nats-server >&2
  dirname "$(command -v nats-server)"; exit 0
fi

# Otherwise: Debian forky's package (trixie's if forky's cannot be had), through a
# private sources list, unpacked into .tools/.
log "distribution nats-server too old or missing; fetching Debian forky's package into $tools"
if ! { bash "$root/scripts/fetch-debian.sh" forky nats-server && version_ok "$tools/usr/sbin/nats-server"; }; then
  log "forky's nats-server unavailable; fetching Debian trixie's (2.10)"
  bash "$root/scripts/fetch-debian.sh" trixie nats-server
fi
version_ok "$tools/usr/sbin/nats-server" 10 || { log "unpacked nats-server is not >= 2.10"; exit 1; }
log "$("$tools/usr/sbin/nats-server" --version)"
echo "$tools/usr/sbin"
