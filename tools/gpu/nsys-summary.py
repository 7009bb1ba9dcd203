#!/usr/bin/env python3
"""Per-kernel device time of the decode steps of an `nsys profile --cuda-graph-trace=node` run,
from `nsys stats --report cuda_gpu_trace --format csv` output (stdin or a file).

Decode = every kernel after the last prefill GEMM kernel (names starting `gemm`/`gm_`); the
first decode step therefore carries the head of the prefill chunk (a few launches). Prints
kernel time, idle gaps between consecutive kernels, and a per-kernel table sorted by time.
With a third argument `prefill`, summarises the kernels up to the last prefill GEMM instead.
Usage: nsys-summary.py trace.csv [steps] [prefill]"""
import csv, sys, collections

src = open(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "-" else sys.stdin
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 0
lines = [l for l in src if l.strip()]
# nsys may print notes before the CSV header.
start = next(i for i, l in enumerate(lines) if "Start" in l and "Duration" in l)
rows = list(csv.DictReader(lines[start:]))
def col(r, *names):
    for n in names:
        for k in r:
            if k.startswith(n):
                return r[k]
    raise KeyError(names)
ks = []
for r in rows:
    name = col(r, "Name")
    try:
        t0, dur = int(float(col(r, "Start"))), int(float(col(r, "Duration")))
    except ValueError:
        continue
    # Memcpy/memset rows have no grid; keep only kernels (they have a grid column value).
    try:
        grid = col(r, "GrdX")
    except KeyError:
        grid = "1"
    if not grid or grid == "":
        continue
    ks.append((t0, dur, name))
ks.sort()
last = max((i for i, k in enumerate(ks) if k[2].startswith(("gemm", "gm_"))), default=-1)
dec = ks[:last + 1] if sys.argv[3:4] == ["prefill"] else ks[last + 1:]
if not dec:
    sys.exit("no decode kernels found")
span = dec[-1][0] + dec[-1][1] - dec[0][0]
busy = sum(d for _, d, _ in dec)
gaps = [max(0, b[0] - (a[0] + a[1])) for a, b in zip(dec, dec[1:])]
small = sum(g for g in gaps if g < 100_000)  # gaps > 100 us: host sampling between steps
print(f"decode kernels: {len(dec)}  span {span/1e6:.3f} ms  busy {busy/1e6:.3f} ms  "
      f"gaps<100us {small/1e6:.3f} ms  gaps>=100us {(sum(gaps)-small)/1e6:.3f} ms "
      f"({sum(1 for g in gaps if g >= 100_000)} of them)")
if steps:
    print(f"per step: {span/steps/1e3:.1f} us span, {busy/steps/1e3:.1f} us busy, "
          f"{len(dec)/steps:.0f} kernels, {small/steps/1e3:.1f} us small gaps, "
          f"{(sum(gaps)-small)/steps/1e3:.1f} us big gaps")
agg = collections.defaultdict(lambda: [0, 0])
for _, d, n in dec:
    a = agg[n.split("(")[0]]
    a[0] += 1; a[1] += d
print(f"{'kernel':40s} {'calls':>7s} {'total ms':>9s} {'share':>6s} {'avg us':>8s}")
for n, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{n[:40]:40s} {c:7d} {t/1e6:9.3f} {100*t/busy:5.1f}% {t/c/1e3:8.2f}")
