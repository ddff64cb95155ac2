"""A chat request's tool fields: checked, then turned into a plan (what to render, how to parse, what to enforce).

Role: `check_tools(req, settings)` runs before anything is queued and raises `APIError` naming the
field; its `ToolPlan` tells serving.py which tools the template sees and which parser (if any)
reads the output. `tool_structured_outputs(req)` is the constraint the engine applies for
`tool_choice: "required"` or a named function (checks.sampling_params sets it on the request's
`SamplingParams.structured_outputs`).

Modes, as vLLM's (and OpenAI's) semantics:
- no `tools`, or `tool_choice: "none"`: the tools are rendered (vLLM does) but the output is
  plain content, never parsed;
- `"auto"` (the default when `tools` is given): the server's `--tool-call-parser` reads the output;
  refused with a 400 unless the server runs with `--enable-auto-tool-choice`;
- `"required"` / `{"type": "function", "function": {"name": N}}`: enforced by constrained decoding.
  The output is one or more (with `parallel_tool_calls: false`, exactly one) Hermes blocks,
  `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, separated by "\\n", whose
  arguments match the tool's `parameters` schema (OpenAI's strict mode when the function sets
  `strict`); the `hermes` parser reads them whatever the server's flags, since the format is ours.
  vLLM's named choice makes the model write the arguments alone; ours keeps the block, so one
  parser (and one streaming path) serves every mode, and the model sees the format its prompt
  describes.

Invariant: a plan exists only for a request whose tool fields are consistent; everything the
constraint needs (names unique, parameters object schemas) was checked here first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...structured_outputs.params import JSON_STYLE, StructuredOutputsParams
from ...structured_outputs.schemas import strict_schema
from ..protocol import APIError, ChatCompletionRequest, ChatMessage
from .deltas import ParserFactory, ToolParser
from .parsers import get_parser
from .schema import NamedToolChoice, ToolDefinition


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's tool flags (`--enable-auto-tool-choice`, `--tool-call-parser`), checked at start-up."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # OpenAI tool dicts for the template (None: the request has none)
    parser: ParserFactory | None  # None: the output is content, never parsed
    parallel_tool_calls: bool = True

    def new_parser(self) -> ToolParser:
        """A parser for one choice's output (at most one call unless parallel calls are allowed)."""
        assert self.parser is not None
        return self.parser(None if self.parallel_tool_calls else 1)


NO_TOOLS = ToolPlan(None, None)


def tool_choice_of(req: ChatCompletionRequest) -> str | NamedToolChoice:
    """The effective choice: as sent, else "auto" with tools and "none" without (OpenAI's defaults)."""
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def check_messages(messages: list[ChatMessage]) -> None:
    """Tool fields of the conversation: a tool result names its call; only assistant messages carry calls."""
    for i, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            raise APIError(f"messages[{i}]: a message with role 'tool' needs the tool_call_id of the call it answers",
                           param=f"messages[{i}].tool_call_id")  # fmt: skip
        if message.tool_calls and message.role != "assistant":
            raise APIError(f"messages[{i}]: only assistant messages carry tool_calls (role is {message.role!r})",
                           param=f"messages[{i}].tool_calls")  # fmt: skip


def check_tool_definitions(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """A request's `tools` as OpenAI dicts (None when it has none); 400 for duplicates or non-object schemas."""
    if not tools:
        return None
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.function
        if function.name in seen:
            raise APIError(f"tools[{i}].function.name: {function.name!r} is defined twice; tool names must be unique",
                           param=f"tools[{i}].function.name")  # fmt: skip
        seen.add(function.name)
        schema = function.parameters
        if schema is not None and schema.get("type", "object") != "object":
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema of an object "
                           f'({{"type": "object", "properties": ...}}); got type {json.dumps(schema.get("type"))}',
                           param=f"tools[{i}].function.parameters")  # fmt: skip
    return [tool.as_dict() for tool in tools]


def check_tools(req: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
    """400 for inconsistent tool fields; else what to render and how to read the output."""
    check_messages(req.messages)
    tools = check_tool_definitions(req.tools)
    choice = tool_choice_of(req)
    if choice != "none" and tools is None:
        raise APIError("tool_choice needs tools: give the functions the model may call in `tools`, or leave "
                       "tool_choice out", param="tool_choice")  # fmt: skip
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t["function"]["name"] for t in tools or []}:
        raise APIError(f"tool_choice.function.name {choice.function.name!r} is not one of the functions in tools",
                       param="tool_choice.function.name")  # fmt: skip
    if choice == "none":
        return ToolPlan(tools, None, req.parallel_tool_calls)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise APIError('tool_choice "auto" (the default when tools are given) needs the server to run with '
                           "--enable-auto-tool-choice and --tool-call-parser NAME; send tool_choice \"required\", a "
                           'named function or "none" instead', param="tool_choice")  # fmt: skip
        return ToolPlan(tools, get_parser(settings.tool_call_parser), req.parallel_tool_calls)
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(f"response_format {req.response_format.type!r} cannot be combined with a tool_choice that "
                       "forces a call (the output is the call); leave one of them out",
                       param="response_format")  # fmt: skip
    return ToolPlan(tools, get_parser("hermes"), req.parallel_tool_calls)


def tool_structured_outputs(req: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The constraint that enforces `tool_choice` "required" or a named function (None for other choices).

    Call only for a request `check_tools` accepted. A Lark grammar in llguidance's dialect: each call
    is `"<tool_call>\\n" %json{...} "\\n</tool_call>"`, the JSON schema an `anyOf` over the allowed
    tools of `{"name": const NAME, "arguments": PARAMETERS}` (property order kept: the name first,
    so a stream can announce the call before its arguments).
    """
    choice = tool_choice_of(req)
    if choice in ("none", "auto") or not req.tools:
        return None
    allowed = [t.function for t in req.tools]
    if isinstance(choice, NamedToolChoice):
        allowed = [f for f in allowed if f.name == choice.function.name]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": _arguments_schema(f.parameters, bool(f.strict))},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in allowed
    ]
    schema = {"anyOf": options, "x-guidance": JSON_STYLE}  # written as the JSON constraints are
    call = '"<tool_call>\\n" %json' + json.dumps(schema, ensure_ascii=False) + ' "\\n</tool_call>"'
    start = 'call ("\\n" call)*' if req.parallel_tool_calls and not isinstance(choice, NamedToolChoice) else "call"
    return StructuredOutputsParams(grammar=f"start: {start}\ncall: {call}\n")


def _arguments_schema(parameters: dict[str, Any] | None, strict: bool) -> dict[str, Any]:
    if parameters is None:  # a function without parameters takes the empty object
        return {"type": "object", "properties": {}, "additionalProperties": False}
    schema = dict(parameters)
    schema.setdefault("type", "object")
    if strict:
        schema = strict_schema(schema)
    return schema
