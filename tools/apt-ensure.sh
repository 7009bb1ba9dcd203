#!/usr/bin/env bash
# Usage: tools/apt-ensure.sh TAG PKG...   Installs the Debian packages PKG that are not installed
# yet (sudo where not root), saying which under TAG; nothing when all are there.
set -euo pipefail
tag=$1; shift
missing=""
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
  echo "$tag: Debian packages already installed:$(for p in "$@"; do printf ' %s=%s' "$p" "$(dpkg-query -W -f='${Version}' "$p")"; done)"
  exit 0
fi
echo "$tag: apt-get install$missing"
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO="sudo -E"; fi
$SUDO apt-get update -qq
# shellcheck disable=SC2086 # one word a package
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
