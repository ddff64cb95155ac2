"""Structured outputs at the API edge: OpenAI's `response_format`, vLLM's `structured_outputs`, compiled off the engine.

Role: `structured_spec(req)` reads what a request asks its output to match into one
`StructuredOutputsParams` (or None): `response_format` `{"type": "json_object"}` /
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (OpenAI's shape; the openai
SDK's `chat.completions.parse` sends it), or vLLM's extension `structured_outputs` with exactly
one of `json`, `regex`, `choice`, `grammar`, `json_object` (and `disable_additional_properties`,
vLLM's spelling of strict); a chat's `tool_choice` of `required` or a named function adds its
own constraint (tools/plan.py). `attach_grammar(engine, children)` compiles it in the grammar compiler's
threads, at most its time limit, and hands the compiled grammar to every engine request.

Invariants: two sources of constraint in one request, an unknown `structured_outputs` key, a
malformed schema (including `$ref` cycles and patterns that do not compile), a regex or grammar
that does not compile, and a compile over the time limit are each a 400 naming the field, raised
before anything is queued; the engine thread only ever receives compiled grammars.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ..structured_outputs import GrammarError, StructuredOutputsParams
from .async_engine import AsyncEngine
from .commands import Child
from .protocol import APIError, SamplingRequest

# vLLM's `structured_outputs` keys this server honours; anything else is refused, never ignored.
_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_additional_properties")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def structured_spec(req: SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field it came from (for error messages), or None for free text."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        spec = _from_response_format(fmt.type, fmt.json_schema)
        found.append((spec, "response_format.json_schema.schema" if spec.kind == "json" else "response_format"))
    extension = getattr(req, "structured_outputs", None)
    if extension is not None:
        spec = _from_extension(extension)
        found.append((spec, f"structured_outputs.{spec.kind}"))
    tool_spec = _tool_spec(req)
    if tool_spec is not None:
        found.append((tool_spec, "tool_choice"))
    if len(found) > 1:
        names = " and ".join(param.split(".")[0] for _, param in found)
        raise APIError(f"{names} both constrain the output; send only one of them", param=found[1][1])
    return found[0] if found else None


def _from_response_format(kind: str, json_schema: dict[str, Any] | None) -> StructuredOutputsParams:
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    param = "response_format.json_schema"
    if not isinstance(json_schema, dict):
        raise APIError('response_format of type "json_schema" needs a json_schema object: '
                       '{"name": ..., "schema": {...}, "strict": true}', param=param)  # fmt: skip
    name = json_schema.get("name")
    if not isinstance(name, str) or _SCHEMA_NAME.fullmatch(name) is None:
        raise APIError("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
                       param=f"{param}.name")  # fmt: skip
    strict = json_schema.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError("response_format.json_schema.strict must be a boolean", param=f"{param}.strict")
    schema = json_schema.get("schema", {})  # OpenAI: an absent schema means any JSON value of an object
    try:
        return StructuredOutputsParams(json=schema, strict=bool(strict))
    except ValueError as err:
        raise APIError(str(err).replace("structured_outputs.json", f"{param}.schema"),
                       param=f"{param}.schema") from None  # fmt: skip


def _from_extension(extension: Any) -> StructuredOutputsParams:
    if not isinstance(extension, dict):
        raise APIError("structured_outputs must be an object with one of: json, regex, choice, grammar, json_object",
                       param="structured_outputs")  # fmt: skip
    unknown = sorted(set(extension) - set(_KEYS))
    if unknown:
        raise APIError(f"structured_outputs.{unknown[0]} is not supported; this server takes "
                       f"{', '.join(_KEYS)}", param=f"structured_outputs.{unknown[0]}")  # fmt: skip
    values = {k: v for k, v in extension.items() if v is not None and k != "disable_additional_properties"}
    if values.get("json_object") is False:
        values.pop("json_object")
    strict = extension.get("disable_additional_properties") or False
    if not isinstance(strict, bool):
        raise APIError("structured_outputs.disable_additional_properties must be a boolean",
                       param="structured_outputs.disable_additional_properties")  # fmt: skip
    try:
        return StructuredOutputsParams(**values, strict=strict)
    except (TypeError, ValueError) as err:
        message = str(err)
        named = re.search(r"structured_outputs\.(\w+)", message)
        raise APIError(
            message, param=f"structured_outputs.{named.group(1)}" if named else "structured_outputs"
        ) from None


def _tool_spec(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The constraint a chat's `tool_choice` (required or a named function) imposes (tools/plan.py)."""
    if getattr(req, "tools", None) is None:
        return None
    from .tools.plan import tool_structured_outputs

    return tool_structured_outputs(req)


async def constrain(engine: AsyncEngine, children: list[Child], req: SamplingRequest) -> None:
    """Read the request's constraint, compile it (once: every engine request of an HTTP request asks for the
    same) and give each engine request the constraint and its grammar. Nothing is queued yet."""
    found = structured_spec(req)
    if found is None:
        return
    spec, param = found
    for child in children:
        child.params = replace(child.params, structured_outputs=spec)
    try:
        grammar = await engine.grammars.compile_async(spec)
    except GrammarError as err:
        what = {"json": "JSON schema", "json_object": "JSON object", "choice": "choice"}.get(spec.kind, spec.kind)
        raise APIError(f"invalid {what} constraint: {err}", param=param) from None
    for child in children:
        child.grammar = grammar
