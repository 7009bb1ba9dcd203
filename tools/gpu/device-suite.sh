#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repo root, with .devbin/ carried
# (tools/gpu/build-devbin.sh): the full-size synthetic q2 benchmark, decode A/Bs of kernel forms,
# every GPU test (fast kernels and their fallbacks, the whole forward pass against the CPU and the
# oracle, decode graphs, the engine on the GPU), then a per-op profile. The benchmark comes first
# so that a run cut short by its time limit still returns numbers.
# Logs go to $OUT (compile.log, bench.csv, decode-only.csv, turn.csv, bench.log, ab.log, tests.log,
# prof.log, ncu-decode.txt).
# Usage: device-suite.sh [quick]   (quick: skip the slow CPU-reference op tests)
# A/B switches to compare against the default: DS4_SUITE_AB="DS4_GPU_GRAPH=off DS4_GPU_MIX=fast ..."
set -u
cd "$(dirname "$0")/../../.devbin"
export DS4_REQUIRE_GPU=1 DS4_ORACLE_DIR=$PWD/../tests/fixtures/oracle PATH=$PWD:$PATH
export DS4_KERNEL_CACHE=${DS4_KERNEL_CACHE:-/tmp/ds4-kernels}   # one compilation for every process
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. ../tools/gpu/unpack.sh .                                      # tools/gpu/build-devbin.sh
nvidia-smi -L 2>/dev/null
B="ds4 bench --backend cuda --synthetic full-q2"
s=$(date +%s); timeout 120 $B --ctx-start 128 --ctx-max 128 --gen-tokens 4 > "$OUT/compile.log" 2>&1; rc=$?
echo "kernel compilation (first open) + a 128-token bench: $(( $(date +%s) - s )) s rc=$rc"
timeout 200 $B --ctx-start 2048 --ctx-max 32768 --step-mul 4 --gen-tokens 64 --csv "$OUT/bench.csv" 2> "$OUT/bench.log"
echo "bench rc=$?"; cat "$OUT/bench.csv"
# The long end in about a minute each: decode at 128k-1M on random KV states, and a 4,096-token
# turn there (prefill and answer).
timeout 120 $B --decode-only --ctx-start 131072 --ctx-max 1048576 --step-mul 2 --gen-tokens 64 \
  --csv "$OUT/decode-only.csv" 2>> "$OUT/bench.log"; echo "decode-only rc=$?"
timeout 150 $B --turn 4096 --ctx-start 131072 --ctx-max 1048576 --step-mul 2 --gen-tokens 32 \
  --csv "$OUT/turn.csv" 2>> "$OUT/bench.log"; echo "turn rc=$?"
echo "default: $(timeout 60 $B --ctx-start 2048 --ctx-max 2048 --gen-tokens 64 2>>"$OUT/ab.log" | tail -1)"
for v in ${DS4_SUITE_AB:-}; do
  echo "$v: $(env "$v" timeout 60 $B --ctx-start 2048 --ctx-max 2048 --gen-tokens 64 2>>"$OUT/ab.log" | tail -1)"
done
tests="gpu_forward graph ops_mix ops_attn ops_moe gpu sample ops_blas ops_matvec ops_matmul synth conformance"
[ "${1:-}" = quick ] || tests="$tests ops_gemm"
for t in $tests; do
  [ -x "./t-$t" ] || { echo "$t: not carried"; continue; }
  echo "===== $t" >> "$OUT/tests.log"
  s=$(date +%s)
  DS4_GPU_POISON=1 timeout 150 "./t-$t" --nocapture --test-threads=1 >> "$OUT/tests.log" 2>&1; rc=$?
  echo "$t rc=$rc $(( $(date +%s) - s ))s $(grep -E '^test result' "$OUT/tests.log" | tail -1)"
done
DS4_GPU_PROFILE=1 timeout 60 $B --ctx-start 2048 --ctx-max 2048 --gen-tokens 32 > /dev/null 2> "$OUT/prof.log"; echo "prof rc=$?"
# One decode step kernel by kernel (Nsight Compute, when the machine has it): ncu-decode.txt.
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$NCU" ]; then
  DS4_GPU_CUPROFILE=3 DS4_GPU_GRAPH=off timeout 120 "$NCU" --profile-from-start off --cache-control none \
    --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size --csv \
    --page raw --print-units base $B --ctx-start 2048 --ctx-max 2048 --gen-tokens 4 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  echo "ncu rc=$?"; python3 ../tools/gpu/ncu-summary.py "$OUT/ncu.csv" > "$OUT/ncu-decode.txt" 2>&1; head -25 "$OUT/ncu-decode.txt"
fi
