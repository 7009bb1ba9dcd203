#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repo root, with .devbin/ carried
# (tools/gpu/build-devbin.sh): every GPU test — fast kernels and their fallbacks, the whole
# forward pass against the CPU and the oracle, the engine on the GPU — then the full-size
# synthetic q2 benchmark, an A/B of the decode products, a per-op profile and the upload rate.
# Logs go to $OUT (tests.log, bench.csv, bench.log, prof.log, upload.log).
set -u
cd "$(dirname "$0")/../../.devbin"
export DS4_REQUIRE_GPU=1 DS4_ORACLE_DIR=$PWD/../tests/fixtures/oracle PATH=$PWD:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L 2>/dev/null
for t in conformance ops_mix ops_attn ops_matmul ops_matvec ops_gemm ops_moe synth graph gpu_forward gpu; do
  [ -x "./t-$t" ] || { echo "$t: missing"; continue; }
  echo "===== $t" >> "$OUT/tests.log"
  DS4_GPU_POISON=1 timeout 180 "./t-$t" --nocapture --test-threads=1 >> "$OUT/tests.log" 2>&1
  echo "$t rc=$? $(grep -E '^test result' "$OUT/tests.log" | tail -1)"
done
B="ds4 bench --backend cuda --synthetic full-q2"
timeout 300 $B --ctx-start 2048 --ctx-max 32768 --step-mul 4 --gen-tokens 64 --csv "$OUT/bench.csv" 2> "$OUT/bench.log"
echo "bench rc=$?"; cat "$OUT/bench.csv"
for v in on v3; do
  echo "# DS4_GPU_MATVEC=$v" >> "$OUT/bench.log"
  DS4_GPU_MATVEC=$v timeout 90 $B --ctx-start 512 --ctx-max 512 --gen-tokens 32 2>> "$OUT/bench.log" | tail -1 | sed "s/^/matvec=$v: /"
done
DS4_GPU_PROFILE=1 timeout 90 $B --ctx-start 512 --ctx-max 512 --gen-tokens 16 > /dev/null 2> "$OUT/prof.log"; echo "prof rc=$?"
timeout 60 ./t-upload_bench 8 > "$OUT/upload.log" 2>&1; echo "upload rc=$?"; cat "$OUT/upload.log"
