#!/usr/bin/env bash
# Verifies the tensor-core prefill GEMM (src/backends/cuda/quant_gemm.cu, docs/cuda.md) on a GPU
# machine: builds lily + test_quant_gemm + test_cuda_e2e, runs test_quant_gemm (kernels vs the
# CPU reference, timing lines), test_cuda_e2e with LILY_CUDA_GEMM=tensor-core (end-to-end vs the
# CPU backend), then, with LILY_GPU_BENCH=1, lily bench on the 35b-a3b synth at an 8K prompt:
# the default GEMV prefill, and the tensor-core path at chunks of 256 and 2048 tokens.
#
# Usage (on a GPU machine, repository root, carry/deps copied along):
#   bash scripts/gpu-check-gemm.sh                    # build + both tests (≈ 5 min)
#   LILY_GPU_BENCH=1 bash scripts/gpu-check-gemm.sh   # + the three benches (≈ 4 more min)
# Logs go to $OUT (or ./gpu-logs): gemm-check.log, test_quant_gemm.log, e2e-tensor-core.log, bench-*.json.
set -uo pipefail
source "$(dirname "$0")/gpu-common.sh"
exec > >(tee -a "$OUT/gemm-check.log") 2>&1
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv || true
gpu_build gemm-build.log lily test_quant_gemm test_cuda_e2e

echo "== test_quant_gemm"
timeout 400 "$BUILD/tests/test_quant_gemm" 2>&1 | tee "$OUT/test_quant_gemm.log" | grep -E "^\[ *(OK|FAILED|PASSED) |timing|Failure|error|Expected|Which is" || true
gtest_passed "$OUT/test_quant_gemm.log" || status=1

echo "== test_cuda_e2e with LILY_CUDA_GEMM=tensor-core"
LILY_CUDA_GEMM=tensor-core timeout 400 "$BUILD/tests/test_cuda_e2e" 2>&1 | tee "$OUT/e2e-tensor-core.log" |
  grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure" || true
gtest_passed "$OUT/e2e-tensor-core.log" || status=1

if [[ "${LILY_GPU_BENCH:-0}" == 1 ]]; then
  SYN="$(mktemp -d)"
  echo "== lily synth --preset 35b-a3b"
  timeout 240 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$SYN/35b" 2>&1 | tail -1 || status=1
  bench() {  # name, then environment assignments
    local name="$1"; shift
    echo "== bench $name (8192-token prompt): $*"
    env "$@" timeout 300 "$BUILD/lily" bench --backend cuda --model "$SYN/35b" --prompt-len 8192 --decode-steps 16 \
      --rounds 3 --json-out "$OUT/bench-$name.json" 2>&1 | tail -4 || status=1
  }
  bench gemv LILY_CUDA_GEMM=gemv
  bench tc256 LILY_CUDA_GEMM=tensor-core LILY_CUDA_PREFILL_CHUNK=256
  bench tc2048 LILY_CUDA_GEMM=tensor-core LILY_CUDA_PREFILL_CHUNK=2048
  rm -rf "$SYN"
fi
echo "== gpu-check-gemm done, status $status"
exit $status
