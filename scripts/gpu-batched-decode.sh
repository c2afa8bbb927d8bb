#!/usr/bin/env bash
# The batched decode's GPU check in one command (device tool, repository root, carry:
# ["carry/deps"], made by scripts/make-carry.sh): build, the batched kernels against the
# one-sequence kernels (test_batched_decode), the end-to-end batched tests and throughput
# printout (CudaE2e.BatchedDecode*, CudaE2e.PrintsBatchedDecodeThroughput), then the whole `gpu`
# suite with the switch off (the default paths must be unchanged) and on (every decode test
# through the batched path). Logs under $OUT; a summary on stdout.
#
# All three steps fit one call of the device tool (the whole `gpu` suite takes about 70 s on an
# H200, the build about 60 s); each can also run alone:
#   LILY_GPU_STEPS=batched bash scripts/gpu-batched-decode.sh   # build + the batched tests
#   LILY_GPU_STEPS=off bash scripts/gpu-batched-decode.sh       # the whole suite, switch off
#   LILY_GPU_STEPS=on bash scripts/gpu-batched-decode.sh        # the whole suite, switch on
#   LILY_GPU_STEPS=streams bash scripts/gpu-batched-decode.sh   # served streams, switch off/on
#   LILY_GPU_STEPS=moe      the fused MoE block's tests and timings (under a time limit)
#   LILY_GPU_STEPS=e2e-on   only test_cuda_e2e with the switch on (quicker than "on")
#   LILY_GPU_STEPS=big      the 35b-a3b synth: batched throughput B = 1 … 8 and lily bench at
#                           256 / 4K tokens with the switch off and on
# With LILY_GPU_BIG_MODEL naming a 35b-a3b checkpoint the throughput printout covers it too.
# The streams step makes the 35b-a3b synth (with the demo tokenizer) under /tmp/lily-35b-tok,
# serves it with --max-batch LILY_GPU_MAX_BATCH (default 32) and sends LILY_GPU_STREAMS (default
# "8 32") concurrent streams of LILY_GPU_STREAM_TOKENS (default 128) tokens, batched decode off
# and on (scripts/concurrent-streams.py).
set -uo pipefail
export LILY_GPU_BUILD="${LILY_GPU_BUILD:-/tmp/lily-build}"
source "$(dirname "$0")/gpu-common.sh"
STEPS="${LILY_GPU_STEPS:-batched off on}"
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }

targets=()
{ has streams || has big; } && targets+=(lily)
for f in tests/gpu/*.cu tests/gpu/*.cpp; do [[ -e "$f" ]] && targets+=("$(basename "${f%.*}")"); done
gpu_build build.log "${targets[@]}"

if has batched; then
  echo "== test_batched_decode"
  timeout 300 "$BUILD/tests/test_batched_decode" >"$OUT/batched-kernels.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is|differ" "$OUT/batched-kernels.log" | head -40
  echo "== test_cuda_e2e --gtest_filter=CudaE2e.BatchedDecode*:CudaE2e.PrintsBatchedDecode*"
  timeout 420 "$BUILD/tests/test_cuda_e2e" --gtest_filter='CudaE2e.BatchedDecode*:CudaE2e.PrintsBatchedDecode*' \
    >"$OUT/batched-e2e.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[ +(OK|FAILED) |Failure|Expected|Which is|differ|bit-identical|timing\]" \
    "$OUT/batched-e2e.log" | head -80
fi
if has moe; then
  echo "== test_moe_block"
  timeout 150 "$BUILD/tests/test_moe_block" >"$OUT/moe-test.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|\[timing\]|Expected|Which is|Failure|error" "$OUT/moe-test.log" | head -40
fi
if has e2e-on; then
  echo "== test_cuda_e2e, LILY_CUDA_BATCHED_DECODE=1"
  LILY_CUDA_BATCHED_DECODE=1 timeout 300 "$BUILD/tests/test_cuda_e2e" >"$OUT/e2e-on.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|bit-identical" "$OUT/e2e-on.log" | head -40
fi
for mode in off on; do
  has "$mode" || continue
  echo "== ctest -L gpu, LILY_CUDA_BATCHED_DECODE=$([[ $mode == on ]] && echo 1 || echo 0)"
  LILY_CUDA_BATCHED_DECODE=$([[ $mode == on ]] && echo 1 || echo 0) timeout 540 \
    ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 520 >"$OUT/ctest-gpu-$mode.log" 2>&1 || status=1
  grep -E "Test +#|tests passed|tests failed" "$OUT/ctest-gpu-$mode.log" | tail -14
  grep -E "FAILED|Failure|Expected|Which is" "$OUT/ctest-gpu-$mode.log" | head -30
done
M=/tmp/lily-35b-tok
if { has streams || has big; } && [[ ! -f "$M/config.json" ]]; then
  timeout 300 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$M" --tokenizer models/demo/tokenizer.json | tail -1
fi
if has big; then
  echo "== batched decode throughput, 35b-a3b"
  LILY_GPU_BIG_MODEL="$M" timeout 240 "$BUILD/tests/test_cuda_e2e" --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' \
    2>&1 | grep -E "timing\]|FAILED" | tee "$OUT/big-throughput.log"
  for mode in 0 1; do
    for n in 256 4096; do
      echo "== lily bench --prompt-len $n, LILY_CUDA_BATCHED_DECODE=$mode"
      LILY_CUDA_BATCHED_DECODE=$mode timeout 200 "$BUILD/lily" bench --backend cuda --model "$M" --prompt-len "$n" \
        --decode-steps 64 --rounds 3 2>&1 | tail -1 | tee -a "$OUT/big-bench.log"
    done
  done
fi
if has streams; then
  if [[ ! -f "$M/config.json" ]]; then
    timeout 300 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$M" --tokenizer models/demo/tokenizer.json | tail -1
  fi
  mb="${LILY_GPU_MAX_BATCH:-32}"
  for mode in ${LILY_GPU_STREAM_MODES:-0 1}; do
    port=$((18090 + mode))
    LILY_CUDA_BATCHED_DECODE=$mode LILY_CUDA_MAX_BATCH=$mb "$BUILD/lily" serve --backend cuda --model "$M" \
      --port "$port" --max-seq 4096 --max-batch "$mb" >"$OUT/serve-batched-$mode.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
    for n in ${LILY_GPU_STREAMS:-8 32}; do
      echo "== served streams: batched decode $mode, $n streams × ${LILY_GPU_STREAM_TOKENS:-128} tokens"
      timeout 120 python3 scripts/concurrent-streams.py --url "http://127.0.0.1:$port" --streams "$n" \
        --tokens "${LILY_GPU_STREAM_TOKENS:-128}" 2>&1 | tail -3 || status=1
    done
    kill -INT "$pid"; wait "$pid"
  done
fi
echo "== gpu-batched-decode done, status $status"
exit $status
