#!/usr/bin/env bash
# One device call for the persistent decode kernel's A/B (device tool, repository root, carry
# ["carry/deps"]), most important first, so that a call cut short still answers: build and the
# 35b-a3b synth; lily bench at 4K for the resident kernel with inlined task bodies and with its
# bodies as one call (LILY_CUDA_PERSISTENT_CALL_BODIES=1), and the decode graph; the
# CudaE2e.PersistentDecode* tests of the call form; then the trace of each form. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/gpu-logs}"
export LILY_GPU_BUILD=/tmp/lily-build
source scripts/gpu-common.sh
B=$BUILD M=/tmp/lily-35b-tok
gpu_build build.log lily test_cuda_e2e
[[ -f "$M/config.json" ]] || timeout 300 "$B/lily" synth --preset 35b-a3b --seed 1 --out "$M" \
  --tokenizer models/demo/tokenizer.json | tail -1
bench() {
  timeout 120 "$B/lily" bench --backend cuda --model "$M" --cuda persistent-decode="$1" --prompt-len 4096 \
    --decode-steps 64 --rounds 3 2>&1 | tail -1 | tee -a "$OUT/bench.log"
}
echo "== bench persistent-decode=1 (bodies inlined)"; bench 1
echo "== bench persistent-decode=1, bodies as a call"; LILY_CUDA_PERSISTENT_CALL_BODIES=1 bench 1
echo "== bench persistent-decode=0 (the decode graph)"; bench 0
echo "== CudaE2e.PersistentDecode*, bodies as a call"
LILY_CUDA_PERSISTENT_CALL_BODIES=1 timeout 200 "$B/tests/test_cuda_e2e" --gtest_filter='CudaE2e.PersistentDecode*' \
  >"$OUT/tests-call.log" 2>&1
grep -E "^\[ +(OK|FAILED) |^\[  (PASSED|FAILED)|Failure" "$OUT/tests-call.log" | head
for form in inline call; do
  echo "== trace, bodies $form"
  LILY_CUDA_PERSISTENT_CALL_BODIES=$([[ $form == call ]] && echo 1 || echo 0) timeout 100 "$B/lily" bench --backend cuda \
    --model "$M" --cuda persistent-decode=trace --prompt-len 4096 --decode-steps 32 --rounds 1 >"$OUT/trace-$form.log" 2>&1
  grep -E "persistent decode trace|kind|^  [a-z_]+ +[0-9]+ +[0-9]+ " "$OUT/trace-$form.log" | head -16
done
