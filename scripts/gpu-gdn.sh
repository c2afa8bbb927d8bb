#!/usr/bin/env bash
# Runs ON the GPU machine: the Gated DeltaNet prefill kernels' tests, timings and an Nsight
# Compute profile of both chunked passes (stall reasons and the SASS lines that stall most).
#   LILY_GPU_STEPS="tests timing times ncu bench" bash scripts/gpu-gdn.sh
# With carry/base.tar (git archive of a baseline tree), "timing" and "bench" also run the
# baseline's GdnTiming and `lily bench`, built in /tmp/lily-base, for an A/B in one call.
set -uo pipefail
export LILY_GPU_BUILD="${LILY_GPU_BUILD:-/tmp/lily-build}"
source "$(dirname "$0")/gpu-common.sh"
exec > >(tee -a "$OUT/gdn.log") 2>&1
STEPS="${LILY_GPU_STEPS:-tests timing times ncu}"
has() { [[ " $STEPS " == *" $1 "* ]]; }
status=0
gpu_build build.log test_gdn lily
T="$BUILD/tests/test_gdn"
BASE=""
if [[ -f carry/base.tar ]] && { has timing || has bench || has times; }; then
  echo "== baseline tree (carry/base.tar)"
  rm -rf /tmp/base-src && mkdir -p /tmp/base-src && tar -xf carry/base.tar -C /tmp/base-src && ln -s "$PWD/models" /tmp/base-src/models
  (cd /tmp/base-src && cmake -S . -B /tmp/lily-base -G Ninja -DCMAKE_BUILD_TYPE=Release -DLILY_CUDA=ON \
      -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 >/dev/null &&
    cmake --build /tmp/lily-base -j16 --target lily test_gdn >/tmp/base-build.log 2>&1) && BASE=/tmp/lily-base ||
    { echo "baseline build FAILED"; grep -E "error" /tmp/base-build.log | head; }
fi
if has tests; then
  echo "== test_gdn"
  timeout 300 "$T" 2>&1 | tail -45 >"$OUT/test_gdn.txt"
  gtest_passed "$OUT/test_gdn.txt" && echo "test_gdn PASSED" || { echo "test_gdn FAILED"; grep -B5 FAILED "$OUT/test_gdn.txt" | head -60; status=1; }
fi
if has timing; then
  for i in 1 2; do
    echo "-- new"; "$T" --gtest_filter='GdnTiming.*' 2>&1 | grep "gdn timing"
    [[ -n "$BASE" ]] && { echo "-- base"; "$BASE/tests/test_gdn" --gtest_filter='GdnTiming.*' 2>&1 | grep "gdn timing"; }
  done
fi
if has bench; then
  BIG=/tmp/lily-35b
  [[ -f "$BIG/model.safetensors" || -f "$BIG/model.safetensors.index.json" ]] ||
    timeout 300 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$BIG" 2>&1 | tail -1
  for n in ${LILY_GPU_CONTEXTS:-2048 8192}; do
    for tree in new base; do
      bin="$BUILD/lily"; [[ $tree == base ]] && { [[ -n "$BASE" ]] || continue; bin="$BASE/lily"; }
      echo "== $tree: lily bench --prompt-len $n"
      timeout 240 "$bin" bench --backend cuda --model "$BIG" --prompt-len "$n" --decode-steps 64 --rounds 3 2>&1 | tail -3
    done
  done
fi
# Kernel times (ncu, each launch alone) of both passes at 2,048 tokens with both on tensor cores:
# the launches after GdnTiming's 4,096-token calls and its two other modes.
ncu_times() {  # LABEL BINARY [ENV=VALUE...]
  local label=$1 bin=$2; shift 2
  env "$@" timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --print-units base -k regex:gdn_chunk \
    --launch-skip "${LILY_GDN_SKIP:-56}" --launch-count 6 --csv "$bin" --gtest_filter='GdnTiming.*' 2>/dev/null |
    python3 -c "
import csv, sys, collections
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
hdr = rows[0]; ki = hdr.index('Kernel Name'); vi = hdr.index('Metric Value')
t = collections.defaultdict(list)
for r in rows[1:]: t[r[ki].split('(')[0].split('<')[0]].append(float(r[vi].replace(',', '')) / 1000)
print('$label', '  '.join(f'{k}: ' + ' '.join(f'{v:.1f}' for v in vs) + ' us' for k, vs in t.items()))"
}
if has times; then
  echo "== ncu kernel times, 2,048 tokens"
  ncu_times new "$T"
  [[ -n "$BASE" ]] && ncu_times base "$BASE/tests/test_gdn"
fi
if has ncu; then
  echo "== ncu: both GDN passes at 2,048 tokens"
  rm -f /tmp/gdn.ncu-rep
  timeout 300 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SourceCounters --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    -k regex:gdn_chunk --launch-skip "${LILY_GDN_SKIP:-56}" --launch-count 2 -o /tmp/gdn \
    "$T" --gtest_filter='GdnTiming.*' >/tmp/gdn-ncu.log 2>&1 || { echo "ncu failed"; tail -5 /tmp/gdn-ncu.log; }
  if [[ -f /tmp/gdn.ncu-rep ]]; then
    ncu --import /tmp/gdn.ncu-rep --print-details all >"$OUT/gdn-ncu.txt" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|Throughput|Stall|Issued|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit" "$OUT/gdn-ncu.txt" | head -90
    ncu --import /tmp/gdn.ncu-rep --page source --print-source sass --csv >"/tmp/gdn-src.csv" 2>/dev/null &&
      python3 - <<'PY' >"$OUT/gdn-hot.txt" 2>&1; head -c 6000 "$OUT/gdn-hot.txt"
import csv, sys
rows = list(csv.reader(open("/tmp/gdn-src.csv", errors="replace")))
print("rows", len(rows))
hdr_i = next((i for i, r in enumerate(rows) if any("Stall" in c or "Sampl" in c for c in r)), None)
if hdr_i is None:
    print("\n".join(",".join(r)[:200] for r in rows[:20])); sys.exit()
hdr = rows[hdr_i]
print(hdr)
col = next(i for i, c in enumerate(hdr) if "Sampling (All" in c or "Samples" in c)
src = next((i for i, c in enumerate(hdr) if c.strip().lower() in ("source", "sass")), 1)
body = [r for r in rows[hdr_i + 1:] if len(r) > col]
def num(x):
    try: return float(x.replace(",", ""))
    except: return 0.0
tot = sum(num(r[col]) for r in body) or 1
for i, r in sorted(enumerate(body), key=lambda p: -num(p[1][col]))[:60]:
    print(f"{i:6d} {100*num(r[col])/tot:5.1f}% {r[src][:110]}")
PY
  fi
fi
exit $status
