#!/usr/bin/env bash
# Packs binaries for the GPU machine (device tool, no cargo there) into DIR/pack.tar.xz:
# the files given (stripped; one must be the `ds4` binary) plus the kernels precompiled for the
# H200 (`ds4 kernels --target sm_90a`) with NVRTC 13.0, that machine's version (the cache key
# holds it), so the first start there loads every module instead of spending ~60 s of device
# time compiling. xz makes the carry ~4-8x smaller. On the GPU machine: `. tools/gpu/unpack.sh DIR`.
# NVRTC 13.0: `pip download nvidia-cuda-nvrtc==13.0.48 --no-deps` and unzip; DEVBIN_NVRTC names
# its lib folder (default /work/nvrtc130/nvidia/cu13/lib). DEVBIN_KCACHE is the cache kept
# between packs (unchanged modules are not recompiled). DEVBIN_KVARIANTS="DS4_GPU_L2_STREAM=1 ..."
# also precompiles the kernels under each of those settings (compile defines: the cache keys
# keep the forms apart), for A/B runs of a define-switched form.
# Usage: tools/gpu/pack-devbin.sh DIR FILE...
set -euo pipefail
out=$1; shift
rm -rf "$out" && mkdir -p "$out"
cp "$@" "$out/"
strip "$out"/* 2>/dev/null || true
nv=${DEVBIN_NVRTC:-/work/nvrtc130/nvidia/cu13/lib}
if [ -f "$nv/libnvrtc.so.13" ] && [ -x "$out/ds4" ]; then
  kc=${DEVBIN_KCACHE:-/work/kcache}
  prune=--prune # the plain form first: stale entries go before the variants are added
  for v in "" ${DEVBIN_KVARIANTS:-}; do
    env $v LD_LIBRARY_PATH="$nv" DS4_NVRTC_LIB="$nv/libnvrtc.so.13" "$out/ds4" kernels --target sm_90a \
      --cache "$kc" $prune | grep -v cached || true
    prune=
  done
  mkdir -p "$out/kcache" && cp "$kc"/*-sm_90a-*.cubin.ds4 "$out/kcache/"
else
  echo "pack-devbin: no NVRTC 13.0 at $nv (or no ds4 binary): kernels compile on the GPU machine"
fi
# -9e: its 64 MiB dictionary finds the kernel variants' repeats (a pack with three variants:
# 24.5 MB at -6, 11.6 MB at -9e; the device tool carries at most 64 MiB with the tree).
(cd "$out" && tar cf - --remove-files -- * | xz -T2 -9e > .pack.tmp && mv .pack.tmp pack.tar.xz)
du -sh "$out"
