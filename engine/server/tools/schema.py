"""OpenAI's tool-calling shapes: tool definitions, `tool_choice`, tool calls in messages, responses and stream deltas.

Role: the request and response models that `protocol.py` refers to for `tools`, `tool_choice`,
`messages[i].tool_calls`, `message.tool_calls` and `delta.tool_calls`. Kept here (not in
protocol.py) so that tool calling stays one package; this module imports nothing from the rest of
the server, so protocol.py can import it without a cycle.

Invariants: requests are parsed as strictly as protocol.py's (`StrictModel`'s configuration:
no type coercion, unknown fields ignored, no NaN/infinity); a function name is OpenAI's
`^[a-zA-Z0-9_-]{1,64}$`; `parameters`, when given, is a JSON object. What needs more than one
field (duplicate names, a named `tool_choice` that is not in `tools`, an object schema) is
checked in `plan.py`. A response's `tool_calls` holds `arguments` as a JSON string (OpenAI's
shape); a stream delta leaves out the fields OpenAI sends only in a call's first delta.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    field_validator,
    model_serializer,
)

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class _Strict(BaseModel):
    # The same configuration as protocol.StrictModel (not imported: protocol.py imports this module).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: the function takes no arguments
    strict: bool | None = None  # OpenAI's: the arguments admit no keys the schema does not declare

    @field_validator("name")
    @classmethod
    def _openai_name(cls, name: str) -> str:
        if FUNCTION_NAME.fullmatch(name) is None:
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise ValueError(f"a function name must match ^[a-zA-Z0-9_-]{{1,64}}$; got {shown!r}")
        return name


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def as_dict(self) -> dict[str, Any]:
        """The tool as OpenAI writes it (None fields left out): what chat templates and the default rendering see."""
        return self.model_dump(exclude_none=True)


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


def _choice_kind(value: Any) -> str:
    # One member validated, as protocol.Prompt does; the tags are not identifiers, so no error names them.
    return "named-function" if isinstance(value, dict) else "mode-string"


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode-string")]
    | Annotated[NamedToolChoice, Tag("named-function")],
    Discriminator(_choice_kind),
]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A call in a response's `message.tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageFunctionCall(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    """A call in an assistant message of the conversation (a previous response's `tool_calls`, sent back)."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


MessageToolCalls = Annotated[list[MessageToolCall], Field(max_length=1024)]


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(BaseModel):
    """A call's piece in a stream: the first has id, type and name (arguments ""); later ones only arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}
