#!/usr/bin/env python3
"""Per-kernel table of one decode step from `ncu --page raw --csv --metrics
gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size` output (ds4 with
DS4_GPU_CUPROFILE=K and ncu --profile-from-start off: exactly one step's kernels).
ncu runs kernels one at a time, so the sum is device time without launch gaps; compare with the
step time of the bench to see what the gaps cost. Usage: ncu-summary.py ncu.csv"""
import csv, sys, collections

lines = [l for l in open(sys.argv[1]) if l.strip() and not l.startswith("==")]
start = next(i for i, l in enumerate(lines) if "Kernel Name" in l)
rd = list(csv.reader(lines[start:]))
hdr, rows = rd[0], rd[1:]
ix = {h: i for i, h in enumerate(hdr)}
def num(r, k):
    try:
        return float(r[ix[k]].replace(",", ""))
    except (KeyError, ValueError, IndexError):
        return None
agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
total = 0.0
n = 0
for r in rows:
    t = num(r, "gpu__time_duration.sum")
    if t is None:
        continue  # the units row
    name = r[ix["Kernel Name"]].split("(")[0]
    b = num(r, "dram__bytes_read.sum") or 0.0
    g = num(r, "launch__grid_size") or 0.0
    a = agg[name]
    a[0] += 1; a[1] += t; a[2] += b; a[3] += g
    total += t; n += 1
print(f"kernels {n}, device time {total/1e3:.1f} us (ns units assumed), "
      f"DRAM read {sum(a[2] for a in agg.values())/1e9:.3f} GB")
print(f"{'kernel':36s} {'calls':>5s} {'total us':>9s} {'share':>6s} {'avg us':>7s} {'GB/s':>6s} {'grid':>6s}")
for k, (c, t, b, g) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{k[:36]:36s} {c:5d} {t/1e3:9.1f} {100*t/total:5.1f}% {t/c/1e3:7.2f} "
          f"{(b/t if t else 0):6.0f} {g/c:6.0f}")
