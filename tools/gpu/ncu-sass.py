#!/usr/bin/env python3
"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute source page.

Make the page on the GPU machine (sampling needs a full or source-counter section set):
  ncu --set full --import-source no --kernel-name regex:NAME --launch-count 1 -o rep PROGRAM ...
  ncu -i rep.ncu-rep --page source --print-source sass --csv > rep-sass.csv
then here:
  ncu-sass.py rep-sass.csv [KERNEL] [--top N]   opcodes and stall reasons, the N hottest lines
  ncu-sass.py rep-sass.csv KERNEL --groups      samples by execution count: code that runs once
                                                 a CTA (set-up, epilogue) shows as its own group
  ncu-sass.py rep-sass.csv KERNEL --exec C      the lines executed exactly C times
KERNEL is a substring of the kernel name (the first kernel of the page by default); a page of
several launches of one kernel is read at its first.
Session 27 found the MoE wgmma kernels' store epilogue this way (bench/results/gpu-moe-s27-h200.txt).
"""
import argparse
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXEC = "Instructions Executed"


def num(x):
    try:
        return float(x.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def kernels(path):
    """[(name, header, rows)] in page order."""
    out, hdr = [], None
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "Kernel Name":
                out.append([r[1], None, []])
                hdr = None
            elif r[0] == "Address" and out:
                hdr = r
                out[-1][1] = r
            elif hdr and out:
                out[-1][2].append(dict(zip(hdr, r)))
    return out


def opcode(src):
    m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_.]+)", src)
    return (m.group(2) if m else "?").split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page")
    ap.add_argument("kernel", nargs="?", default="")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--groups", action="store_true")
    ap.add_argument("--exec", type=int, dest="exec_count")
    a = ap.parse_args()
    found = [k for k in kernels(a.page) if a.kernel in k[0]]
    if not found:
        sys.exit(f"{a.page}: no kernel matching {a.kernel!r}")
    name, hdr, rows = found[0]
    if hdr is None or SAMPLES not in hdr:
        sys.exit(f"{a.page}: {name} has no stall samples (profile with --set full)")
    tot = sum(num(r[SAMPLES]) for r in rows) or 1.0
    inst = sum(num(r[EXEC]) for r in rows) or 1.0
    stalls = [c for c in hdr if c.startswith("stall_") and "Not Issued" not in c]
    print(f"== {name}: {len(rows)} SASS lines, {inst / 1e6:.3f} M warp instructions, {tot:.0f} samples")
    if a.groups or a.exec_count is not None:
        by = collections.defaultdict(list)
        for r in rows:
            by[int(num(r[EXEC]))].append(r)
        if a.exec_count is None:
            for c, rs in sorted(by.items(), key=lambda kv: -sum(num(r[SAMPLES]) for r in kv[1]))[: a.top]:
                s = sum(num(r[SAMPLES]) for r in rs)
                print(f"  executed {c:>10}: {len(rs):>5} lines, {s / tot * 100:5.1f}% of samples")
            return
        rows = by.get(a.exec_count, [])
        print(f"  {len(rows)} lines executed {a.exec_count} times, "
              f"{sum(num(r[SAMPLES]) for r in rows) / tot * 100:.1f}% of samples")
    ops, opss = collections.Counter(), collections.Counter()
    for r in rows:
        ops[opcode(r["Source"])] += num(r[EXEC])
        opss[opcode(r["Source"])] += num(r[SAMPLES])
    print("  opcodes by executed:", ", ".join(f"{k} {v / inst * 100:.1f}%" for k, v in ops.most_common(14)))
    print("  opcodes by samples: ", ", ".join(f"{k} {v / tot * 100:.1f}%" for k, v in opss.most_common(10)))
    st = {c: sum(num(r[c]) for r in rows) for c in stalls}
    print("  stalls:", ", ".join(f"{k[6:]} {v / tot * 100:.1f}%" for k, v in sorted(st.items(), key=lambda x: -x[1])[:10]))
    for r in sorted(rows, key=lambda r: -num(r[SAMPLES]))[: a.top]:
        s = num(r[SAMPLES])
        why = sorted(((num(r[c]), c[6:]) for c in stalls), reverse=True)[:3]
        print(f"  {s / tot * 100:5.1f}% x{num(r[EXEC]) / 1e3:9.1f}k  {r['Source'].strip()[:64]:64s} "
              + " ".join(f"{c}:{v:.0f}" for v, c in why if v))


if __name__ == "__main__":
    main()
