#!/usr/bin/env bash
# Verifies and measures the decode latency work (docs/cuda.md "Decode latency work": programmatic
# dependent launch, fused router + top-k, norms and the GDN conv folded into GEMVs, expert kernel
# changes) on a GPU machine: builds lily + test_cuda_core_kernels + test_cuda_e2e, runs both test
# binaries (kernels vs the CPU reference and vs the unfused kernels, PDL chains under graphs,
# end-to-end vs the CPU backend, PDL on/off and fused/separate bit-identity, timing lines), then,
# with LILY_GPU_BENCH=1, lily bench on the 35b-a3b synth (256-token prompt, 64 decode steps) in
# the four combinations LILY_CUDA_PDL=0/1 × LILY_CUDA_FUSE=0/1.
#
# Usage (on a GPU machine, repository root, carry/deps copied along):
#   bash scripts/gpu-check-decode.sh                    # build + both tests
#   LILY_GPU_BENCH=1 bash scripts/gpu-check-decode.sh   # + synth (≈ 30 s) + the four benches
# Logs go to $OUT (or ./gpu-logs): decode-check.log, decode-build.log, core-kernels.log, e2e.log,
# bench-pdl<0|1>-fuse<0|1>.json.
set -uo pipefail
source "$(dirname "$0")/gpu-common.sh"
exec > >(tee -a "$OUT/decode-check.log") 2>&1
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv || true
gpu_build decode-build.log lily test_cuda_core_kernels test_cuda_e2e

run_test() {  # binary, log name
  echo "== $1"
  timeout 500 "$BUILD/tests/$1" 2>&1 | tee "$OUT/$2" |
    grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) |\[timing\]|bit-identical|Failure|Expected|Which is" || true
  gtest_passed "$OUT/$2" || status=1
}
run_test test_cuda_core_kernels core-kernels.log
run_test test_cuda_e2e e2e.log

if [[ "${LILY_GPU_BENCH:-0}" == 1 ]]; then
  SYN="$(mktemp -d)"
  echo "== lily synth --preset 35b-a3b"
  timeout 240 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$SYN/35b" 2>&1 | tail -1 || status=1
  for pdl in 0 1; do
    for fuse in 0 1; do
      echo "== bench LILY_CUDA_PDL=$pdl LILY_CUDA_FUSE=$fuse (256-token prompt, 64 decode steps)"
      LILY_CUDA_PDL=$pdl LILY_CUDA_FUSE=$fuse timeout 300 "$BUILD/lily" bench --backend cuda --model "$SYN/35b" \
        --prompt-len 256 --decode-steps 64 --rounds 3 --json-out "$OUT/bench-pdl$pdl-fuse$fuse.json" 2>&1 | tail -4 ||
        status=1
    done
  done
  rm -rf "$SYN"
fi
echo "== gpu-check-decode done, status $status"
exit $status
