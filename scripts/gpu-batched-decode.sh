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
# With LILY_GPU_BIG_MODEL naming a 35b-a3b checkpoint the throughput printout covers it too.
set -uo pipefail
export LILY_GPU_BUILD="${LILY_GPU_BUILD:-/tmp/lily-build}"
source "$(dirname "$0")/gpu-common.sh"
STEPS="${LILY_GPU_STEPS:-batched off on}"
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }

targets=()
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
for mode in off on; do
  has "$mode" || continue
  echo "== ctest -L gpu, LILY_CUDA_BATCHED_DECODE=$([[ $mode == on ]] && echo 1 || echo 0)"
  LILY_CUDA_BATCHED_DECODE=$([[ $mode == on ]] && echo 1 || echo 0) timeout 540 \
    ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 520 >"$OUT/ctest-gpu-$mode.log" 2>&1 || status=1
  grep -E "Test +#|tests passed|tests failed" "$OUT/ctest-gpu-$mode.log" | tail -14
  grep -E "FAILED|Failure|Expected|Which is" "$OUT/ctest-gpu-$mode.log" | head -30
done
echo "== gpu-batched-decode done, status $status"
exit $status
