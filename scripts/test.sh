#!/usr/bin/env bash
# The test command: builds lily (and its CUDA code when nvcc is present), runs every CPU test
# (GoogleTest units and goldens, Node black-box tests), then repeats the C++ tests and the
# server's Node tests under AddressSanitizer + UndefinedBehaviorSanitizer. GPU tests (label
# `gpu`) run on an H200 via scripts/gpu-check.sh, not here.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc)
# Each phase reports its wall time and the CPU time (user + sys, children included) it took.
phase() { local TIMEFORMAT="test.sh: $1: %R s wall, %U s user, %S s sys"; shift; time "$@"; }

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
phase "release build" cmake --build build -j "$JOBS"
phase "release ctest" ctest --test-dir build -LE gpu --output-on-failure -j "$JOBS" --timeout 900

# The sanitizer build: -O1 with line tables only (-g1: stack traces still name function, file and
# line) compiles in about half the CPU time of RelWithDebInfo's -O2 -g; the CPU kernels, where
# these tests spend most of their time, stay at -O2 (LILY_CPU_OPT). Every check is the same.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLILY_SANITIZE=ON -DLILY_CUDA=OFF \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DLILY_CPU_OPT=-O2 >/dev/null
phase "asan build" cmake --build build-asan -j "$JOBS"
# Unit tests, plus the Node tests that start `lily serve` (label `server`: black-box server
# tests and the short soak; node_prefix_cache runs in Release only, tests/CMakeLists.txt says
# why) against this build's lily; a sanitizer report aborts the process (abort_on_error /
# halt_on_error) and the test harness fails on it and on any unclean exit. Tests built with the
# sanitizers run fewer cases of the same checks where one property is repeated over many
# (lily::test::kSanitized: Batching.*, CacheEquivalence.*), and leave out timing printouts.
phase "asan ctest" env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan -L 'unit|server' --output-on-failure -j "$JOBS" --timeout 1800

# Fuzzing: every libFuzzer target of tests/fuzz, built with clang + ASan/UBSan in
# build-fuzz; fails on any crash, leak or time-out. Here a fixed number of inputs from a fixed
# seed, so the test command gives the same verdict on every run; open-ended time-budgeted
# exploration is `scripts/fuzz.sh` alone (FUZZ_SECONDS).
FUZZ_RUNS=${FUZZ_RUNS:-200000} FUZZ_SEED=${FUZZ_SEED:-1} bash scripts/fuzz.sh
