"""Tidepool's OpenAI-compatible HTTP server: FastAPI + uvicorn around one `LLMEngine`.

Layout: `protocol.py` (request/response models, OpenAI shapes and errors), `async_engine.py`
(the engine loop in its own thread, backpressure, aborts, drain), `serving.py` (requests ->
engine -> responses and SSE streams), `tools/` (tool calling: checks, rendering, parsers, tool-call
replies), `tokenization.py` (vLLM's `/tokenize` and `/detokenize`),
`metrics.py` (vLLM's metrics), `app.py` (routes), `cli.py` (`tidepool serve`). The engine core
never imports this package.
"""
