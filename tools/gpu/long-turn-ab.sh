#!/usr/bin/env bash
# On the GPU machine (device tool), after `. tools/gpu/unpack.sh DIR`: the long-prompt indexer
# forms that are written and tested but not yet measured, against the defaults, on a 4,096-token
# turn at 128k and 1M of context (`ds4 bench --turn`; ~30 s a form on one H200):
#   new   defaults (wgmma scores row blocks first; two-level top-k for batches of <= 64 tokens)
#   tok   DS4_GPU_IXW_ORDER=tokens (wgmma scores' CTAs token groups first: rows from L2)
#   tk2   DS4_GPU_TK2_MAX=65535 (two-level top-k for prompt batches too)
#   both  the two together
#   wg    DS4_GPU_ATTN_WG=on (prefill attention on wgmma: the ratio-128 layers at 8,192 rows)
# Then 2k-32k prompts with both (the forms must not cost the short end). Rows: form, CSV row.
# Usage: tools/gpu/long-turn-ab.sh OUTFILE
set -u
out=${1:?usage: long-turn-ab.sh OUTFILE}
B="ds4 bench --backend cuda --synthetic full-q2"
T="$B --turn 4096 --ctx-start 131072 --ctx-max 1048576 --step-mul 8 --gen-tokens 16 --warmup 0"
for v in new tok tk2 both wg new; do
  unset DS4_GPU_IXW_ORDER DS4_GPU_TK2_MAX DS4_GPU_ATTN_WG
  case $v in
    tok) export DS4_GPU_IXW_ORDER=tokens ;;
    tk2) export DS4_GPU_TK2_MAX=65535 ;;
    both) export DS4_GPU_IXW_ORDER=tokens DS4_GPU_TK2_MAX=65535 ;;
    wg) export DS4_GPU_ATTN_WG=on ;;
  esac
  timeout 90 $T 2>/dev/null | grep -E '^[0-9]' | sed "s/^/$v /" | tee -a "$out"
done
for v in new both; do
  unset DS4_GPU_IXW_ORDER DS4_GPU_TK2_MAX DS4_GPU_ATTN_WG
  [ $v = both ] && export DS4_GPU_IXW_ORDER=tokens DS4_GPU_TK2_MAX=65535
  timeout 90 $B --ctx-start 2048 --ctx-max 32768 --step-mul 4 --gen-tokens 32 2>/dev/null \
    | grep -E '^[0-9]' | sed "s/^/$v /" | tee -a "$out"
done
