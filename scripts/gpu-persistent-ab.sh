#!/usr/bin/env bash
# One device call for the persistent decode kernel's A/B (device tool, repository root, carry
# ["carry/deps"]): build, the 35b-a3b synth, the resident kernel's trace, lily bench at 4K for the
# decode graph, the stages and the resident kernel, then the resident kernel with its task
# bodies as one call (LILY_CUDA_PERSISTENT_CALL_BODIES=1): its trace, bench and the
# CudaE2e.PersistentDecode* tests. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-logs}"
export LILY_GPU_CONTEXTS="${LILY_GPU_CONTEXTS:-4096}"
LILY_GPU_STEPS=trace bash scripts/gpu-batched-decode.sh 2>&1 | tail -45
B=/tmp/lily-build M=/tmp/lily-35b-tok
bench() {
  timeout 120 "$B/lily" bench --backend cuda --model "$M" --cuda persistent-decode="$1" --prompt-len 4096 \
    --decode-steps 64 --rounds 3 2>&1 | tail -1
}
for mode in 0 debug 1; do echo "== bench persistent-decode=$mode"; bench "$mode"; done
export LILY_CUDA_PERSISTENT_CALL_BODIES=1
echo "== bench persistent-decode=1, bodies as a call"; bench 1
mkdir -p "$OUT/call"
OUT="$OUT/call" LILY_GPU_STEPS=trace bash scripts/gpu-batched-decode.sh 2>&1 | grep -v "^== build\|^build:" | tail -40
echo "== CudaE2e.PersistentDecode*, bodies as a call"
timeout 200 "$B/tests/test_cuda_e2e" --gtest_filter='CudaE2e.PersistentDecode*' >"$OUT/call/tests.log" 2>&1
grep -E "^\[ +(OK|FAILED) |^\[  (PASSED|FAILED)|Failure" "$OUT/call/tests.log" | head
