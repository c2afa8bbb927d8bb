# Sourced by the scripts that run ON the GPU machine (scripts/gpu-check*.sh): repository root,
# $OUT, the carried headers, the build directory, one configure + build function, and the check
# of a GoogleTest log.
# The GPU machine these scripts were written for: Ubuntu 24.04, nvcc 13.0, CMake, gcc 13; no
# package registry, so the PCRE2/utf8proc/Boost headers come from carry/deps, copied along with
# the working tree (scripts/make-carry.sh packs them). $OUT (default ./gpu-logs) is the folder
# the logs go to.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT"
export PKG_CONFIG_PATH="$PWD/carry/deps/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
BUILD="${LILY_GPU_BUILD:-build-gpu}"

# gpu_build LOG TARGET...: configures $BUILD (Release, CUDA on, sm_90a) and builds the targets
# with -j16 (extra configure flags: LILY_GPU_CMAKE_FLAGS, e.g. -DCMAKE_CUDA_FLAGS=-lineinfo for
# Nsight Compute's source view), output to $OUT/LOG; prints the errors and exits 1 on failure, the time otherwise.
gpu_build() {
  local log="$OUT/$1"; shift
  local t0; t0=$(date +%s)
  rm -f "$BUILD/CMakeCache.txt"  # pick up changed carried .pc files and LILY_COMMIT
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLILY_CUDA=ON \
    -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 \
    ${LILY_GPU_CMAKE_FLAGS:-} >"$log" 2>&1 || { tail -30 "$log"; echo "configure FAILED"; exit 1; }
  echo "== build (-j16): $*"
  cmake --build "$BUILD" -j16 --target "$@" >>"$log" 2>&1 ||
    { grep -E "error|FAILED" "$log" | head -40; echo "build FAILED"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
}

# gtest_passed LOG: whether the GoogleTest output in LOG has its "[  PASSED  ]" summary and no
# "[  FAILED  ]" line (the binary's exit status is lost behind the `| tee` the callers log through).
gtest_passed() {
  grep -q "^\[  PASSED  \]" "$1" && ! grep -q "^\[  FAILED  \]" "$1"
}
