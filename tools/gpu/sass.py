#!/usr/bin/env python3
"""SASS of kernel modules without a GPU: `ds4 kernels` compiles a module with NVRTC into a scratch
cache, the entry's seal (code, SHA-256, 8-byte magic: crates/ds4-gpu/src/cache.rs) is cut off and
nvdisasm (pip wheel nvidia-cuda-nvdisasm) prints the code.

  tools/gpu/sass.py MODULE [KERNEL_SUBSTRING] [--arch sm_90a] [--ds4 BIN] [--full] [--env K=V ...]

Prints, per kernel whose name contains KERNEL_SUBSTRING: its instruction count, registers (the
cubin's .text section info) and local-memory instructions (STL/LDL: spills), its loops (a
backward branch's target .. the branch: instructions in that span and their mix by opcode), and
with --full the whole listing. --env sets an environment variable for the compile (kernel
variants keyed by a define, e.g. DS4_GPU_L2_STREAM=1).
Needs LD_LIBRARY_PATH / DS4_NVRTC_LIB pointing at an NVRTC 13 (13.0 is what the H200 machine runs).
"""
import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

MAGIC_LEN = 8 + 32  # ds4kc magic + SHA-256 after the code object


def find_nvdisasm():
    for cand in [os.environ.get("NVDISASM"), shutil.which("nvdisasm")]:
        if cand and os.path.exists(cand):
            return cand
    try:
        import nvidia  # the pip wheels' namespace package

        for root in nvidia.__path__:
            for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
                p = os.path.join(root, sub)
                if os.path.exists(p):
                    return p
    except ImportError:
        pass
    sys.exit("sass.py: no nvdisasm (pip install nvidia-cuda-nvdisasm==13.*, or NVDISASM=PATH)")


def cubin_regs(raw):
    """Registers per kernel: the EIATTR_REGCOUNT (0x2f) records of the cubin's `.nv.info`
    section, each (symbol index, count), the symbol named by `.symtab` (ELF64)."""
    import struct

    shoff, = struct.unpack_from("<Q", raw, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", raw, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", raw, shoff + i * shentsize) for i in range(shnum)]

    def cstr(base, off):
        return raw[base + off:raw.index(b"\0", base + off)].decode()

    by_name = {cstr(secs[shstrndx][4], sec[0]): sec for sec in secs}
    symtab = by_name.get(".symtab")
    info = by_name.get(".nv.info")
    if symtab is None or info is None:
        return {}
    strtab = secs[symtab[6]][4]
    syms = [cstr(strtab, struct.unpack_from("<I", raw, symtab[4] + i * 24)[0]) for i in range(symtab[5] // 24)]
    regs = {}
    o, end = info[4], info[4] + info[5]
    while o < end:  # records: format byte, attribute byte, then (format 4) a u16 size and payload
        fmt, attr, size = struct.unpack_from("<BBH", raw, o)
        if fmt != 4:
            o += 4
            continue
        if attr == 0x2F:
            sym, count = struct.unpack_from("<II", raw, o + 4)
            regs[syms[sym]] = count
        o += 4 + size
    return regs


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module")
    ap.add_argument("kernel", nargs="?", default="")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--ds4", default=os.environ.get("DS4_BIN", "target/release/ds4"))
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--env", action="append", default=[])
    a = ap.parse_args()
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    nvd = find_nvdisasm()
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([a.ds4, "kernels", "--target", a.arch, "--module", a.module, "--cache", d],
                           env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"sass.py: ds4 kernels failed:\n{r.stdout}{r.stderr}")
        entries = [f for f in os.listdir(d) if f.startswith(a.module + "-") and f.endswith(".cubin.ds4")]
        if len(entries) != 1:
            sys.exit(f"sass.py: expected one cache entry for {a.module}, found {entries}")
        raw = open(os.path.join(d, entries[0]), "rb").read()
        cubin = os.path.join(d, "m.cubin")
        open(cubin, "wb").write(raw[:-MAGIC_LEN])
        text = subprocess.run([nvd, "-c", cubin], capture_output=True, text=True, check=True).stdout
        regs = cubin_regs(raw[:-MAGIC_LEN])
    # Split by function: `.text.<name>:` section headers.
    funcs = collections.OrderedDict()
    cur = None
    for line in text.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\S+?),", line) or re.match(r"^\.text\.(\S+):", line)
        if m:
            cur = m.group(1)
            funcs.setdefault(cur, [])
            continue
        if cur is not None:
            funcs[cur].append(line)
    ins_re = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
    for name, lines in funcs.items():
        if a.kernel not in name:
            continue
        ins = []  # (address, text)
        labels = {}
        for line in lines:
            lm = re.match(r"^\.(L_x_\d+):", line.strip())
            if lm:
                labels[lm.group(1)] = len(ins)  # index of the label's first instruction
                continue
            m = ins_re.search(line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2).strip()))
        local = sum(1 for _, t in ins if re.search(r"\b(STL|LDL)\b", t))
        print(f"== {name}: {len(ins)} instructions, {regs.get(name, '?')} registers, {local} STL/LDL")
        for i, (_, t) in enumerate(ins):
            bm = re.search(r"\bBRA\b.*?`?\(?\.(L_x_\d+)\)?", t)
            if bm and labels.get(bm.group(1), i + 1) <= i:
                s = labels[bm.group(1)]
                span = ins[s:i + 1]
                ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for _, x in span)
                mix = " ".join(f"{k}:{v}" for k, v in ops.most_common(14))
                print(f"   loop {bm.group(1)} [{s}..{i}]: {len(span)} instructions; {mix}")
        if a.full:
            for adr, t in ins:
                print(f"   {adr:05x}  {t}")


if __name__ == "__main__":
    main()
