#!/usr/bin/env bash
# A coding agent's session against `ds4 serve` on a GPU with the full-size synthetic model:
# turns over one long system prompt (live KV prefix reuse), then a restart and the next turn
# (the disk KV cache). Random weights answer noise, so every answer is the same forced text with
# one tool call (the hidden --test-force-output; output tokens are then fed back, not sampled),
# which the client returns as a real agent would. ds4 must be on PATH (e.g. after
# `. tools/gpu/unpack.sh DIR`). Writes serve.log and agent.txt under $OUT (default /tmp/agent).
# Exits non-zero when a turn did not reuse the whole previous request from the KV cache.
#   SYSTEM_WORDS=20000 TURNS=4 CTX=65536 bash tools/agent-serve.sh           (GPU, full size)
#   MODEL="-m models/tiny.gguf" BACKEND=cpu SYSTEM_WORDS=300 bash tools/agent-serve.sh
set -u
OUT=${OUT:-/tmp/agent}
mkdir -p "$OUT"
SYSTEM_WORDS=${SYSTEM_WORDS:-20000} TURNS=${TURNS:-4} CTX=${CTX:-65536} PORT=${PORT:-8123}
MODEL=${MODEL:---synthetic full-q2} # or "-m FILE"; BACKEND=cpu for a CPU run
KV=$(mktemp -d /tmp/ds4-kv.XXXXXX)
FORCE=$OUT/force.txt
printf '%s' "I'll look at the build output first.

<｜DSML｜tool_calls>
<｜DSML｜invoke name=\"bash\">
<｜DSML｜parameter name=\"command\" string=\"true\">cargo build --release</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls>" > "$FORCE"
here=$(cd "$(dirname "$0")" && pwd)
A="python3 $here/agent-session.py --check --base http://127.0.0.1:$PORT --max-tokens 128"

start() {
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    ds4 serve $MODEL --backend "${BACKEND:-cuda}" --ctx "$CTX" --port "$PORT" --kv-disk-dir "$KV" \
        --kv-disk-space-mb 16384 --test-force-output "$FORCE" >> "$OUT/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do
        if python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
            "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; then
            echo "server ready in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s" | tee -a "$OUT/agent.txt"
            grep "model ready" "$OUT/serve.log" | tail -1 | tee -a "$OUT/agent.txt"
            return 0
        fi
        kill -0 $pid 2> /dev/null || break
        sleep 0.5
    done
    echo "server did not come up" | tee -a "$OUT/agent.txt"
    return 1
}
stop() {
    kill -TERM $pid
    wait $pid
    echo "server stopped (rc $?)" | tee -a "$OUT/agent.txt"
}

rc=0
start || exit 1
$A --system-words "$SYSTEM_WORDS" --turns "$TURNS" --save "$OUT/next.json" --json "$OUT/agent.jsonl" \
    2>&1 | tee -a "$OUT/agent.txt"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
stop
du -sh "$KV" | tee -a "$OUT/agent.txt"
start || exit 1
$A --replay "$OUT/next.json" --json "$OUT/agent.jsonl" 2>&1 | tee -a "$OUT/agent.txt"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
stop
grep -E "prompt=|kv cache|sessions" "$OUT/serve.log" | tee -a "$OUT/agent.txt"
rm -rf "$KV"
exit $rc
