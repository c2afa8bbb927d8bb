#!/usr/bin/env bash
# One full GPU-machine session in one command (repository root, carry/deps copied along):
# build, every `gpu` test, the per-kernel timing lines, then on the 35b-a3b synth checkpoint the
# decode/prefill bench at several contexts and a Nsight Compute profile of decode steps. Build
# outputs and the 19.5 GB checkpoint stay under /tmp (reused while the machine stays up). Logs
# under $OUT (default ./gpu-logs), at most 8 files.
#
#   bash scripts/gpu-session.sh                  # everything
#   LILY_GPU_STEPS="tests bench" bash scripts/gpu-session.sh   # a subset: moe tests timing bench base ab e2e sampled sampler detail source profile prefill-profile prefill-detail batched-profile cache prefill-tests
#   LILY_GPU_CONTEXTS="256 4096 32768"           # bench contexts (default below)
#   timing: LILY_GPU_TIMING_FILTER (a gtest filter, default CudaTiming.*)
#   detail: LILY_GPU_DETAIL (a kernel-name regex), LILY_GPU_DETAIL_SKIP / _COUNT (matching launches
#   skipped / profiled), LILY_GPU_DETAIL_BASE=demangled (match template arguments too)
set -uo pipefail
export LILY_GPU_BUILD="${LILY_GPU_BUILD:-/tmp/lily-build}"
source "$(dirname "$0")/gpu-common.sh"
exec > >(tee -a "$OUT/session.log") 2>&1
STEPS="${LILY_GPU_STEPS:-tests timing bench profile}"
CONTEXTS="${LILY_GPU_CONTEXTS:-256 4096 32768}"
BIG=/tmp/lily-35b
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }

echo "== gpu-session $(date -u +%FT%TZ) commit ${LILY_COMMIT:-unknown} steps: $STEPS"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
targets=(lily)
for f in tests/gpu/*.cu tests/gpu/*.cpp; do [[ -e "$f" ]] && targets+=("$(basename "${f%.*}")"); done
gpu_build build.log "${targets[@]}"

if has tests; then
  echo "== ctest -L gpu"
  t=${LILY_GPU_TESTS_TIMEOUT:-420}
  timeout "$t" ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout "$((t - 20))" >"$OUT/ctest-gpu.log" 2>&1 || status=1
  grep -E "Test +#|Total Test time" "$OUT/ctest-gpu.log" | tail -20
  grep -E "tests passed|tests failed|Failed|\*\*\*|FAILED|Expected|Which is|Failure" "$OUT/ctest-gpu.log" | head -60
fi

# The prefill kernels' binaries alone, each under a time limit (a quicker check than the whole
# suite): test_gdn, test_quant_gemm, test_cuda_e2e, with their timing lines.
if has prefill-tests; then
  for t in test_gdn test_quant_gemm test_cuda_e2e; do
    echo "== $t"
    timeout "${LILY_GPU_TEST_LIMIT:-120}" "$BUILD/tests/$t" >"$OUT/$t.txt" 2>&1 || { echo "$t: FAILED (rc $?)"; status=1; }
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|\[gdn|\[timing\]|TFLOP" "$OUT/$t.txt" | head -40
  done
fi

# The fused decode MoE block first, under a time limit (its grid barriers would hang, not fail,
# if the co-residency they rely on broke): on failure the later steps run with it off.
if has moe; then
  echo "== test_moe_block"
  timeout 240 "$BUILD/tests/test_moe_block" >"$OUT/moe-test.txt" 2>&1
  rc=$?
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|\[timing\]|Expected|Which is|Failure|error" "$OUT/moe-test.txt" | head -40
  if [[ $rc -ne 0 ]]; then
    echo "test_moe_block failed (rc $rc): the next steps (and later runs of this script) use LILY_CUDA_FUSED_MOE=0"
    touch /tmp/lily-fused-moe-failed
    status=1
  fi
fi
[[ -f /tmp/lily-fused-moe-failed ]] && export LILY_CUDA_FUSED_MOE=0

if has timing; then
  echo "== kernel timings (CudaTiming)"
  "$BUILD/tests/test_cuda_core_kernels" --gtest_filter="${LILY_GPU_TIMING_FILTER:-CudaTiming.*}" 2>&1 | grep -E "\[timing\]|FAILED" | tee "$OUT/timing.txt"
fi

if has bench || has e2e || has profile || has prefill-profile || has prefill-detail || has batched-profile || has base || has ab || has detail || has sampled; then
  if [[ ! -f "$BIG/model.safetensors" && ! -f "$BIG/model.safetensors.index.json" ]]; then  # one file, or shards
    echo "== lily synth --preset 35b-a3b"
    t1=$(date +%s)
    timeout 300 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$BIG" 2>&1 | tail -1 || status=1
    echo "synth: $(( $(date +%s) - t1 )) s"
  fi
fi

if has bench; then
  : >"$OUT/bench.txt"
  for n in $CONTEXTS; do
    echo "== lily bench --prompt-len $n (3 rounds, 64 decode steps)"
    timeout 240 "$BUILD/lily" bench --backend cuda --model "$BIG" --prompt-len "$n" --decode-steps 64 --rounds 3 \
      --json-out "/tmp/bench-$n.json" 2>&1 | tail -4 | tee -a "$OUT/bench.txt" || status=1
  done
  tar -czf "$OUT/bench-json.tar.gz" -C /tmp $(cd /tmp && ls bench-*.json 2>/dev/null) 2>/dev/null || true
fi

# A/B of run-time knobs: LILY_GPU_AB="A=0 A=0,B=0 ..." benches each environment (comma-separated
# assignments; "-" = none) at LILY_GPU_AB_LEN (default 256) tokens, 3 rounds.
if has ab; then
  : >"$OUT/ab.txt"
  for combo in ${LILY_GPU_AB:--}; do
    envs=(); [[ "$combo" != "-" ]] && IFS=, read -ra envs <<<"$combo"
    echo "== A/B: ${combo}" | tee -a "$OUT/ab.txt"
    env "${envs[@]}" timeout 200 "$BUILD/lily" bench --backend cuda --model "$BIG" --prompt-len "${LILY_GPU_AB_LEN:-256}" \
      --decode-steps 64 --rounds 3 --json-out /tmp/ab.json 2>&1 | tail -1 | tee -a "$OUT/ab.txt"
  done
fi

# test_cuda_e2e on the realdims synth and the 35b-a3b checkpoint (LILY_GPU_BIG_MODEL), once per
# setting of LILY_GPU_E2E_AB (as LILY_GPU_AB), tests LILY_GPU_E2E_FILTER (default: the decode
# graph's GEMV timeline). Whole output in $OUT/e2e.txt, the means here.
if has e2e; then
  : >"$OUT/e2e.txt"
  for combo in ${LILY_GPU_E2E_AB:--}; do
    envs=(); [[ "$combo" != "-" ]] && IFS=, read -ra envs <<<"$combo"
    echo "== e2e: ${combo}" | tee -a "$OUT/e2e.txt"
    env "${envs[@]}" LILY_GPU_BIG_MODEL="$BIG" timeout 300 "$BUILD/tests/test_cuda_e2e" \
      --gtest_filter="${LILY_GPU_E2E_FILTER:-CudaE2e.PrintsDecodeGraphGemvTimeline}" >>"$OUT/e2e.txt" 2>&1 || status=1
  done
  grep -E "^== e2e|mean|step from|FAILED|PASSED" "$OUT/e2e.txt"
fi

# Sampled decode, device sampler vs the host sampler (LILY_CUDA_DEVICE_SAMPLER=0), at
# LILY_GPU_SAMPLED_LEN (default 4096) tokens: each of LILY_GPU_SAMPLINGS (comma-separated bench
# flags, ";" between settings) with both samplers; the two digests must agree.
if has sampled; then
  : >"$OUT/sampled.txt"
  IFS=';' read -ra settings <<<"${LILY_GPU_SAMPLINGS:---temperature,0.7,--top-p,0.8,--top-k,20;--temperature,1,--min-p,0.05;--temperature,1,--top-p,0.95;--temperature,1}"
  for setting in "${settings[@]}"; do
    IFS=, read -ra flags <<<"$setting"
    for dev in ${LILY_GPU_SAMPLED_SAMPLERS:-1 0}; do  # "1": the device sampler alone
      echo "== sampled ${flags[*]} LILY_CUDA_DEVICE_SAMPLER=$dev" | tee -a "$OUT/sampled.txt"
      LILY_CUDA_DEVICE_SAMPLER=$dev timeout 200 "$BUILD/lily" bench --backend cuda --model "$BIG" \
        --prompt-len "${LILY_GPU_SAMPLED_LEN:-4096}" --decode-steps 64 --rounds 3 "${flags[@]}" 2>&1 | tail -1 | tee -a "$OUT/sampled.txt"
    done
  done
fi

# The device sampler's own tests with their timing lines, then compute-sanitizer racecheck and
# memcheck over its small-vocabulary cases.
if has sampler; then
  echo "== test_sampler_gpu"
  timeout 200 "$BUILD/tests/test_sampler_gpu" >"$OUT/sampler-test.txt" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |FAILED|agree|us per row|device [0-9]+, cpu" "$OUT/sampler-test.txt" | head -40
  # racecheck is slow (the 3,000-row case runs past 240 s): the tiny and batched cases only.
  for tool in racecheck memcheck; do
    filter='DeviceSampler.MatchesCpuTinyVocab:DeviceSampler.BatchedRowsMatchSingleRows'
    [[ $tool == memcheck ]] && filter="$filter:DeviceSampler.MatchesCpuSmallVocab"
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/tests/test_sampler_gpu" \
      --gtest_filter="$filter" >"$OUT/sanitizer-$tool.txt" 2>&1
    echo "compute-sanitizer $tool: rc $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid" "$OUT/sanitizer-$tool.txt" | head -5
  done
fi

# Before/after on the same machine: carry/base.tar (git archive of an earlier commit's
# CMakeLists.txt src bench tools scripts) is built into /tmp/lily-base and benched the same way.
if has base && [[ -f carry/base.tar ]]; then
  echo "== baseline tree (carry/base.tar)"
  rm -rf /tmp/base-src && mkdir -p /tmp/base-src && tar -xf carry/base.tar -C /tmp/base-src && ln -s "$PWD/models" /tmp/base-src/models
  (cd /tmp/base-src && cmake -S . -B /tmp/lily-base -G Ninja -DCMAKE_BUILD_TYPE=Release -DLILY_CUDA=ON -DBUILD_TESTING=OFF \
      -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 >/dev/null &&
    cmake --build /tmp/lily-base -j16 --target lily >/tmp/base-build.log 2>&1) || { echo "baseline build FAILED"; grep -E "error" /tmp/base-build.log | head; }
  : >"$OUT/bench-base.txt"
  for n in ${LILY_GPU_BASE_CONTEXTS:-$CONTEXTS}; do
    echo "== baseline lily bench --prompt-len $n"
    timeout 240 /tmp/lily-base/lily bench --backend cuda --model "$BIG" --prompt-len "$n" --decode-steps 64 --rounds 3 \
      --json-out "/tmp/base-bench-$n.json" 2>&1 | tail -4 | tee -a "$OUT/bench-base.txt"
  done
fi

# Nsight Compute detail (occupancy, throughput, warp stalls) of a few decode kernels of one step.
if has detail; then
  echo "== ncu detail"
  IDS=$(python3 -c "print(','.join(str((i * 2654435761) % 2**32 % 248320) for i in range(64)))")
  timeout 300 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --kernel-name-base "${LILY_GPU_DETAIL_BASE:-function}" \
    --kernel-name "regex:${LILY_GPU_DETAIL:-quant_mma_gemv|expert_gate_up|expert_down|router_fused|gdn_decode|decode_split}" \
    --launch-skip "${LILY_GPU_DETAIL_SKIP:-400}" --launch-count "${LILY_GPU_DETAIL_COUNT:-10}" \
    "$BUILD/lily" generate --backend cuda --model "$BIG" --prompt-ids "$IDS" --max-tokens 4 >"$OUT/ncu-detail.txt" 2>&1 ||
    { echo "ncu detail failed"; tail -5 "$OUT/ncu-detail.txt"; }
  grep -E "^  [a-z_].*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit" \
    "$OUT/ncu-detail.txt" | head -120
fi

# Nsight Compute full sections with per-instruction warp-stall samples (SASS) of a few decode
# kernels: LILY_GPU_SOURCE (demangled-name regex), LILY_GPU_SOURCE_SKIP / _COUNT. Writes the
# details page and the source page (CSV, gzipped) under $OUT.
if has source; then
  echo "== ncu source-level stalls"
  IDS=$(python3 -c "print(','.join(str((i * 2654435761) % 2**32 % 248320) for i in range(64)))")
  rm -f /tmp/src.ncu-rep
  timeout 400 ncu --clock-control none --set full --import-source no --kernel-name-base demangled \
    --kernel-name "regex:${LILY_GPU_SOURCE:-router_fused|expert_down|quant_mma_gemv_kernel<float>}" \
    --launch-skip "${LILY_GPU_SOURCE_SKIP:-0}" --launch-count "${LILY_GPU_SOURCE_COUNT:-3}" -o /tmp/src \
    "$BUILD/lily" generate --backend cuda --model "$BIG" --prompt-ids "$IDS" --max-tokens 4 >/tmp/ncu-src.log 2>&1 ||
    { echo "ncu source failed"; tail -5 /tmp/ncu-src.log; }
  if [[ -f /tmp/src.ncu-rep ]]; then
    ncu --import /tmp/src.ncu-rep --page details >"$OUT/ncu-full.txt" 2>&1
    ncu --import /tmp/src.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip >"$OUT/ncu-source.csv.gz"
    grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu-full.txt" | head -40
  fi
fi

# ncu_generate_table NAME PROMPT_TOKENS MAX_TOKENS [TABLE_FLAGS]: Nsight Compute (each kernel
# alone, its duration) over `lily generate` on the big checkpoint, tabulated by kernel name
# (scripts/ncu-decode-table.py) into $OUT/NAME.md.
ncu_generate_table() {
  local name=$1 n=$2 max=$3 flags=${4:-}
  local ids; ids=$(python3 -c "print(','.join(str((i * 2654435761) % 2**32 % 248320) for i in range($n)))")
  rm -f "/tmp/$name.ncu-rep"
  timeout 400 ncu --clock-control none --metrics gpu__time_duration.sum -o "/tmp/$name" \
    "$BUILD/lily" generate --backend cuda --model "$BIG" --prompt-ids "$ids" --max-tokens "$max" >"/tmp/$name.log" 2>&1 ||
    { echo "ncu failed"; tail -5 "/tmp/$name.log"; }
  if [[ -f "/tmp/$name.ncu-rep" ]]; then
    ncu --import "/tmp/$name.ncu-rep" --csv --page raw --metrics gpu__time_duration.sum >"/tmp/$name.csv" 2>/dev/null
    python3 scripts/ncu-decode-table.py $flags "/tmp/$name.csv" | tee "$OUT/$name.md"
  fi
}

if has profile; then
  echo "== ncu: 3 decode steps after a 64-token prompt"
  ncu_generate_table profile 64 4
fi
# Nsight Compute over one prefill of each LILY_GPU_PREFILL_LENS-token prompt (default 2048, one
# chunk): the warm-up prefill of `lily bench` (its prompt passes no command line, so any length
# works), every kernel timed alone, tabulated by kernel name into $OUT/prefill-profile-N.md.
if has prefill-profile; then
  for n in ${LILY_GPU_PREFILL_LENS:-${LILY_GPU_PREFILL_LEN:-2048}}; do
    echo "== ncu: prefill of $n tokens"
    rm -f "/tmp/pp-$n.ncu-rep"
    timeout 450 ncu --clock-control none --metrics gpu__time_duration.sum -o "/tmp/pp-$n" \
      "$BUILD/lily" bench --backend cuda --model "$BIG" --prompt-len "$n" --decode-steps 1 --rounds 1 >"/tmp/pp-$n.log" 2>&1 ||
      { echo "ncu failed"; tail -5 "/tmp/pp-$n.log"; }
    if [[ -f "/tmp/pp-$n.ncu-rep" ]]; then
      ncu --import "/tmp/pp-$n.ncu-rep" --csv --page raw --metrics gpu__time_duration.sum >"/tmp/pp-$n.csv" 2>/dev/null
      python3 scripts/ncu-decode-table.py --prefill "/tmp/pp-$n.csv" | tee "$OUT/prefill-profile-$n.md"
    fi
  done
fi

# Nsight Compute sections (speed of light, warp stall reasons, instruction mix, occupancy) for the
# first launches of the prefill's heavy kernels on one 2,048-token chunk: the dense and grouped
# GEMMs, both GDN passes and flash attention. Text report in $OUT/prefill-detail.txt.
if has prefill-detail; then
  echo "== ncu sections: prefill kernels of one 2,048-token chunk"
  ids=$(python3 -c "print(','.join(str((i * 2654435761) % 2**32 % 248320) for i in range(2048)))")
  sections=(--section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis
            --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats)
  for k in "regex:wgmma|regdq|quant_gemm_kernel|gdn_chunk|router_gemm:9" "regex:flash:1"; do
    timeout 200 ncu --clock-control none "${sections[@]}" -k "${k%:*}" --launch-count "${k##*:}" \
      "$BUILD/lily" generate --backend cuda --model "$BIG" --prompt-ids "$ids" --max-tokens 1 \
      >>"$OUT/prefill-detail.txt" 2>&1 || echo "ncu ($k) failed"
  done
  grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Stall|Issued Ipc|Registers Per|Achieved Occupancy" \
    "$OUT/prefill-detail.txt" | head -80
fi

# Nsight Compute over 3 batched decode steps of LILY_GPU_BATCH_ROWS (default 8) sequences on the
# big checkpoint (CudaE2e.PrintsBatchedDecodeThroughput under LILY_GPU_BATCH_PROFILE), the last
# step tabulated by kernel name.
if has batched-profile; then
  echo "== ncu: batched decode, ${LILY_GPU_BATCH_ROWS:-8} rows"
  rm -f /tmp/bprof.ncu-rep
  LILY_GPU_BIG_MODEL="$BIG" LILY_GPU_BATCH_PROFILE="${LILY_GPU_BATCH_ROWS:-8}" timeout 400 ncu --clock-control none \
    --profile-from-start off --metrics gpu__time_duration.sum -o /tmp/bprof \
    "$BUILD/tests/test_cuda_e2e" --gtest_filter=CudaE2e.PrintsBatchedDecodeThroughput >/tmp/ncu-brun.log 2>&1 ||
    { echo "ncu batched failed"; tail -5 /tmp/ncu-brun.log; }
  if [[ -f /tmp/bprof.ncu-rep ]]; then
    ncu --import /tmp/bprof.ncu-rep --csv --page raw --metrics gpu__time_duration.sum >/tmp/bprof.csv 2>/dev/null
    python3 scripts/ncu-decode-table.py /tmp/bprof.csv | tee "$OUT/batched-profile.md"
  fi
fi

# The prefix-cache timings of the server (scripts/gpu-cache-check.sh) on the build above.
if has cache; then
  echo "== prefix cache (gpu-cache-check.sh)"
  LILY_GPU_BUILD="$BUILD" timeout 300 bash scripts/gpu-cache-check.sh 2>&1 | tee "$OUT/cache.txt" | tail -40 || status=1
fi
echo "== gpu-session done, status $status"
exit $status
