#!/usr/bin/env bash
# Runs ON a GPU machine (Ubuntu 24.04, nvcc 13.0, CMake, gcc 13):
# configures with the CUDA backend, builds with -j16, runs every CTest test labelled `gpu`
# (kernels vs CPU reference, CUDA vs CPU end to end), then `lily generate --backend cuda` on a
# synthetic real-dims checkpoint and on the demo model. Every log goes to $OUT (or ./gpu-logs).
#
# Usage (repository root, carry/deps copied along):
#   bash scripts/gpu-check.sh            # build + ctest -L gpu + generate + serve
#   LILY_GPU_BENCH=1 bash scripts/gpu-check.sh   # also the 35b-a3b synth, the bench matrix
#       (scripts/bench-matrix, LILY_GPU_MATRIX_BUDGET seconds, default 300) and CUDA vs CPU on it
# The PCRE2/utf8proc/Boost headers come from carry/deps (scripts/make-carry.sh packs them).
# Files under $OUT (at most 8, for runners that return only a few): gpu-check.log (everything), build.log,
# ctest-gpu.log, e2e-per-token-prefill.txt, serve-check.txt and, with LILY_GPU_BENCH=1,
# bench-realdims.json, bench-matrix.md and bench-json.tar.gz.
set -uo pipefail
source "$(dirname "$0")/gpu-common.sh"
LOG="$OUT/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
status=0

# A working tree copied without .git has no commit: pass LILY_COMMIT=<hash> to label the
# build (CMakeLists.txt reads it) and the bench reports.
echo "== gpu-check $(date -u +%FT%TZ) commit ${LILY_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
nvcc --version | tail -1

# Only what the checks need: the lily executable, the device peaks and every tests/gpu binary.
targets=(lily bench_device_peaks)
for f in tests/gpu/*.cu tests/gpu/*.cpp; do [[ -e "$f" ]] && targets+=("$(basename "${f%.*}")"); done
gpu_build build.log "${targets[@]}"

echo "== ctest -L gpu"
ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 400 2>&1 | tee "$OUT/ctest-gpu.log" || status=1

echo "== test_cuda_e2e again with the per-token prefill for every test (LILY_CUDA_PREFILL=per-token)"
LILY_CUDA_PREFILL=per-token "$BUILD/tests/test_cuda_e2e" 2>&1 | tee "$OUT/e2e-per-token-prefill.txt" | grep -E "OK|FAILED|PASSED|SKIPPED" || status=1

echo "== lily generate --backend cuda"
SYN=$(mktemp -d)
"$BUILD/lily" synth --preset realdims --seed 7 --out "$SYN/realdims" >/dev/null || status=1
IDS=1,2,3,4,5,6,7,8
for backend in cpu cuda; do
  echo "-- realdims, $backend"
  "$BUILD/lily" generate --backend "$backend" --model "$SYN/realdims" --prompt-ids "$IDS" --max-tokens 16 --json \
    2>&1 || status=1
done
echo "-- demo, cuda"
"$BUILD/lily" generate --backend cuda --model models/demo --prompt-ids 100,200,300,400,500 --max-tokens 16 --json \
  2>&1 || echo "(demo on cuda failed; see above)"

echo "== lily serve --backend cuda (scripts/gpu-serve-check.py)"
python3 scripts/gpu-serve-check.py "$BUILD/lily" models/demo 2>&1 | tee "$OUT/serve-check.txt" || status=1

if [[ "${LILY_GPU_BENCH:-0}" == 1 ]]; then
  echo "== lily bench (synthetic realdims)"
  "$BUILD/lily" bench --backend cuda --model "$SYN/realdims" --prompt-len 256 --decode-steps 64 \
    --json-out "$OUT/bench-realdims.json" 2>&1 || status=1
  echo "== lily synth --preset 35b-a3b"
  t1=$(date +%s)
  timeout 240 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$SYN/35b" 2>&1 | tail -3 || status=1
  echo "synth: $(( $(date +%s) - t1 )) s"
  echo "== start-up on the 35b-a3b shape: lily generate --backend cuda, 1 token (load + upload + prefill)"
  t2=$(date +%s.%N)
  "$BUILD/lily" generate --backend cuda --model "$SYN/35b" --prompt-ids 1,2,3 --max-tokens 1 --json 2>&1 | tail -2 || status=1
  echo "start-up + 1 token: $(python3 -c "import time; print(f'{time.time() - $t2:.2f}')") s"
  echo "== 35b-a3b: CUDA vs CPU reference"
  LILY_GPU_BIG_MODEL="$SYN/35b" timeout 240 "$BUILD/tests/test_cuda_e2e" --gtest_filter='*Full35b*' 2>&1 || status=1
  echo "== bench matrix (scripts/bench-matrix, budget ${LILY_GPU_MATRIX_BUDGET:-300} s)"
  mkdir -p "$SYN/bench"
  python3 scripts/bench-matrix --lily "$BUILD/lily" --model "$SYN/35b" --peaks "$BUILD/bench_device_peaks" \
    --budget-s "${LILY_GPU_MATRIX_BUDGET:-300}" --out "$OUT/bench-matrix.md" --json-dir "$SYN/bench" 2>&1 || status=1
  # At most 8 files under $OUT: the per-context JSON reports travel as one archive.
  tar -czf "$OUT/bench-json.tar.gz" -C "$SYN" bench
fi
rm -rf "$SYN"
echo "== gpu-check done, status $status"
exit $status
