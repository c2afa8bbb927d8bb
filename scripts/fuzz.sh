#!/usr/bin/env bash
# Fuzzing (docs/robustness.md): builds the libFuzzer targets of tests/fuzz with clang
# (ASan + UBSan + libFuzzer coverage, build dir build-fuzz, CPU only) and runs each for a bounded
# time, starting from the committed seeds (tests/fuzz/corpus/<target>) and replaying every past
# crash (tests/fuzz/regressions/<target>). Fails on any crash, sanitizer report, leak, time-out
# (> 10 s for one input) or out-of-memory. New corpus entries stay in build-fuzz/ (not in git).
#
#   FUZZ_SECONDS   seconds per target (default 60)
#   FUZZ_TARGETS   space-separated subset (default: all six)
#   FUZZ_BUILD     build directory (default build-fuzz)
#   FUZZ_RUNS      if set: run exactly this many inputs per target from seed FUZZ_SEED (default 1)
#                  instead of a time budget, so the run is reproducible (scripts/test.sh, CI)
# A crash leaves its input at build-fuzz/fuzz-out/<target>/crash-*; reproduce with
#   build-fuzz/tests/fuzz/<target> <that file>
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${FUZZ_SECONDS:-60}
TARGETS=${FUZZ_TARGETS:-"fuzz_safetensors fuzz_config fuzz_tokenizer fuzz_chat_template fuzz_request fuzz_jinja"}
BUILD=${FUZZ_BUILD:-build-fuzz}
if [ -n "${FUZZ_RUNS:-}" ]; then
  BUDGET=(-runs="$FUZZ_RUNS" -seed="${FUZZ_SEED:-1}")
  BUDGET_TEXT="$FUZZ_RUNS runs, seed ${FUZZ_SEED:-1}"
else
  BUDGET=(-max_total_time="$SECONDS_PER_TARGET")
  BUDGET_TEXT="${SECONDS_PER_TARGET}s"
fi

for tool in clang clang++; do
  command -v "$tool" >/dev/null || { echo "fuzz: $tool not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }
done

# -O2 as RelWithDebInfo, but line tables only (-g1): crash stack traces keep function, file and
# line, and the build takes less time than with full debug info.
CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DLILY_FUZZ=ON -DLILY_CUDA=OFF -DBUILD_TESTING=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" >/dev/null
TIMEFORMAT="fuzz: build: %R s wall, %U s user, %S s sys"
# shellcheck disable=SC2086
time cmake --build "$BUILD" -j "$(nproc)" --target $TARGETS

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=()
TIMEFORMAT="fuzz: runs: %R s wall, %U s user, %S s sys"
time for target in $TARGETS; do
  out="$BUILD/fuzz-out/$target"
  mkdir -p "$out/corpus"
  rm -f "$out"/crash-* "$out"/leak-* "$out"/timeout-* "$out"/oom-* "$out"/slow-unit-*
  # A fixed run count starts from the committed seeds only, as on a fresh clone: same verdict here and in CI.
  [ -n "${FUZZ_RUNS:-}" ] && rm -rf "$out/corpus" && mkdir -p "$out/corpus"
  seeds=(tests/fuzz/corpus/"$target")
  [ -d tests/fuzz/regressions/"$target" ] && seeds+=(tests/fuzz/regressions/"$target")
  # The template targets run the Jinja engine on every input (about 10x slower per input): a
  # quarter of the fixed run count keeps the test command's time in bounds.
  if [ -n "${FUZZ_RUNS:-}" ]; then
    case "$target" in
      fuzz_chat_template|fuzz_jinja) BUDGET=(-runs="$((FUZZ_RUNS / 4))" -seed="${FUZZ_SEED:-1}") ;;
      *) BUDGET=(-runs="$FUZZ_RUNS" -seed="${FUZZ_SEED:-1}") ;;
    esac
    BUDGET_TEXT="${BUDGET[0]#-runs=} runs, seed ${FUZZ_SEED:-1}"
  fi
  echo "fuzz: $target for $BUDGET_TEXT"
  # The first corpus directory receives new inputs; the committed ones are only read.
  if "$BUILD/tests/fuzz/$target" "${BUDGET[@]}" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$out/" \
      "$out/corpus" "${seeds[@]}" >"$out/log.txt" 2>&1; then
    { grep -E '^#[0-9]+[[:space:]]+DONE' "$out/log.txt" || true; } | tail -1 | sed "s/^/fuzz: $target: /"
  else
    echo "fuzz: $target FAILED; log $out/log.txt, inputs: $(ls "$out"/{crash,leak,timeout,oom}-* 2>/dev/null | tr '\n' ' ')" >&2
    grep -E 'ERROR|runtime error|INVARIANT|SUMMARY|Test unit written' "$out/log.txt" | head -20 >&2 || true
    failed+=("$target")
  fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: all targets clean"
