"""Tidepool's OpenAI-compatible HTTP server: FastAPI + uvicorn around one `LLMEngine`.

Layout: `protocol.py` (request/response models, OpenAI shapes and errors), `async_engine.py`
(the engine loop in its own thread, backpressure, aborts, drain) and `commands.py` (the typed
commands it takes: add, abort, stop), `serving.py` (requests -> engine -> responses and SSE
streams), `tools/` (tool calling: checks, rendering, parsers, tool-call replies),
`tokenization.py` (vLLM's `/tokenize` and `/detokenize`), `metrics.py` (vLLM's metrics),
`state.py` (`ServerConfig`, `ServerState`), `gate.py` (the API's door: bodies, readiness,
in-flight counts), `app.py` (routes, load and drain), `cli.py` (`tidepool serve`). Imports run one
way (app -> gate -> state -> serving -> async_engine -> commands); the engine core never imports
this package.
"""
