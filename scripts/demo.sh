#!/usr/bin/env bash
# The README's first command (after scripts/setup.sh): builds lily, serves the committed demo
# model (models/demo) on loopback, asks it one question through the OpenAI chat-completions API
# with curl, prints the answer and stops the server.
#   LILY_BUILD_DIR  build directory (default: build)
#   LILY_DEMO_QUESTION  the question (default: "What does add_executable do?")
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${LILY_BUILD_DIR:-build}
QUESTION=${LILY_DEMO_QUESTION:-"What does add_executable do?"}

echo "demo: building lily (Release) in $BUILD_DIR"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target lily

LOG=$(mktemp)
"$BUILD_DIR/lily" serve --model models/demo --bind 127.0.0.1:0 --backend auto 2>"$LOG" &
SERVER_PID=$!
cleanup() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" || true
  fi
  rm -f "$LOG"
}
trap cleanup EXIT

# The startup line carries the URL (port 0 = any free port).
URL=""
for _ in $(seq 1 600); do
  URL=$(sed -n 's/.*serving .* on \(http:\/\/[^ ]*\).*/\1/p' "$LOG" | head -n 1)
  [ -n "$URL" ] && break
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then cat "$LOG" >&2; echo "demo: lily serve failed" >&2; exit 1; fi
  sleep 0.1
done
if [ -z "$URL" ]; then cat "$LOG" >&2; echo "demo: lily serve did not start" >&2; exit 1; fi
until curl -fsS "$URL/health" >/dev/null 2>&1; do sleep 0.1; done
echo "demo: $(grep -m 1 'serving ' "$LOG" | sed 's/^lily: info: //')"

MODEL=$(curl -fsS "$URL/v1/models" | sed 's/.*"id":"\([^"]*\)".*/\1/')
# The question as the inside of a JSON string: \ " and tabs escaped, lines joined with \n.
json_escape() {
  printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/\t/\\t/g' -e 's/\r/\\r/g' |
    awk 'BEGIN { ORS = "" } NR > 1 { print "\\n" } { print }'
}
BODY=$(printf '{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":64}' "$MODEL" "$(json_escape "$QUESTION")")
echo "demo: POST $URL/v1/chat/completions  (user: $QUESTION)"
# --fail-with-body: a refused request prints the server's error, not just "error: 400".
if ! RESPONSE=$(curl -sS --fail-with-body "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d "$BODY"); then
  echo "demo: the server refused the request: $RESPONSE" >&2
  exit 1
fi
echo "demo: answer:"
if ! command -v node >/dev/null; then echo "$RESPONSE"; exit 0; fi
node -e 'const r = JSON.parse(process.argv[1]); console.log(r.choices[0].message.content);
         console.error(`demo: finish_reason=${r.choices[0].finish_reason} prompt_tokens=${r.usage.prompt_tokens} completion_tokens=${r.usage.completion_tokens}`);' "$RESPONSE"
