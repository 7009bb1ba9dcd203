#!/usr/bin/env bash
# The AArch64 (NEON) CPU kernels, tested on this x86 machine: cross-builds for
# aarch64-unknown-linux-gnu and runs the binaries under qemu-user.
#   1. installs what it needs (idempotent): the Rust target, Debian's qemu-user and the aarch64 C
#      toolchain (the linker and glibc); clippy on ds4-quant for the target (its NEON code);
#   2. ds4-quant's tests: every dot product and int8-activation kernel on the portable and NEON
#      paths against the dequantised f64 references and each other (bit-identical where integer);
#   3. the CPU backend against the HF transformers oracle (ds4-cpu tests/oracle.rs, the first 128
#      positions), so the whole forward pass is checked on AArch64 with the NEON kernels;
#   4. `cargo check` of the whole workspace for aarch64-apple-darwin (macOS on Apple silicon).
# qemu checks results, not speed (it emulates the instructions): no timing here means anything.
# Used by tools/test-all.sh; by hand: bash tools/arm-test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TIMEFORMAT='== %R s wall, %U s user + %S s sys'
TARGET=aarch64-unknown-linux-gnu

echo "== aarch64: toolchain"
if ! rustup target list --installed | grep -qx "$TARGET"; then
  rustup target add "$TARGET"
fi
bash tools/apt-ensure.sh arm-test qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"

echo "== aarch64: clippy (the NEON modules exist only on this target)"
time cargo clippy --release --target "$TARGET" -p ds4-quant --all-targets -- -D warnings

echo "== aarch64: ds4-quant tests under qemu"
# env_var_forces_portable re-runs its own test binary as a child process, which under qemu-user
# starts the emulator instead of the test binary: skipped here (it runs natively in step 2 of
# tools/test-all.sh).
echo "skipped under qemu: env_var_forces_portable (re-executes itself: qemu-user cannot)"
time cargo test --release -p ds4-quant --target "$TARGET" -- --skip env_var_forces_portable

echo "== aarch64: CPU backend against the HF oracle under qemu (first 128 positions)"
# The quantised tiny model (Q8_0 / Q2_K / IQ2_XXS weights through the NEON kernels), one token at
# a time and through the chunked prompt path; all 640 positions take ~20 minutes under qemu.
time DS4_ORACLE_TOKENS=128 cargo test --release -p ds4-cpu --target "$TARGET" --test oracle \
  -- quantised_weights_plain_math_matches_hf chunked_prefill_path_matches_hf --nocapture

echo "== aarch64-apple-darwin: the workspace type-checks for macOS on Apple silicon"
# No macOS machine runs anything here: this only keeps Linux-only calls out of the code that a
# Mac build compiles (the CPU backend on NEON is what runs there; --backend metal is not built).
rustup target list --installed | grep -qx aarch64-apple-darwin || rustup target add aarch64-apple-darwin
time cargo check --release --target aarch64-apple-darwin --workspace --all-targets
