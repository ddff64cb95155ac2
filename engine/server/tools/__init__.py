"""OpenAI tool calling for `/v1/chat/completions`: `tools`, `tool_choice`, `parallel_tool_calls`, tool messages.

Layout, in the order a request meets them:
- `schema.py`: the request/response models (tool definitions, choices, calls, stream deltas);
- `plan.py`: checks (a 400 naming the field), the mode (`none` / `auto` / `required` / named), and
  `tool_structured_outputs`, the grammar that enforces `required` and named choices;
- `render.py`: messages and tools -> chat-template input, with the default rendering for templates
  that have no tools section;
- `deltas.py` (the parser interface, `extract`), `hermes.py` (`--tool-call-parser hermes`) and
  `parsers.py` (the parsers by name): output text -> content and calls, whole or streamed;
- `replies.py`: the non-streamed message and the stream's chunks in OpenAI's shape.

Callers import the modules themselves (`from .tools.plan import check_tools`); this file exports
nothing, so importing `schema.py` (as protocol.py does) never pulls in the modules that import
protocol.py.

Invariant: a streamed response reassembles to the non-streamed one (same parser deltas), and a
request without tools is answered exactly as before tool calling existed.
"""
