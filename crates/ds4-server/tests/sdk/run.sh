#!/usr/bin/env bash
# Official openai + anthropic Python SDKs against `ds4 serve` on the tiny synthetic model.
# Usage: crates/ds4-server/tests/sdk/run.sh   (from anywhere; builds target/release/ds4
# unless DS4_BIN points at a binary). Needs python3 with venv and access to PyPI.
# `run.sh --venv-only` only sets up the venv (tools/test-all.sh runs it while the workspace builds).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
bin="${DS4_BIN:-$target/release/ds4}"
work="${DS4_SDK_WORK:-$target/sdk-test}"
mkdir -p "$work"

if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
fi
"$work/venv/bin/pip" install -q --disable-pip-version-check openai anthropic
if [ "${1:-}" = "--venv-only" ]; then
  exit 0
fi
if [ -z "${DS4_BIN:-}" ]; then
  (cd "$root" && cargo build --release -p ds4-cli)
fi

"$bin" synth --preset tiny -o "$work/tiny.gguf" >/dev/null
port="${DS4_SDK_PORT:-$((20000 + RANDOM % 20000))}"
force="$work/force.txt"
: >"$force"
"$bin" serve -m "$work/tiny.gguf" --ctx 4096 --port "$port" --api-key test-key \
  --test-force-output "$force" >"$work/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  if "$work/venv/bin/python" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 $pid 2>/dev/null; then cat "$work/server.log"; exit 1; fi
  sleep 0.2
done
DS4_BASE="http://127.0.0.1:$port" DS4_KEY=test-key DS4_FORCE_FILE="$force" \
  "$work/venv/bin/python" "$here/test_sdk.py" || { echo "--- server log"; tail -20 "$work/server.log"; exit 1; }
