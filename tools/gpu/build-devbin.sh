#!/usr/bin/env bash
# Builds, in a clean clone of HEAD, what a GPU machine without cargo needs to run the GPU tests
# and benchmarks: the `ds4` binary and the ds4-gpu test executables, stripped, into .devbin/
# (ignored by git; carried to the device with `carry: [".devbin"]`).
# The kernels are compiled here too (`ds4 kernels --target sm_90a`) with NVRTC 13.0, the H200
# machine's version (the cache key holds it), so the GPU machine loads them instead of spending
# ~60 s of device time compiling; then everything is packed into .devbin/pack.tar.xz (~4x
# smaller; tools/gpu/device-suite.sh unpacks it). NVRTC 13.0: `pip download
# nvidia-cuda-nvrtc==13.0.48 --no-deps` and unzip; DEVBIN_NVRTC names its lib folder.
# DEVBIN_TESTS="gpu_forward ops_attn" keeps only those test binaries (default: all).
# Usage: tools/gpu/build-devbin.sh
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
src=${DEVBIN_CLONE:-/tmp/devbuild}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-dev}
rm -rf "$src" && git clone -q "$repo" "$src"
cd "$src"
cargo build --release -p ds4-cli
out="$repo/.devbin"
rm -rf "$out" && mkdir -p "$out"
cp "$CARGO_TARGET_DIR/release/ds4" "$out/ds4"
cargo test --release -p ds4-gpu -p ds4-engine --no-run --message-format=json 2>/dev/null \
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
if [ -n "${DEVBIN_TESTS:-}" ]; then
  for f in "$out"/t-*; do
    n=${f##*/t-}; case " $DEVBIN_TESTS " in *" $n "*) ;; *) rm -f "$f" ;; esac
  done
fi
strip "$out"/* || true
nv=${DEVBIN_NVRTC:-/work/nvrtc130/nvidia/cu13/lib}
if [ -f "$nv/libnvrtc.so.13" ]; then
  kc=${DEVBIN_KCACHE:-/work/kcache}   # kept between builds: unchanged modules are not recompiled
  LD_LIBRARY_PATH="$nv" DS4_NVRTC_LIB="$nv/libnvrtc.so.13" "$out/ds4" kernels --target sm_90a \
    --cache "$kc" --prune
  mkdir -p "$out/kcache" && cp "$kc"/*-sm_90a-*.cubin "$out/kcache/"
else
  echo "no NVRTC 13.0 at $nv: kernels will compile on the GPU machine"
fi
(cd "$out" && tar cf - --remove-files -- * | xz -T2 -6 > ../pack.tar.xz && mv ../pack.tar.xz .)
grep -qx '/.devbin/' "$repo/.git/info/exclude" || echo '/.devbin/' >> "$repo/.git/info/exclude"
du -sh "$out"; ls "$out"
echo "commit: $(git rev-parse --short HEAD)"
