#!/usr/bin/env bash
# Builds, in a clean clone of HEAD, what a GPU machine without cargo needs to run the GPU tests
# and benchmarks: the `ds4` binary and the ds4-gpu test executables, stripped, into .devbin/
# (ignored by git; carried to the device with `carry: [".devbin"]`).
# Then tools/gpu/pack-devbin.sh adds the kernels precompiled for the H200 and packs everything
# into .devbin/pack.tar.xz (tools/gpu/device-suite.sh unpacks it).
# DEVBIN_TESTS="gpu_forward ops_attn" keeps only those test binaries (default: all; none: builds none);
# DEVBIN_OUT=DIR writes there instead of .devbin (one folder per person sharing the tree).
# Usage: tools/gpu/build-devbin.sh
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
src=${DEVBIN_CLONE:-/tmp/devbuild}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-dev}
rm -rf "$src" && git clone -q "$repo" "$src"
cd "$src"
# DEVBIN_PATCH=FILE: a diff (git diff -- your files) applied to the clone, to measure before committing.
if [ -n "${DEVBIN_PATCH:-}" ]; then git apply "$DEVBIN_PATCH"; echo "applied $DEVBIN_PATCH"; fi
cargo build --release -p ds4-cli
out=${DEVBIN_OUT:-$repo/.devbin}
rm -rf "$out" && mkdir -p "$out"
cp "$CARGO_TARGET_DIR/release/ds4" "$out/ds4"
[ "${DEVBIN_TESTS:-}" = none ] || cargo test --release -p ds4-gpu -p ds4-engine --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil, os
out = sys.argv[1]
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["bin"]:
        name = m["target"]["name"]
        shutil.copy(m["executable"], os.path.join(out, "t-" + name))
        print("test binary:", name)
' "$out"
# DEVBIN_EXAMPLES="gemm_bench host_experts_bench": workspace examples built and carried too (as e-<name>).
for e in ${DEVBIN_EXAMPLES:-}; do
  cargo build --release --workspace --example "$e" && cp "$CARGO_TARGET_DIR/release/examples/$e" "$out/e-$e"
done
if [ -n "${DEVBIN_TESTS:-}" ]; then
  for f in "$out"/t-*; do
    n=${f##*/t-}; case " $DEVBIN_TESTS " in *" $n "*) ;; *) rm -f "$f" ;; esac
  done
fi
"$repo/tools/gpu/pack-devbin.sh" "$out.tmp" "$out"/* && rm -rf "$out" && mv "$out.tmp" "$out"
grep -qxF '/.devbin*/' "$repo/.git/info/exclude" || echo '/.devbin*/' >> "$repo/.git/info/exclude"
du -sh "$out"; ls "$out"
echo "commit: $(git rev-parse --short HEAD)"
