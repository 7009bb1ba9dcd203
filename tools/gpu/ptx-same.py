#!/usr/bin/env python3
"""Is a kernel refactor behaviour-preserving? Compare NVRTC's PTX of kernel modules at a git
revision with the working tree's, without a GPU.

PTX that is byte-identical gives the same SASS (ptxas is deterministic), so a refactor whose PTX
does not change needs no device run. Where it does change, the kernels (.entry) whose bodies
differ are listed. Needs NVRTC 13 (the pip wheel nvidia-cuda-nvrtc; DS4_NVRTC_LIB names
libnvrtc.so.13, default /work/nvrtc130/nvidia/cu13/lib/libnvrtc.so.13; its folder must also
hold libnvrtc-builtins).

Usage: tools/gpu/ptx-same.py REV MODULE... [--arch 90a,80]
  e.g. tools/gpu/ptx-same.py HEAD fused moe        (exit 0: all identical, 1: some differ)
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

KERNELS = "crates/ds4-kernels/gpu"


def nvrtc():
    path = os.environ.get("DS4_NVRTC_LIB", "/work/nvrtc130/nvidia/cu13/lib/libnvrtc.so.13")
    try:
        # The builtins library is found next to libnvrtc only through the loader's path.
        ctypes.CDLL(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        sys.exit(f"ptx-same: cannot load NVRTC {path}: {e} (set DS4_NVRTC_LIB)")


def ptx(lib, gpu_dir, module, arch):
    """PTX of gpu_dir/module.cu for compute_<arch> with the defines the host passes."""
    src = open(os.path.join(gpu_dir, module + ".cu"), "rb").read()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, (module + ".cu").encode(), 0, None, None):
        sys.exit("ptx-same: nvrtcCreateProgram failed")
    digits = arch.rstrip("a")
    opts = [
        f"--gpu-architecture=compute_{arch}",
        "-DDS4_CUDA=1",
        "-DDS4_WARP=32",
        f"-DDS4_ARCH={int(digits) * 10}",
        f"-I{gpu_dir}",
        "-default-device",
        "--std=c++17",
    ]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    ok = lib.nvrtcCompileProgram(prog, len(opts), arr) == 0
    if not ok:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(f"ptx-same: {module}.cu ({gpu_dir}, compute_{arch}) does not compile:\n{log.value.decode()[:4000]}")
    n = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    out = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, out)
    return out.value.decode()


def entries(text):
    """Kernel name -> its PTX body (from `.entry name(` to the next `.entry` or the end)."""
    parts = re.split(r"(?m)^\.(?:visible|weak)?\s*\.entry\s+", text)
    out = {}
    for p in parts[1:]:
        name = p.split("(", 1)[0].strip()
        out[name] = p
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="git revision to compare the working tree with")
    ap.add_argument("modules", nargs="+", help="module names (fused, moe, matvec, ...)")
    ap.add_argument("--arch", default="90a,80", help="comma-separated compute archs (default 90a,80)")
    a = ap.parse_args()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    lib = nvrtc()
    differ = False
    with tempfile.TemporaryDirectory() as tmp:
        # The revision's kernel folder (headers included), as `git archive` gives it.
        arch_tar = subprocess.run(["git", "-C", root, "archive", a.rev, KERNELS], capture_output=True, check=True).stdout
        subprocess.run(["tar", "xf", "-", "-C", tmp], input=arch_tar, check=True)
        old_dir, new_dir = os.path.join(tmp, KERNELS), os.path.join(root, KERNELS)
        for m in a.modules:
            for arch in a.arch.split(","):
                old, new = ptx(lib, old_dir, m, arch), ptx(lib, new_dir, m, arch)
                if old == new:
                    print(f"{m} compute_{arch}: PTX identical ({len(new)} bytes)")
                    continue
                differ = True
                eo, en = entries(old), entries(new)
                changed = sorted(k for k in set(eo) | set(en) if eo.get(k) != en.get(k))
                print(f"{m} compute_{arch}: PTX differs in {len(changed)} of {len(en)} kernels: {', '.join(changed[:20])}"
                      + (" ..." if len(changed) > 20 else ""))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
