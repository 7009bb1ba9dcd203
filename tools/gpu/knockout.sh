#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repo root with a pack carried
# (tools/gpu/build-devbin.sh): what each decode kernel costs inside the decode graph, by knocking
# it out (DS4_GPU_SKIP: the named kernels are not launched, so results are wrong but the schedule
# is the same) and timing the step against the full one. Rows alternate; ROUNDS rounds.
# Kernels whose outputs are indices can make the run fail (stale indices read out of bounds):
# knocking out the indexer's top-k (index_topk_r) does; the router (mvq_route_f16r) happened not
# to on the H200 (bench/results/gpu-lead-s32-h200.txt run G). A failed run prints an empty rate.
# Usage: tools/gpu/knockout.sh PACKDIR [CTX] [ROUNDS]   (CTX default 2048, ROUNDS default 2)
# KNOCKOUT="k1 k2,k3 ..." overrides the list (space-separated sets; a set is comma-separated).
set -u
. tools/gpu/unpack.sh "$1"
ctx=${2:-2048}; rounds=${3:-2}
B="ds4 bench --backend cuda --synthetic full-q2 --ctx-start $ctx --ctx-max $ctx --gen-tokens 64"
sets=${KNOCKOUT:-"hc_post_pre_norm_l attend_one_tc5 mvr_r2u2_q8_0i m3gu1_iq2_xxs m3dn1ip_q2_k mvxn_r4u2_q8_0 mvrm_r2u2_q8_0i mvrgu_r2u2_q8_0i mvra_r2u2_q8_0i mvxm_r4u2_f16,mvqm_r2u4_f16l,compress_frontier_ip_f32 mvq_r2u4_f16l mvr_r4u2_q8_0i"}
log=${OUT:-/tmp}/knockout-$ctx.txt; : > "$log"
for r in $(seq "$rounds"); do
  for k in "" $sets; do
    tps=$(DS4_GPU_SKIP="$k" timeout 200 $B 2>/dev/null | grep -E '^[0-9]' | cut -d, -f5)
    echo "[$k] $tps" | tee -a "$log"
  done
done
python3 - "$log" <<'PY'
import sys, collections, statistics as st
d = collections.OrderedDict()
for l in open(sys.argv[1]):
    k, v = l.rsplit(' ', 1)
    if v.strip():
        d.setdefault(k.strip()[1:-1], []).append(float(v))
base = 1e6 / st.mean(d.pop(''))
print(f"full step {base:.0f} us")
for k, v in d.items():
    us = 1e6 / st.mean(v)
    print(f"{k:60s} {base - us:6.0f} us a step ({(base - us) / base * 100:4.1f}%)")
PY
