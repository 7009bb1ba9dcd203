#!/usr/bin/env python3
"""Per-kernel L2 hit rate and time of two ncu captures of one decode step (A, B: e.g. without and
with DS4_GPU_PREFETCH), from `ncu --csv --page raw --metrics
gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,launch__grid_size`.
Usage: ncu-l2.py A.csv B.csv"""
import csv, sys, collections

def load(path):
    lines = [l for l in open(path) if l.strip() and not l.startswith("==")]
    start = next(i for i, l in enumerate(lines) if "Kernel Name" in l)
    rd = list(csv.reader(lines[start:]))
    ix = {h: i for i, h in enumerate(rd[0])}
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # calls, us, dram bytes, hit% * us
    for r in rd[1:]:
        try:
            t = float(r[ix["gpu__time_duration.sum"]].replace(",", ""))
        except (ValueError, IndexError):
            continue
        name = r[ix["Kernel Name"]].split("(")[0]
        b = float(r[ix["dram__bytes_read.sum"]].replace(",", "") or 0)
        h = float(r[ix["lts__t_sector_hit_rate.pct"]].replace(",", "") or 0)
        a = agg[name]
        a[0] += 1; a[1] += t; a[2] += b; a[3] += h * t
    return agg

a, b = load(sys.argv[1]), load(sys.argv[2])
# gpu__time_duration in ns, as ncu reports it by default (the units row is skipped above)
print(f"{'kernel':34} {'calls':>5} {'A us/call':>10} {'B us/call':>10} {'A L2 hit%':>9} {'B L2 hit%':>9} {'A MB/call':>9} {'B MB/call':>9}")
for k in sorted(set(a) | set(b), key=lambda k: -(a.get(k, [0, 0])[1])):
    x, y = a.get(k, [0, 0, 0, 0]), b.get(k, [0, 0, 0, 0])
    n1, n2 = max(x[0], 1), max(y[0], 1)
    print(f"{k[:34]:34} {x[0]:5d} {x[1]/n1/1e3:10.2f} {y[1]/n2/1e3:10.2f} {x[3]/max(x[1],1e-9):9.1f} {y[3]/max(y[1],1e-9):9.1f} {x[2]/n1/1e6:9.2f} {y[2]/n2/1e6:9.2f}")
print("total us:", round(sum(v[1] for v in a.values()) / 1e3, 1), round(sum(v[1] for v in b.values()) / 1e3, 1))
