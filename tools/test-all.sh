#!/usr/bin/env bash
# Every test of the project, as README.md and .ci/run run it:
#   1. installs the run-time kernel compilers (NVRTC wheel, Debian hipRTC) so the GPU
#      portability test compiles every kernel instead of skipping;
#   2. cargo test --workspace --release (GPU device tests skip, saying why, without a GPU);
#   3. the AArch64 CPU kernels (NEON) under qemu-user (tools/arm-test.sh);
#   4. the official openai + anthropic Python SDKs against `ds4 serve` (own venv);
#   5. a coding agent's session against `ds4 serve` (tools/agent-serve.sh, stdlib Python): turns
#      continue the live KV session, and after a restart the next turn resumes from the disk cache.
# The SDK venv is installed in the background while 2 builds (network and disk, not the cores).
# Step 2 builds the test targets but not the examples (`cargo clippy --all-targets` in .ci/run
# checks those; no test runs them). Each step prints its wall and CPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
TIMEFORMAT='== %R s wall, %U s user + %S s sys'

echo "== run-time kernel compilers (NVRTC wheel, Debian hipRTC)"
time bash tools/gpu/ci-install.sh
# With the compilers installed, a missing one is a failure, not a skip.
export DS4_REQUIRE_COMPILERS=1

sdk_log="$(mktemp)"
bash crates/ds4-server/tests/sdk/run.sh --venv-only >"$sdk_log" 2>&1 &
sdk_venv=$!

echo "== cargo test --workspace --release"
time cargo test --workspace --release --lib --bins --tests
echo "== cargo test --workspace --release --doc"
time cargo test --workspace --release --doc

echo "== AArch64 (NEON kernels, the CPU backend against the oracle): cross-built, run under qemu-user"
time bash tools/arm-test.sh

echo "== SDK tests (official openai + anthropic Python SDKs against ds4 serve on the tiny model)"
if ! wait "$sdk_venv"; then
  cat "$sdk_log"
  echo "SDK venv set-up failed"
  exit 1
fi
rm -f "$sdk_log"
time DS4_BIN="${CARGO_TARGET_DIR:-target}/release/ds4" bash crates/ds4-server/tests/sdk/run.sh

echo "== agent session (tools/agent-serve.sh on the tiny model, CPU: live and disk KV cache reuse)"
bin_dir="$(cd "${CARGO_TARGET_DIR:-target}/release" && pwd)"
agent_out="$(mktemp -d)"
"$bin_dir/ds4" synth --preset tiny -o "$agent_out/tiny.gguf" >/dev/null
time PATH="$bin_dir:$PATH" OUT="$agent_out" MODEL="-m $agent_out/tiny.gguf" BACKEND=cpu \
  SYSTEM_WORDS=300 TURNS=2 CTX=8192 PORT=$((20000 + RANDOM % 20000)) bash tools/agent-serve.sh
rm -rf "$agent_out"
