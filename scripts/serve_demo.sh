#!/usr/bin/env bash
# The server demo: set up the environment, make the demo model, start `tidepool serve`, stream a
# completion to the terminal, print a few vLLM metrics, stop the server cleanly (SIGTERM, exit 0).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$TIDEPOOL_ROOT"
model="$(demo_model)"
port="${TIDEPOOL_DEMO_PORT:-8765}"
log="$(mktemp -t tidepool-serve.XXXXXX.log)"
# Run from outside the clone: a clone root on sys.path would let operator/ shadow the stdlib module.
(cd /tmp && exec tidepool serve --model "$model" --served-model-name demo --host 127.0.0.1 --port "$port") >"$log" 2>&1 &
server_pid=$!
trap 'kill -9 "$server_pid" 2>/dev/null || true' EXIT

echo "== starting tidepool serve on 127.0.0.1:$port (log: $log)"
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$port/ready" >/dev/null; then break; fi
  if ! kill -0 "$server_pid" 2>/dev/null; then cat "$log"; echo "server exited" >&2; exit 1; fi
  sleep 0.5
done
curl -sf "http://127.0.0.1:$port/ready" >/dev/null || { cat "$log"; echo "server not ready" >&2; exit 1; }

echo "== streaming a completion (the openai client, stream=True)"
"$PY" - "$port" <<'PY'
import sys

import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
prompt = "import os\nimport sys\n\n\ndef main("
print(prompt, end="", flush=True)
stream = client.completions.create(
    model="demo",
    prompt=prompt,
    max_tokens=64,
    temperature=0.7,
    seed=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].text, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")
PY

echo "== a few metrics from /metrics"
curl -sf "http://127.0.0.1:$port/metrics" | grep -E '^vllm:(prompt_tokens_total|generation_tokens_total|request_success_total|time_to_first_token_seconds_(count|sum)|kv_cache_usage_perc|num_requests_running)' || true

echo "== stopping the server (SIGTERM: drain, then exit)"
kill -TERM "$server_pid"
status=0
wait "$server_pid" || status=$?
trap - EXIT
if [[ "$status" -ne 0 ]]; then
  tail -n 20 "$log"
  echo "server exited with $status" >&2
  exit 1
fi
grep -E "drained|KV blocks free" "$log" || true
echo "server stopped cleanly (exit 0)"
echo "(a 22M-parameter model trained for under an hour on the Python standard library: Python-looking text, not code that runs)"
