#!/usr/bin/env bash
# One-off probe of the 64-row batched decode (2026-12-06): the MoE rows kernel's tile split by
# cost (moe-tile-balance) at 48 and 64 rows: its bits (test_moe_block), the chain sweep, and the
# batched throughput with LILY_CUDA_MOE_TILE_BALANCE = each of $LILY_PROBE_BALANCE. Logs under $OUT.
set -uo pipefail
export LILY_GPU_BUILD="${LILY_GPU_BUILD:-/tmp/lily-build}"
source "$(dirname "$0")/gpu-common.sh"
exec > >(tee -a "$OUT/probe.log") 2>&1
BIG=/tmp/lily-35b
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
gpu_build build.log lily test_moe_block test_cuda_e2e test_kernel_switches || exit 1
[[ -f "$BIG/model.safetensors.index.json" || -f "$BIG/model.safetensors" ]] ||
  timeout 300 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$BIG" 2>&1 | tail -1
echo "== test_kernel_switches, test_moe_block"
timeout 60 "$BUILD/tests/test_kernel_switches" 2>&1 | tail -3
timeout 200 "$BUILD/tests/test_moe_block" >"$OUT/moe.log" 2>&1; echo "test_moe_block rc=$?"
grep -E "PASSED|FAILED|tile balance|rows kernel, (48|64) rows " "$OUT/moe.log"
for w in ${LILY_PROBE_BALANCE:-0 8 16}; do
  echo "== throughput: LILY_CUDA_MOE_TILE_BALANCE=$w"
  LILY_CUDA_MOE_TILE_BALANCE=$w LILY_GPU_BIG_MODEL="$BIG" timeout 200 "$BUILD/tests/test_cuda_e2e" \
    --gtest_filter=CudaE2e.PrintsBatchedDecodeThroughput 2>&1 | grep "35b-a3b, batched decode on, B (8|32|48|64):" -E
done
