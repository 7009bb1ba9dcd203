#!/usr/bin/env bash
# Every test of the project, as README.md and .ci/run run it:
#   1. installs the run-time kernel compilers (NVRTC wheel, Debian hipRTC) so the GPU
#      portability test compiles every kernel instead of skipping;
#   2. cargo test --workspace --release (GPU device tests skip, saying why, without a GPU);
#   3. the official openai + anthropic Python SDKs against `ds4 serve` (own venv).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== run-time kernel compilers (NVRTC wheel, Debian hipRTC)"
bash tools/gpu/ci-install.sh
# With the compilers installed, a missing one is a failure, not a skip.
export DS4_REQUIRE_COMPILERS=1

echo "== cargo test --workspace --release"
cargo test --workspace --release

echo "== SDK tests (official openai + anthropic Python SDKs against ds4 serve on the tiny model)"
DS4_BIN="${CARGO_TARGET_DIR:-target}/release/ds4" bash crates/ds4-server/tests/sdk/run.sh
