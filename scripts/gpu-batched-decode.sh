#!/usr/bin/env bash
# The batched decode's GPU check in one command (on a GPU machine, from the repository root, with
# carry/deps copied along: scripts/make-carry.sh makes it): build, the batched kernels against the
# one-sequence kernels (test_batched_decode), the end-to-end batched tests and throughput
# printout (CudaE2e.BatchedDecode*, CudaE2e.PrintsBatchedDecodeThroughput), then the whole `gpu`
# suite with the switch off (the default paths must be unchanged) and on (every decode test
# through the batched path). Logs under $OUT (default ./gpu-logs); a summary on stdout.
#
# All three steps fit one run of a few minutes (the whole `gpu` suite takes about 70 s on an
# H200, the build about 60 s); each can also run alone:
#   LILY_GPU_STEPS=batched bash scripts/gpu-batched-decode.sh   # build + the batched tests
#   LILY_GPU_STEPS=off bash scripts/gpu-batched-decode.sh       # the whole suite, switch off
#   LILY_GPU_STEPS=on bash scripts/gpu-batched-decode.sh        # the whole suite, switch on
#   LILY_GPU_STEPS=streams bash scripts/gpu-batched-decode.sh   # served streams, switch off/on
#   LILY_GPU_STEPS=moe      the fused MoE block's tests and timings (under a time limit)
#   LILY_GPU_STEPS=e2e-on   only test_cuda_e2e with the switch on (quicker than "on")
#   LILY_GPU_STEPS=big      the 35b-a3b synth: batched throughput B = 1 … 64 and lily bench at
#                           256 / 4K tokens with the switch off and on
#   LILY_GPU_STEPS=throughput  only the 35b-a3b batched throughput printout
#   LILY_GPU_STEPS=balance  the MoE rows kernel's split by cost (LILY_CUDA_MOE_TILE_BALANCE):
#                           test_moe_block (its bit tests and the chain sweep of weights at 48
#                           and 64 rows), then the 35b-a3b throughput once per weight of
#                           LILY_GPU_BALANCE (default "0 16")
#   LILY_GPU_STEPS=route    the MoE rows kernel's bit tests (route once against every block
#                           routing, CudaMoeBlock.Rows*) and its chain timings (route once or not)
#   LILY_GPU_STEPS=split-gemv  the rows mode's two warp groups (LILY_CUDA_ROWS_GEMV_SPLIT): the
#                           GEMV bit tests (every row count, both forms) and the timing table
#                           (direct, one group, two)
#   LILY_GPU_STEPS=ksplit   the k-split GEMV (LILY_CUDA_ROWS_GEMV_KSPLIT_FROM): its bit tests
#                           against the streaming GEMV, the GEMV timing table (every mode), the
#                           switch test, then the 35b-a3b throughput once per threshold of
#                           LILY_GPU_KSPLIT_FROM (default "65 9"; LILY_GPU_KSPLIT_ROUNDS times
#                           each, alternating; default 2)
#   LILY_GPU_STEPS=claims   the MoE rows kernel's tile claims after fixed shares
#                           (LILY_CUDA_MOE_TILE_CLAIMS_FIXED): bit tests, chain timings, phases,
#                           then the throughput per LILY_GPU_CLAIMS_SPLITS ("FROM:FIXED" pairs)
#   LILY_GPU_STEPS=gdn-rows the batched GDN step: its bit tests, the one-sequence GDN tests, the
#                           persistent kernel against the decode graph (its GDN task has the
#                           step's arithmetic), the batched end-to-end tests, and the timing table
#                           (CudaTiming.PrintsGdnRowsTimes: 1 … 64 rows beside a copy of the same
#                           bytes)
#   LILY_GPU_STEPS=rows-norm  the input norms inside the in-projections (LILY_CUDA_ROWS_GEMV_NORM):
#                           the GEMV bit tests (CudaBatchedDecode.RowsNorm*), the batched end-to-end
#                           tests with it on, then the 35b-a3b throughput with it 0 and 1
#                           (LILY_GPU_ROWS_NORM_ROUNDS times each, alternating; default 2)
#   LILY_GPU_STEPS=split    the 35b-a3b throughput once per rows-mode split form of
#                           LILY_GPU_SPLIT_FORMS (default "0 tiles all"; LILY_GPU_SPLIT_ROUNDS
#                           times each, alternating; default 1)
#   LILY_GPU_STEPS=rows     the batched GEMV's rows mode (LILY_CUDA_ROWS_GEMV_FROM) and the
#                           prefill rows of several sequences in one chunk (LILY_CUDA_PREFILL_ROWS):
#                           the GEMV bit tests and timings of both modes, the switch test, then
#                           per configuration "from,prefill-rows" of LILY_GPU_ROWS_CONFIGS
#                           (default "33,0 2,0 2,1") the batched end-to-end tests, the 35b-a3b
#                           throughput and served streams (LILY_GPU_ROWS_KERNEL_TESTS=0: the
#                           configurations only)
#   LILY_GPU_STEPS=ab       with carry/base.tar (git archive of a baseline tree, built in
#                           /tmp/lily-base): lily bench at LILY_GPU_CONTEXTS (default 256 2048)
#                           and served streams (LILY_GPU_STREAMS, --max-batch LILY_GPU_AB_MAX_BATCH,
#                           default 32), new then base; LILY_GPU_AB_ROUNDS=N alternates them N
#                           times, LILY_GPU_AB_SERVE=0 leaves out the served streams,
#                           LILY_GPU_AB_THROUGHPUT=1 adds the batched throughput printout of each
#                           tree (its test_cuda_e2e built too)
#   LILY_GPU_STEPS=prof-gemv  Nsight Compute sections (stalls, memory) of the row GEMV (or of the
#                           kernels LILY_GPU_PROF_KERNEL names, a regex) at the first of
#                           LILY_GPU_PROFILE_ROWS rows
#   LILY_GPU_STEPS=prof-source  Nsight Compute's per-instruction stall samples of that kernel
#                           (build with LILY_GPU_CMAKE_FLAGS=-DCMAKE_CUDA_FLAGS=-lineinfo)
#   LILY_GPU_STEPS=persistent  the persistent decode kernel: its end-to-end tests (resident vs
#                           stages bit for bit, against the CPU and the decode graph), then lily bench on
#                           the 35b-a3b synth at LILY_GPU_CONTEXTS (default 256 4096), persistent-decode 0, debug and 1 (LILY_GPU_PERSISTENT_MODES)
#   LILY_GPU_STEPS=trace    the resident kernel's timeline (persistent-decode=trace) at
#                           LILY_GPU_CONTEXTS (default 4096): what each task kind adds to the chain
#   LILY_GPU_STEPS=prof-persistent  Nsight Compute: one step of the persistent kernel's debug form
#                           stage by stage (scripts/ncu-stage-table.py), and the resident kernel's
#                           time and DRAM bytes a step (35b-a3b synth, 256-token prompt)
#   LILY_GPU_STEPS=stalls   Nsight Compute: why the resident kernel's warps wait (stall reasons per
#                           issued instruction, one launch, 35b-a3b synth)
#   LILY_GPU_STEPS=tasks    the persistent kernel's counters (test_task_sync: the 35B-A3B task
#                           list with synthetic bodies against the host, and its cost)
#   LILY_GPU_STEPS=perf     the kernel case tables in perf mode (LILY_GPU_PERF=1): the GEMV, dense
#                           and grouped GEMM and attention cases, checked and timed, [perf] lines
#                           in $OUT/perf.log
#   LILY_GPU_STEPS=prof     Nsight Compute: the kernels of one batched step of the 35b-a3b synth
#                           at LILY_GPU_PROFILE_ROWS rows (default "8 32"), a table per row count
#                           (scripts/ncu-decode-table.py)
# With LILY_GPU_BIG_MODEL naming a 35b-a3b checkpoint the throughput printout covers it too.
# The streams step makes the 35b-a3b synth (with the demo tokenizer) under /tmp/lily-35b-tok,
# serves it with --max-batch LILY_GPU_MAX_BATCH (default 32) and sends LILY_GPU_STREAMS (default
# "8 32") concurrent streams of LILY_GPU_STREAM_TOKENS (default 128) tokens, batched decode off
# and on (scripts/concurrent-streams.py; LILY_GPU_PROMPT_WORDS lengthens each prompt by that many
# one-token words, e.g. 229 for the batching contract's 256-token prompts), once per value of
# LILY_GPU_DECODE_ROWS (LILY_CUDA_DECODE_ROWS, the rows of one batched forward; default: the
# default), e.g. "32 64" with LILY_GPU_MAX_BATCH=64 and LILY_GPU_STREAMS="8 32 64" for the 64-row
# forward against two of 32 (decode rows above the max batch change nothing).
set -uo pipefail
export LILY_GPU_BUILD="${LILY_GPU_BUILD:-/tmp/lily-build}"
source "$(dirname "$0")/gpu-common.sh"
STEPS="${LILY_GPU_STEPS:-batched off on}"
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }

targets=()
# The steps that run lily or the 35b-a3b synth (made below when missing).
needs_big_model() {
  local s
  for s in streams big throughput balance split ksplit rows rows-norm claims prof prof-gemv prof-source persistent prof-persistent trace stalls ab; do
    has "$s" && return 0
  done
  return 1
}
needs_big_model && targets+=(lily)
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
if has tasks; then
  echo "== test_task_sync"
  timeout 300 "$BUILD/tests/test_task_sync" >"$OUT/task-sync.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|timing\]" "$OUT/task-sync.log" | head -20
fi
if has perf; then
  echo "== the kernel case tables in perf mode"
  : >"$OUT/perf.log"
  while read -r bin filter; do  # a test binary and its gtest filter
    LILY_GPU_PERF=1 timeout 300 "$BUILD/tests/$bin" --gtest_filter="$filter" </dev/null >"$OUT/perf-$bin.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/perf-$bin.log" | head -5
    grep -E "^\[perf\]" "$OUT/perf-$bin.log" >>"$OUT/perf.log"
  done <<'EOF2'
test_cuda_core_kernels Cases/CudaGemv.*
test_quant_gemm Cases/*
test_attention Cases/AttentionDecode.*:Cases/AttentionPrefill.*
EOF2
  wc -l "$OUT/perf.log"
fi
if has moe; then
  echo "== test_moe_block"
  timeout 300 "$BUILD/tests/test_moe_block" >"$OUT/moe-test.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|\[timing\]|Expected|Which is|Failure|error" "$OUT/moe-test.log" | head -40
fi
if has split-gemv; then
  echo "== test_batched_decode: the GEMV bit tests and timings"
  timeout 300 "$BUILD/tests/test_batched_decode" --gtest_filter='CudaBatchedDecode.Gemv*:CudaTiming.PrintsGemvRowsTimes' \
    >"$OUT/split-gemv.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|timing\]" "$OUT/split-gemv.log" | head -60
fi
if has route; then
  echo "== test_moe_block: the rows kernel's bit tests and the chain timings (route once or in every block)"
  timeout 240 "$BUILD/tests/test_moe_block" --gtest_filter='CudaMoeBlock.Rows*:CudaTiming.PrintsMoeBlockTimes' \
    >"$OUT/route-moe.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|route once|every block routes" "$OUT/route-moe.log" | head -40
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
    ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 520 ${LILY_GPU_CTEST_VERBOSE:+-V} \
    >"$OUT/ctest-gpu-$mode.log" 2>&1 || status=1
  grep -E "Test +#|tests passed|tests failed" "$OUT/ctest-gpu-$mode.log" | tail -14
  grep -E "FAILED|Failure|Expected|Which is" "$OUT/ctest-gpu-$mode.log" | head -30
  # LILY_GPU_CTEST_VERBOSE=1: every test's output is in the log, so the MoE timings need no "moe" step.
  [[ -n "${LILY_GPU_CTEST_VERBOSE:-}" ]] && grep -E "\[timing\] moe block" "$OUT/ctest-gpu-$mode.log" | sed 's/^[0-9]*: //' | head -70
done
M=/tmp/lily-35b-tok
# serve_streams LABEL PORT LOG COMMAND...: starts COMMAND (a `lily serve` on PORT, output to LOG),
# waits for /health, sends LILY_GPU_STREAMS (default "8 32") concurrent streams of
# LILY_GPU_STREAM_TOKENS (default 128) tokens each (scripts/concurrent-streams.py), then stops it.
serve_streams() {
  local label="$1" port="$2" log="$3"
  shift 3
  "$@" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
  for n in ${LILY_GPU_STREAMS:-8 32}; do
    echo "== served streams, $label: $n × ${LILY_GPU_STREAM_TOKENS:-128} tokens"
    timeout 120 python3 scripts/concurrent-streams.py --url "http://127.0.0.1:$port" --streams "$n" \
      --tokens "${LILY_GPU_STREAM_TOKENS:-128}" --prompt-words "${LILY_GPU_PROMPT_WORDS:-0}" 2>&1 | tail -3 || status=1
  done
  grep -E "prefix cache" "$log" | head -1
  kill -INT "$pid"
  wait "$pid"
}
if needs_big_model && [[ ! -f "$M/config.json" ]]; then
  timeout 300 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$M" --tokenizer models/demo/tokenizer.json | tail -1
fi
# throughput_sweep VAR VALUES ROUNDS TAG: the 35b-a3b batched throughput printout once per value
# of the switch VAR (VALUES, space-separated), ROUNDS times over, alternating; logs
# $OUT/TAG-throughput-VALUE-ROUND.log.
throughput_sweep() {
  local var="$1" values="$2" rounds="$3" tag="$4" round v
  for round in $(seq 1 "$rounds"); do
    for v in $values; do
      echo "== batched decode throughput, 35b-a3b, $var=$v (round $round)"
      env "$var=$v" LILY_GPU_BIG_MODEL="$M" timeout 300 "$BUILD/tests/test_cuda_e2e" \
        --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' 2>&1 | grep -E "timing\]|FAILED" | grep -v realdims |
        tee "$OUT/$tag-throughput-$v-$round.log"
    done
  done
}
if has throughput; then
  echo "== batched decode throughput, 35b-a3b"
  LILY_GPU_BIG_MODEL="$M" timeout 300 "$BUILD/tests/test_cuda_e2e" --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' \
    2>&1 | grep -E "timing\]|FAILED" | grep -v realdims | tee "$OUT/big-throughput.log"
fi
if has ksplit; then
  echo "== test_batched_decode: the k-split bit tests, the GEMV bit tests and timings; test_kernel_switches"
  timeout 300 "$BUILD/tests/test_batched_decode" \
    --gtest_filter='CudaBatchedDecode.Ksplit*:CudaBatchedDecode.Gemv*:CudaTiming.PrintsGemvRowsTimes' \
    >"$OUT/ksplit-gemv.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|timing\]" "$OUT/ksplit-gemv.log" | head -80
  timeout 120 "$BUILD/tests/test_kernel_switches" >"$OUT/ksplit-switches.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure" "$OUT/ksplit-switches.log" | head -10
  throughput_sweep LILY_CUDA_ROWS_GEMV_KSPLIT_FROM "${LILY_GPU_KSPLIT_FROM:-65 9}" "${LILY_GPU_KSPLIT_ROUNDS:-2}" ksplit
fi
if has claims; then
  echo "== test_moe_block: the rows kernel's bit tests (tile claims after fixed shares among them), chain timings, phases"
  timeout 420 "$BUILD/tests/test_moe_block" \
    --gtest_filter='CudaMoeBlock.Rows*:CudaTiming.PrintsMoeBlockTimes:CudaTiming.PrintsMoeBlockPhases' \
    >"$OUT/claims-moe.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|tiles claimed|fixed shares|phase (barrier|rows|ids|routing|requests|gate|down)" \
    "$OUT/claims-moe.log" | head -150
  timeout 120 "$BUILD/tests/test_kernel_switches" >"$OUT/claims-switches.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure" "$OUT/claims-switches.log" | head -10
  obj=$(find "$BUILD" -name 'moe_block_rows.cu.o' | head -1)
  [[ -n "$obj" ]] && cuobjdump -sass "$obj" 2>/dev/null | grep -oE "ATOMS\.[A-Z0-9.]+" | sort | uniq -c
  # Batched throughput per split: "FROM:FIXED" pairs (65: no claims).
  for round in $(seq 1 "${LILY_GPU_CLAIMS_ROUNDS:-1}"); do
    for pair in ${LILY_GPU_CLAIMS_SPLITS:-65:0 17:75 17:90}; do
      echo "== batched decode throughput, 35b-a3b, claims from ${pair%%:*}, ${pair##*:} % fixed (round $round)"
      LILY_CUDA_MOE_TILE_CLAIMS_FROM=${pair%%:*} LILY_CUDA_MOE_TILE_CLAIMS_FIXED=${pair##*:} LILY_GPU_BIG_MODEL="$M" \
        LILY_GPU_BATCHED_ONLY=1 \
        timeout 300 "$BUILD/tests/test_cuda_e2e" --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' 2>&1 |
        grep -E "timing\]|FAILED" | grep -v realdims | grep -v "decode off" | tee "$OUT/claims-throughput-${pair/:/-}-$round.log"
    done
  done
fi
if has gdn-rows; then
  echo "== test_batched_decode: the GDN step's bit tests and timings; test_gdn; the persistent kernel against the graph"
  timeout 300 "$BUILD/tests/test_batched_decode" --gtest_filter='CudaBatchedDecode.Gdn*:CudaTiming.PrintsGdnRowsTimes' \
    >"$OUT/gdn-rows.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|timing\]" "$OUT/gdn-rows.log" | head -40
  timeout 300 "$BUILD/tests/test_gdn" >"$OUT/gdn-tests.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|decode step" "$OUT/gdn-tests.log" | head -20
  timeout 300 "$BUILD/tests/test_cuda_e2e" --gtest_filter='CudaE2e.PersistentDecodeMatchesTheDecodeGraph:CudaE2e.BatchedDecode*' \
    >"$OUT/gdn-e2e.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|bit-identical" "$OUT/gdn-e2e.log" | head -20
fi
if has rows-norm; then
  echo "== test_batched_decode: the fused rows norm's bit tests; the batched end-to-end tests with it on"
  timeout 300 "$BUILD/tests/test_batched_decode" --gtest_filter='CudaBatchedDecode.RowsNorm*:CudaBatchedDecode.GemvRows*' \
    >"$OUT/rows-norm-gemv.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is" "$OUT/rows-norm-gemv.log" | head -40
  LILY_CUDA_ROWS_GEMV_NORM=1 timeout 420 "$BUILD/tests/test_cuda_e2e" --gtest_filter='CudaE2e.BatchedDecode*' \
    >"$OUT/rows-norm-e2e.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|bit-identical" "$OUT/rows-norm-e2e.log" | head -30
  throughput_sweep LILY_CUDA_ROWS_GEMV_NORM "0 1" "${LILY_GPU_ROWS_NORM_ROUNDS:-2}" rows-norm
fi
if has split; then
  throughput_sweep LILY_CUDA_ROWS_GEMV_SPLIT "${LILY_GPU_SPLIT_FORMS:-0 tiles all}" "${LILY_GPU_SPLIT_ROUNDS:-1}" split
fi
if has balance; then
  echo "== test_moe_block (tile balance bits and sweep)"
  timeout 300 "$BUILD/tests/test_moe_block" >"$OUT/balance-moe.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|tile balance|rows kernel, (48|64) rows " "$OUT/balance-moe.log"
  for w in ${LILY_GPU_BALANCE:-0 16}; do
    echo "== batched decode throughput, 35b-a3b, LILY_CUDA_MOE_TILE_BALANCE=$w"
    LILY_CUDA_MOE_TILE_BALANCE=$w LILY_GPU_BIG_MODEL="$M" timeout 300 "$BUILD/tests/test_cuda_e2e" \
      --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' 2>&1 | grep -E "timing\]|FAILED" | grep -v realdims |
      tee "$OUT/balance-throughput-$w.log"
  done
fi
if has rows; then
  if [[ "${LILY_GPU_ROWS_KERNEL_TESTS:-1}" == 1 ]]; then  # 0: only the configurations below
    echo "== test_batched_decode (both GEMV modes) and test_kernel_switches"
    timeout 300 "$BUILD/tests/test_batched_decode" >"$OUT/rows-kernels.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|differ|timing\]" "$OUT/rows-kernels.log" | head -60
    timeout 60 "$BUILD/tests/test_kernel_switches" 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure" || status=1
  fi
  # Each configuration: "rows-GEMV-from,prefill-rows" (LILY_CUDA_ROWS_GEMV_FROM, LILY_CUDA_PREFILL_ROWS).
  for cfg in ${LILY_GPU_ROWS_CONFIGS:-33,0 2,0 2,1}; do
    from="${cfg%,*}" prows="${cfg#*,}"
    echo "== LILY_CUDA_ROWS_GEMV_FROM=$from LILY_CUDA_PREFILL_ROWS=$prows: batched e2e tests, 35b-a3b throughput"
    LILY_CUDA_ROWS_GEMV_FROM=$from LILY_CUDA_PREFILL_ROWS=$prows timeout 420 "$BUILD/tests/test_cuda_e2e" \
      --gtest_filter='CudaE2e.BatchedDecode*:CudaE2e.StepRows*:CudaE2e.PrefillRows*' >"$OUT/rows-e2e-$from-$prows.log" 2>&1 ||
      status=1
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|bit-identical" "$OUT/rows-e2e-$from-$prows.log" | head -20
    LILY_CUDA_ROWS_GEMV_FROM=$from LILY_GPU_BIG_MODEL="$M" timeout 300 "$BUILD/tests/test_cuda_e2e" \
      --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' 2>&1 | grep -E "timing\]|FAILED" | grep -v realdims |
      tee "$OUT/rows-throughput-$from-$prows.log"
    serve_streams "rows GEMV from $from, prefill rows $prows" 18095 "$OUT/serve-rows-$from-$prows.log" \
      env LILY_CUDA_ROWS_GEMV_FROM=$from LILY_CUDA_PREFILL_ROWS=$prows "$BUILD/lily" serve --backend cuda --model "$M" \
      --port 18095 --max-seq 4096
  done
fi
if has prof; then
  for rows in ${LILY_GPU_PROFILE_ROWS:-8 32}; do
    echo "== ncu: the kernels of one batched step of $rows rows, 35b-a3b"
    rm -f "/tmp/batch-$rows.ncu-rep"
    LILY_GPU_BIG_MODEL="$M" LILY_GPU_BATCH_PROFILE="$rows" timeout 240 ncu --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum -o "/tmp/batch-$rows" "$BUILD/tests/test_cuda_e2e" \
      --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' >"$OUT/prof-$rows.log" 2>&1 || status=1
    ncu --import "/tmp/batch-$rows.ncu-rep" --csv --page raw --metrics gpu__time_duration.sum >"/tmp/batch-$rows.csv" 2>/dev/null &&
      python3 scripts/ncu-decode-table.py "/tmp/batch-$rows.csv" | tee "$OUT/prof-$rows-table.txt" | head -40
  done
fi
if has prof-gemv; then
  # Stall reasons and memory traffic of the row GEMV at LILY_GPU_PROFILE_ROWS rows (one row count):
  # three launches of the streaming kernel inside one profiled batched step.
  rows="${LILY_GPU_PROFILE_ROWS%% *}" kernel="${LILY_GPU_PROF_KERNEL:-quant_stream_gemv}"
  echo "== ncu: $kernel in a batched step of $rows rows, 35b-a3b"
  LILY_GPU_BIG_MODEL="$M" LILY_GPU_BATCH_PROFILE="$rows" timeout 300 ncu --clock-control none --profile-from-start off \
    -k "regex:$kernel" --launch-count 3 --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats "$BUILD/tests/test_cuda_e2e" \
    --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' >"$OUT/prof-gemv-$rows.txt" 2>&1 || status=1
  grep -E "$kernel|Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Stall|Issued Warp|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit|Dynamic Shared" \
    "$OUT/prof-gemv-$rows.txt" | head -80
fi
if has prof-source; then
  # Per-instruction stall samples (Nsight Compute's source page, SASS with CUDA lines when the
  # build has -lineinfo) of the first launch of LILY_GPU_PROF_KERNEL in a batched step.
  rows="${LILY_GPU_PROFILE_ROWS%% *}" kernel="${LILY_GPU_PROF_KERNEL:-quant_stream_gemv}"
  echo "== ncu source page: $kernel in a batched step of $rows rows, 35b-a3b"
  rm -f /tmp/prof-source.ncu-rep
  LILY_GPU_BIG_MODEL="$M" LILY_GPU_BATCH_PROFILE="$rows" timeout 300 ncu --clock-control none --profile-from-start off \
    -k "regex:$kernel" --launch-count 1 --section SourceCounters --section WarpStateStats -o /tmp/prof-source \
    "$BUILD/tests/test_cuda_e2e" --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' >"$OUT/prof-source.log" 2>&1 ||
    status=1
  ncu --import /tmp/prof-source.ncu-rep --page source --csv --print-source cuda,sass >"$OUT/prof-source.csv" 2>&1 ||
    ncu --import /tmp/prof-source.ncu-rep --page source --csv >"$OUT/prof-source.csv" 2>&1
  ncu --import /tmp/prof-source.ncu-rep --page details >"$OUT/prof-source-details.txt" 2>&1
  wc -l "$OUT/prof-source.csv"; head -c 600 "$OUT/prof-source.csv"
fi
if has persistent; then
  # One process per test: the stages (no counters) first, so that a resident kernel that traps
  # (a counter wait past 5 s) still leaves the stages' result.
  for t in StagesMatchCpu IsBitIdenticalToItsStages MatchesTheDecodeGraph; do
    echo "== test_cuda_e2e --gtest_filter=CudaE2e.PersistentDecode$t"
    timeout 240 "$BUILD/tests/test_cuda_e2e" --gtest_filter="CudaE2e.PersistentDecode$t" >"$OUT/persistent-$t.log" 2>&1 ||
      status=1
    grep -E "^\[  (PASSED|FAILED) |^\[ +(OK|FAILED) |Failure|Expected|Which is|differs|bit-identical|routing:|error|step [0-8]:|diverging|probe diff" \
      "$OUT/persistent-$t.log" | head -40
  done
  for mode in ${LILY_GPU_PERSISTENT_MODES:-0 debug 1}; do
    for n in ${LILY_GPU_CONTEXTS:-256 4096}; do
      echo "== lily bench --prompt-len $n --cuda persistent-decode=$mode, 35b-a3b"
      timeout 200 "$BUILD/lily" bench --backend cuda --model "$M" --cuda persistent-decode=$mode --prompt-len "$n" \
        --decode-steps 64 --rounds 3 2>&1 | tail -1 | tee -a "$OUT/persistent-bench.log"
    done
  done
fi
if has trace; then
  # The resident kernel's timeline (persistent-decode=trace): per task kind the time its stages
  # add to the step's chain, bodies and waits, at each of LILY_GPU_CONTEXTS (default 4096).
  for n in ${LILY_GPU_CONTEXTS:-4096}; do
    echo "== lily bench --prompt-len $n --cuda persistent-decode=trace, 35b-a3b"
    timeout 200 "$BUILD/lily" bench --backend cuda --model "$M" --cuda persistent-decode=trace --prompt-len "$n" \
      --decode-steps 32 --rounds 1 >"$OUT/trace-$n.log" 2>&1 || status=1
    grep -v "^lily: info: \(loaded\|chat\)" "$OUT/trace-$n.log" | head -60
  done
fi
if has prof-persistent; then
  # One step of the debug form, stage by stage (scripts/ncu-stage-table.py), then the resident
  # kernel's time and DRAM bytes a step, after a 256-token prompt.
  echo "== ncu: the persistent decode kernel's stages, 35b-a3b"
  timeout 240 ncu --clock-control none --kernel-name regex:decode_stage_kernel --launch-count 263 \
    --metrics gpu__time_duration.sum --csv --page raw "$BUILD/lily" bench --backend cuda --model "$M" \
    --cuda persistent-decode=debug --prompt-len 256 --decode-steps 2 --rounds 1 >"$OUT/prof-stages.csv" 2>&1 || status=1
  python3 scripts/ncu-stage-table.py "$OUT/prof-stages.csv" | tee "$OUT/prof-stages-table.txt"
  echo "== ncu: the resident kernel, 35b-a3b"
  timeout 240 ncu --clock-control none --kernel-name regex:decode_megakernel --launch-count 3 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw "$BUILD/lily" bench --backend cuda \
    --model "$M" --cuda persistent-decode=1 --prompt-len 256 --decode-steps 4 --rounds 1 >"$OUT/prof-resident.csv" 2>&1 ||
    status=1
  python3 -c 'import csv,sys; rows=list(csv.DictReader(l for l in open(sys.argv[1]) if l.startswith("\""))); [print(r["gpu__time_duration.sum"], r["dram__bytes_read.sum"]) for r in rows]' \
    "$OUT/prof-resident.csv"
fi
if has stalls; then
  # Why the resident kernel's warps wait (Nsight Compute's warp-state sampling of one launch after
  # a 256-token prompt): each stall reason in cycles per issued instruction, largest first.
  echo "== ncu: the resident kernel's warp states, 35b-a3b"
  timeout 240 ncu --clock-control none --kernel-name regex:decode_megakernel --launch-skip 2 --launch-count 1 \
    --section WarpStateStats --section InstructionStats --csv --page raw "$BUILD/lily" bench --backend cuda \
    --model "$M" --cuda persistent-decode=1 --prompt-len 256 --decode-steps 4 --rounds 1 >"$OUT/prof-stalls.csv" 2>&1 ||
    status=1
  python3 - "$OUT/prof-stalls.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"')))
for r in rows[1:] if rows and not rows[0].get("ID", "0").isdigit() else rows:  # skip a units row
    picked = [(k, v) for k, v in r.items() if "issue_stalled" in k and k.endswith("per_issue_active.ratio")]
    def num(v):
        try: return float(v.replace(",", ""))
        except ValueError: return 0.0
    for k, v in sorted(picked, key=lambda kv: -num(kv[1]))[:12]:
        print(f"  {num(v):8.2f}  {k}")
    for k in ("smsp__inst_executed.sum", "sm__cycles_elapsed.avg", "gpu__time_duration.sum"):
        if k in r: print(f"  {k} = {r[k]}")
PY
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
  mb="${LILY_GPU_MAX_BATCH:-32}"  # "default": the server's own default (no --max-batch)
  batch_flags=(); [[ "$mb" != default ]] && batch_flags=(--max-batch "$mb")
  for mode in ${LILY_GPU_STREAM_MODES:-0 1}; do
    for rows in ${LILY_GPU_DECODE_ROWS:-default}; do  # LILY_CUDA_DECODE_ROWS: rows per batched forward
      serve_streams "batched decode $mode, decode rows $rows" $((18090 + mode)) "$OUT/serve-batched-$mode-$rows.log" \
        env LILY_CUDA_BATCHED_DECODE=$mode ${batch_flags:+LILY_CUDA_MAX_BATCH=$mb} \
        $([[ $rows != default ]] && echo "LILY_CUDA_DECODE_ROWS=$rows") "$BUILD/lily" serve --backend cuda \
        --model "$M" --port $((18090 + mode)) --max-seq 4096 "${batch_flags[@]}"
    done
  done
fi
if has ab && [[ -f carry/base.tar ]]; then
  echo "== baseline tree (carry/base.tar)"
  rm -rf /tmp/base-src && mkdir -p /tmp/base-src && tar -xf carry/base.tar -C /tmp/base-src &&
    ln -s "$PWD/models" /tmp/base-src/models && ln -s "$PWD/carry" /tmp/base-src/carry
  (cd /tmp/base-src && cmake -S . -B /tmp/lily-base -G Ninja -DCMAKE_BUILD_TYPE=Release -DLILY_CUDA=ON \
      -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 >/dev/null &&
    cmake --build /tmp/lily-base -j16 --target lily $([[ "${LILY_GPU_AB_THROUGHPUT:-0}" == 1 ]] && echo test_cuda_e2e) \
      >/tmp/base-build.log 2>&1) ||
    { echo "baseline build FAILED"; grep -E "error" /tmp/base-build.log | head; status=1; }
  [[ -f "$M/config.json" ]] ||
    timeout 300 "$BUILD/lily" synth --preset 35b-a3b --seed 1 --out "$M" --tokenizer models/demo/tokenizer.json | tail -1
  for round in $(seq 1 "${LILY_GPU_AB_ROUNDS:-1}"); do  # new, base, new, base, …: drift hits both
    for tree in new base; do
      bin="$BUILD/lily"; [[ $tree == base ]] && bin=/tmp/lily-base/lily
      [[ -x "$bin" ]] || continue
      for n in ${LILY_GPU_CONTEXTS:-256 2048}; do
        echo "== $tree (round $round): lily bench --prompt-len $n"
        timeout 120 "$bin" bench --backend cuda --model "$M" --prompt-len "$n" --decode-steps 64 --rounds 3 2>&1 | tail -1
      done
      if [[ "${LILY_GPU_AB_THROUGHPUT:-0}" == 1 ]]; then  # the batched throughput printout of each tree
        e2e="$(dirname "$bin")/tests/test_cuda_e2e"
        echo "== $tree (round $round): batched decode throughput, 35b-a3b"
        LILY_GPU_BIG_MODEL="$M" timeout 300 "$e2e" --gtest_filter='CudaE2e.PrintsBatchedDecodeThroughput' 2>&1 |
          grep -E "timing\]|FAILED" | grep -v realdims | tee "$OUT/ab-throughput-$tree-$round.log"
      fi
      [[ "${LILY_GPU_AB_SERVE:-1}" == 1 ]] || continue  # 0: lily bench only
      ab_batch="${LILY_GPU_AB_MAX_BATCH:-32}"
      serve_streams "$tree, --max-batch $ab_batch" 18099 "$OUT/serve-ab-$tree.log" \
        env LILY_CUDA_MAX_BATCH=$ab_batch "$bin" serve --backend cuda --model "$M" --port 18099 --max-seq 4096 \
        --max-batch "$ab_batch"
    done
  done
fi
echo "== gpu-batched-decode done, status $status"
exit $status
