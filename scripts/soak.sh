#!/usr/bin/env bash
# Soak test (docs/robustness.md): builds `lily` and runs tests/soak/soak.mjs against it — 32
# concurrent loopback clients for SOAK_SECONDS (default 180) mixing valid, streaming, invalid,
# oversized, slow and stalled requests and mid-stream disconnects. Stops by itself; exits 1 if
# the server crashed, answered wrongly, hung, or leaked memory or file descriptors.
#
#   SOAK_SECONDS  load duration (default 180)       SOAK_CLIENTS  concurrent clients (default 32)
#   SOAK_BUILD    build directory (default build)    SOAK_REPORT   write the JSON figures there
#   LILY_BIN      test this executable instead of building one
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${LILY_BIN:-}" ]; then
  BUILD=${SOAK_BUILD:-build}
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$BUILD" -j "$(nproc)" --target lily
  LILY_BIN="$PWD/$BUILD/lily"
fi
LILY_BIN="$LILY_BIN" LILY_SOURCE_DIR="$PWD" node tests/soak/soak.mjs
