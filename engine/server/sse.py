"""Server-sent events of a streamed completion, built from pre-serialized parts.

Role: one `StreamChunks` per streamed response renders each `data:` line as the text pydantic's
`model_dump_json()` of the same `CompletionResponse` / `ChatCompletionChunk` would give, without
building and validating three nested models per token: the fields that never change within the
response (id, object, created, model) are serialized once, and a token's chunk is a few string
joins around `json.dumps` of its text. Logprobs (rare, and nested) go through their pydantic
models.

Invariant: byte-for-byte the same events as the pydantic models give (field order, nulls,
`DeltaMessage` leaving out its null fields, non-ASCII text unescaped, control characters escaped
as JSON requires); tests/server/test_sse.py checks that against pydantic on generated text.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from .protocol import Usage

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def _value(value: str | int | None) -> str:
    return "null" if value is None else _dumps(value)


def _model(model: BaseModel | None) -> str:
    return "null" if model is None else model.model_dump_json()


class StreamChunks:
    """The `data:` lines of one streamed completions (`chat=False`) or chat completions response."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool) -> None:
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{_dumps(response_id)},"object":"{kind}","created":{created},'
                      f'"model":{_dumps(model)},"choices":[')  # fmt: skip
        # CompletionResponse carries the P/D hand-off field; ChatCompletionChunk has none.
        self._tail = "}\n\n" if chat else ',"kv_transfer_params":null}\n\n'

    def completion_choice(
        self,
        index: int,
        text: str,
        logprobs: BaseModel | None = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> str:
        """One `CompletionChoice`, as JSON."""
        return (f'{{"index":{index},"text":{_dumps(text)},"logprobs":{_model(logprobs)},'
                f'"finish_reason":{_value(finish_reason)},"stop_reason":{_value(stop_reason)}}}')  # fmt: skip

    def chat_choice(
        self,
        index: int,
        content: str | None,
        role: str | None = None,
        logprobs: BaseModel | None = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> str:
        """One `ChatChunkChoice`, as JSON; its delta leaves out a null role or content, as `DeltaMessage` does."""
        delta = ",".join(
            f'"{name}":{_dumps(value)}' for name, value in (("role", role), ("content", content)) if value is not None
        )
        return self._chat_choice(index, delta, logprobs, finish_reason, stop_reason)

    def tool_call_choice(
        self,
        index: int,
        call: dict[str, object],
        logprobs: BaseModel | None = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> str:
        """One `ChatChunkChoice` whose delta holds one `DeltaToolCall` (`call`: its set fields, in wire order)."""
        return self._chat_choice(index, f'"tool_calls":[{_dumps(call)}]', logprobs, finish_reason, stop_reason)

    @staticmethod
    def _chat_choice(
        index: int, delta: str, logprobs: BaseModel | None, finish_reason: str | None, stop_reason: str | int | None
    ) -> str:
        return (f'{{"index":{index},"delta":{{{delta}}},"logprobs":{_model(logprobs)},'
                f'"finish_reason":{_value(finish_reason)},"stop_reason":{_value(stop_reason)}}}')  # fmt: skip

    def event(self, choices: list[str], usage: Usage | None = None) -> str:
        """The `data:` line (with its blank line) of one chunk holding `choices` (JSON) and `usage`."""
        return f'{self._head}{",".join(choices)}],"usage":{_model(usage)}{self._tail}'
