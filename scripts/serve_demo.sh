#!/usr/bin/env bash
# The server demo: set up the environment, start `tidepool serve` on the demo model (a folder holding one .gguf
# resolves to that file; catalogue names are pulled first), stream a chat completion to the terminal with the official openai client, ask for
# a pydantic model (structured outputs) and for a tool call, print a few vLLM metrics, stop the server with SIGTERM (it drains, then exits 0). TIDEPOOL_DEMO_MODEL picks the model.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$TIDEPOOL_ROOT"
model="${TIDEPOOL_DEMO_MODEL:-smollm2-135m-instruct}"
if [[ ! -e "$model" ]]; then  # a catalogue name: serve the cache folder that holds its one .gguf
  model="$(dirname "$(cd /tmp && tidepool --log-level WARNING pull "$model")")"
fi
port="${TIDEPOOL_DEMO_PORT:-8765}"
log="$(mktemp -t tidepool-serve.XXXXXX.log)"
# Run from outside the clone: a clone root on sys.path would let operator/ shadow the stdlib module.
(cd /tmp && exec tidepool serve --model "$model" --served-model-name smollm2 --max-model-len 2048 \
  --host 127.0.0.1 --port "$port") >"$log" 2>&1 &
server_pid=$!
trap 'kill -9 "$server_pid" 2>/dev/null || true' EXIT

echo "== starting tidepool serve --model $model on 127.0.0.1:$port (log: $log)"
for _ in $(seq 1 1200); do  # up to 10 minutes: a busy machine loads slowly
  if curl -sf "http://127.0.0.1:$port/ready" >/dev/null; then break; fi
  if ! kill -0 "$server_pid" 2>/dev/null; then cat "$log"; echo "server exited" >&2; exit 1; fi
  sleep 0.5
done
curl -sf "http://127.0.0.1:$port/ready" >/dev/null || { cat "$log"; echo "server not ready" >&2; exit 1; }

echo "== streaming a chat completion (the openai client, stream=True)"
"$PY" - "$port" <<'PY'
import sys

import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
question = "Explain in two sentences what Kubernetes is."
print(f">>> {question}")
stream = client.chat.completions.create(
    model="smollm2",
    messages=[{"role": "user", "content": question}],
    max_tokens=96,
    temperature=0.7,
    seed=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")

# Structured outputs: the SDK sends the pydantic model's JSON schema; the grammar makes the reply parse.
import pydantic


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    landmarks: list[str] = pydantic.Field(max_length=3)


question = "Describe Paris as JSON: its name, country and up to three landmarks."
print(f"\n>>> {question}  (response_format=City)")
parsed = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": question}],
                                       response_format=City, temperature=0, max_tokens=120)
print(repr(parsed.choices[0].message.parsed))

# Tool calling: tool_choice "required" is enforced by the same grammar machinery.
weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
question = "What is the weather like in Lisbon?"
print(f"\n>>> {question}  (tools=[get_weather], tool_choice=required)")
reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                       tools=[weather], tool_choice="required", temperature=0, max_tokens=80)
for call in reply.choices[0].message.tool_calls or []:
    print(f"tool call: {call.function.name}({call.function.arguments})  finish_reason={reply.choices[0].finish_reason}")
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
if [[ -n "${TIDEPOOL_DEMO_START:-}" ]]; then
  echo "(demo finished in $(($(date +%s) - TIDEPOOL_DEMO_START)) s)"
fi
