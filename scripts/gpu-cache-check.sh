#!/usr/bin/env bash
# Prefix-cache timing on a GPU machine (after scripts/gpu-session.sh has built /tmp/lily-build;
# logs under $OUT, default ./gpu-logs): serves the 35b-a3b synth (with the demo tokenizer) on CUDA and runs
# scripts/cache-ttft.py twice: with the default cache (snapshots in device memory) and with a
# 1 MiB device tier (every snapshot moves to the pinned host tier, so turn 2 restores from host).
# LILY_CACHE_TOKENS (default 8) answer tokens: with 1 the whole answer is the time to the first
# token (the random-weight model's tokens are often special, which stream no text to time).
# Each request's server-side phases are printed too (cache-ttft.py --phases: its "server ttft"
# is the engine's first token whatever the text), and LILY_CACHE_PAUSE (default 0.5) seconds
# pass between turn 1 and turn 2, in which the server makes spare blocks while idle.
# LILY_CACHE_CONVERSATIONS (default 2) conversations per server.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-logs}"; mkdir -p "$OUT"
BUILD="${LILY_GPU_BUILD:-/tmp/lily-build}"
M=/tmp/lily-35b-tok
if [[ ! -f "$M/config.json" ]]; then
  timeout 300 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$M" --tokenizer models/demo/tokenizer.json | tail -1
fi
run_case() {  # LABEL PORT EXTRA-FLAGS...
  local label=$1 port=$2; shift 2
  "$BUILD/lily" serve --backend cuda --model "$M" --port "$port" --max-seq 8192 "$@" >"$OUT/serve-$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
  python3 scripts/cache-ttft.py --url "http://127.0.0.1:$port" --system-words "${LILY_CACHE_WORDS:-3000}" --label "$label" \
    --max-tokens "${LILY_CACHE_TOKENS:-8}" --phases --pause "${LILY_CACHE_PAUSE:-0.5}" \
    --conversations "${LILY_CACHE_CONVERSATIONS:-2}"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^lily_cache_(hits|misses|tokens_saved|bytes|evictions|snapshots|host_copies_pending)" 
  kill -INT "$pid"; wait "$pid"
}
run_case device-tier 18080
run_case host-tier 18081 --cache-memory 1MiB
