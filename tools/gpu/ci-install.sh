#!/usr/bin/env bash
# Installs the run-time kernel compilers that the ds4-gpu portability test uses, without a GPU:
#   NVRTC  from the pip wheel nvidia-cuda-nvrtc (CUDA 13: sm_80, sm_90a, sm_100)
#   hipRTC from Debian's libamdhip64-5 + libhiprtc-builtins5 (ROCm 5.2: gfx90a, gfx1030)
#   clang-19 + the HIP headers (Debian's libamdhip64-dev): offline HIP device compiles for the
#                targets ROCm 5.2 does not know (gfx942, gfx1100)
# Idempotent: each part is skipped when already present. Prints what it did and how long it took.
# Afterwards `DS4_REQUIRE_COMPILERS=1 cargo test -p ds4-gpu --release` must find all three.
set -euo pipefail
t0=$(date +%s)
PY=${PYTHON:-python3}

# --- NVRTC (pip wheel) ---------------------------------------------------------------------
NVRTC_PKG=${DS4_NVRTC_PKG:-nvidia-cuda-nvrtc==13.*}
if "$PY" -m pip show -q nvidia-cuda-nvrtc >/dev/null 2>&1; then
  echo "ci-install: nvrtc: pip package nvidia-cuda-nvrtc already installed ($("$PY" -m pip show nvidia-cuda-nvrtc | sed -n 's/^Version: //p'))"
else
  echo "ci-install: nvrtc: pip install $NVRTC_PKG"
  "$PY" -m pip install -q --disable-pip-version-check "$NVRTC_PKG"
fi
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "ci-install: nvrtc: libraries: $(ls "$site"/nvidia/*/lib/libnvrtc.so* 2>/dev/null | tr '\n' ' ')"

# --- hipRTC (Debian) ---------------------------------------------------------------------------
bash "$(dirname "$0")/../apt-ensure.sh" "ci-install: hip" libamdhip64-5 libhiprtc-builtins5 clang-19 libamdhip64-dev
echo "ci-install: hiprtc: libraries: $(ls /usr/lib/x86_64-linux-gnu/libamdhip64.so* 2>/dev/null | tr '\n' ' ')"
echo "ci-install: clang: $(command -v clang-19 || echo 'clang-19 missing'), HIP headers: $(ls /usr/include/hip/hip_runtime.h 2>/dev/null || echo missing)"
echo "ci-install: done in $(( $(date +%s) - t0 )) s"
