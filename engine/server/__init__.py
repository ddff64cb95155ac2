"""Tidepool's OpenAI-compatible HTTP server: FastAPI + uvicorn around one `LLMEngine`.

Layout: `protocol.py` (request/response models, OpenAI shapes and errors), `async_engine.py`
(the engine loop in its own thread, backpressure, aborts, drain) and `commands.py` (the typed
commands it takes: add, abort, stop, register/unregister an adapter), `serving.py` (requests ->
engine -> responses and SSE streams), `tools/` (tool calling: checks, rendering, parsers, tool-call replies),
`tokenization.py` (vLLM's `/tokenize` and `/detokenize`), `metrics.py` (vLLM's metrics),
LoRA adapters (`lora_modules.py`: --lora-modules and adapter names; `lora_admin.py`: vLLM's load and
unload endpoints, `/v1/models` cards, start-up modules; `lora_fetch.py`: hf:// adapter paths;
`lora_metrics.py`: the gateway protocol's `vllm:lora_requests_info` and per-adapter counters),
`state.py` (`ServerConfig`, `ServerState`), `gate.py` (the API's door: bodies, readiness,
in-flight counts), `app.py` (routes, load and drain), `cli.py` (`tidepool serve`). Imports run one
way (app -> gate -> state -> serving -> async_engine -> commands); the engine core never imports
this package.
"""
