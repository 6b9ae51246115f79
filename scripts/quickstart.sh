#!/usr/bin/env bash
# Zero-setup demo: SQLite + embedded broker under .batchinfer/, the built-in SmolLM2 model.
# Starts `batchinfer serve`, submits the 164-line HumanEval job through the HTTP API, waits,
# writes the output file, prints a summary and stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate

export BATCHINFER_DATA_DIR=${BATCHINFER_DATA_DIR:-.batchinfer}
PORT=${BATCHINFER_API_PORT:-8000}
BASE_URL="http://127.0.0.1:$PORT"
mkdir -p "$BATCHINFER_DATA_DIR"
OUTPUT="$BATCHINFER_DATA_DIR/humaneval_output.jsonl"
LOG="$BATCHINFER_DATA_DIR/serve.log"

echo "quickstart: preparing the model (converted once, then cached)"
batchinfer model prepare

echo "quickstart: starting batchinfer serve on $BASE_URL (log: $LOG)"
batchinfer serve --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
SERVER_PID=$!
stop_server() {
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "quickstart: stopping the server"
        kill -TERM "$SERVER_PID"
        wait "$SERVER_PID" || true
    fi
}
trap stop_server EXIT

python - "$BASE_URL" "$SERVER_PID" <<'PY'
import os, sys, time
import httpx
base_url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 180
while time.monotonic() < deadline:
    try:
        if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("quickstart: the server exited; see the log")
    time.sleep(1)
sys.exit("quickstart: the API did not come up within 180 s; see the log")
PY

START=$(date +%s)
batchinfer submit examples/humaneval.jsonl --endpoint /v1/completions --base-url "$BASE_URL" \
    --output "$OUTPUT" --poll-interval 2 --metadata example=humaneval >"$BATCHINFER_DATA_DIR/humaneval_batch.json"
END=$(date +%s)

python - "$OUTPUT" "$BATCHINFER_DATA_DIR/humaneval_batch.json" "$((END - START))" <<'PY'
import collections, json, sys
output, batch_path, wall_s = sys.argv[1], sys.argv[2], int(sys.argv[3])
batch = json.load(open(batch_path))
lines = [json.loads(line) for line in open(output)]
finish = collections.Counter(l["response"]["body"]["choices"][0]["finish_reason"] for l in lines)
completion_tokens = sum(l["response"]["body"]["usage"]["completion_tokens"] for l in lines)
first = min(lines, key=lambda l: int(l["custom_id"].split("/")[1]))
print()
print(f"batch {batch['id']}: {batch['status']}, request_counts {batch['request_counts']}")
print(f"usage: {batch.get('usage')}")
print(f"finish reasons: {dict(finish)}; {completion_tokens} completion tokens in {wall_s} s "
      f"({completion_tokens / max(wall_s, 1):.1f} tok/s end to end)")
print(f"{first['custom_id']} completion:\n{first['response']['body']['choices'][0]['text']}")
PY
echo
echo "quickstart: output file written to $OUTPUT"
