#!/usr/bin/env bash
# Alternating A/B of `ds4 bench` under environment settings, on the GPU machine (after
# `. tools/gpu/unpack.sh DIR`): ROUNDS rounds, each running every form once in the order given,
# so drift (clocks, thermals) spreads over all forms. A form is LABEL or LABEL:VAR=V[,VAR=V..]
# (no settings: the defaults). On an 80 GB card DS4_SYNTH_LAYERS=34 is set (the q2 mix's first
# 34 layers fit). CSVs go to $OUT/ab-LABEL-ROUND.csv; one line a run is printed.
#   tools/gpu/ab-bench.sh 4 "--ctx-start 2048 --ctx-max 32768 --step-mul 16 --gen-tokens 64" \
#       base l2:DS4_GPU_L2_STREAM=1 r32:DS4_GPU_M3D_R32=1
set -uo pipefail
rounds=$1; args=$2; shift 2
out=${OUT:-/tmp/ab}; mkdir -p "$out"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -n "$mem" ] && [ "$mem" -lt 100000 ] && [ -z "${DS4_SYNTH_LAYERS:-}" ]; then
  export DS4_SYNTH_LAYERS=34; echo "ab-bench: ${mem} MiB card: DS4_SYNTH_LAYERS=34"
fi
for r in $(seq 1 "$rounds"); do
  for f in "$@"; do
    label=${f%%:*}; sets=""; [ "$f" != "$label" ] && sets=${f#*:}
    # shellcheck disable=SC2086
    env ${sets//,/ } ds4 bench --backend cuda --synthetic full-q2 $args --csv "$out/ab-$label-$r.csv" \
      >/dev/null 2>"$out/ab-$label-$r.err" || { echo "r$r $label: failed"; tail -3 "$out/ab-$label-$r.err"; continue; }
    echo "r$r $label: $(tail -n +2 "$out/ab-$label-$r.csv" | cut -d, -f1,3,5 | tr '\n' ' ')"
  done
done
echo "columns: ctx_tokens,prefill_tps,gen_tps"
