"""OpenAI tool calling for `/v1/chat/completions`: `tools`, `tool_choice`, `parallel_tool_calls`, tool messages.

Layout, in the order a request meets them:
- `schema.py`: the request/response models (tool definitions, choices, calls, stream deltas);
- `plan.py`: checks (a 400 naming the field), the mode (`none` / `auto` / `required` / named), and
  `tool_structured_outputs`, the grammar that enforces `required` and named choices;
- `render.py`: messages and tools -> chat-template input, with the default rendering for templates
  that have no tools section;
- `parsers.py` (registry, interface, `extract`) and `hermes.py` (`--tool-call-parser hermes`):
  output text -> content and calls, whole or streamed;
- `replies.py`: the non-streamed message and the stream's chunks in OpenAI's shape.

The public names below are importable from the package (`from .tools import check_tools`), but
lazily (PEP 562): protocol.py imports `schema.py`, which runs this file first, and the other
modules import protocol.py, so importing them here eagerly would make an import cycle.

Invariant: a streamed response reassembles to the non-streamed one (same parser deltas), and a
request without tools is answered exactly as before tool calling existed.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "NO_TOOLS": "plan",
    "ToolPlan": "plan",
    "ToolSettings": "plan",
    "check_tools": "plan",
    "tool_structured_outputs": "plan",
    "chat_inputs": "render",
    "ToolStream": "replies",
    "tool_message": "replies",
    "check_tool_flags": "parsers",
    "get_parser": "parsers",
    "parser_names": "parsers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
