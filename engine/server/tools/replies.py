"""A chat choice's output text -> OpenAI's answer with tool calls: the whole message, or a stream's chunks.

Role: serving.py hands each choice's text here. `tool_message` builds the non-streamed
`message` (`content`, `tool_calls`) and finish reason; `ToolStream` turns each streamed piece of
text into SSE choice chunks in OpenAI's exact shape: content deltas as usual, a call's first delta
`{"index": i, "id": "call_...", "type": "function", "function": {"name": N, "arguments": ""}}`, then
`{"index": i, "function": {"arguments": FRAGMENT}}`, and the last chunk's `finish_reason`.

Invariants:
- Without a parser (no tools, `tool_choice: "none"`) both paths give exactly what they gave before
  tool calling existed: the text as content, the engine's finish reason, one chunk per piece.
- With one, both paths read the same parser deltas (deltas.py), so a stream reassembles to the
  non-streamed message; a choice that made a call and stopped on its own ends with
  `finish_reason: "tool_calls"` (one cut by max_tokens keeps "length", as OpenAI's does).
- Every piece's logprobs ride on its first chunk; a piece whose text is all held back still sends
  one chunk with an empty delta when it carries logprobs or the finish reason, so none is lost.
"""

from __future__ import annotations

from pydantic import BaseModel

from ..protocol import AssistantMessage, Usage
from ..sse import StreamChunks
from .deltas import ContentDelta, Delta, ToolCallDelta, ToolParser, extract
from .plan import ToolPlan


def finish_reason_of(finish_reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason


def tool_message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The non-streamed `message` and finish reason of one choice whose output is `text`."""
    if plan.parser is None:
        return AssistantMessage(content=text), finish_reason
    parsed = extract(plan.new_parser(), text)
    message = AssistantMessage(content=parsed.content, tool_calls=parsed.tool_calls or None)
    return message, finish_reason_of(finish_reason, bool(parsed.tool_calls))


class ToolStream:
    """The chunks of one streamed chat response's choices, parsed for tool calls when the plan says so."""

    def __init__(self, plan: ToolPlan, chunks: StreamChunks) -> None:
        self._plan = plan
        self._chunks = chunks
        self._parsers: dict[int, ToolParser] = {}
        self._made_calls: set[int] = set()

    def events(
        self,
        index: int,
        text: str,
        logprobs: BaseModel | None = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        usage: Usage | None = None,
    ) -> list[str]:
        """The SSE events for choice `index`'s next piece of text (`finish_reason` set on its last piece), each
        with `usage` when given (vLLM's `continuous_usage_stats`)."""
        chunks = self._chunks
        if self._plan.parser is None:
            return [chunks.event([chunks.chat_choice(index, text, None, logprobs, finish_reason, stop_reason)], usage)]
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self._plan.new_parser()
        deltas = parser.feed(text)
        if finish_reason is not None:
            deltas += parser.finish()
        if any(isinstance(d, ToolCallDelta) for d in deltas):
            self._made_calls.add(index)
        finish_reason = finish_reason_of(finish_reason, index in self._made_calls)
        pieces = _merged(deltas)
        if not pieces and (logprobs is not None or finish_reason is not None):
            pieces = [None]  # an empty delta: it carries the logprobs or the finish reason
        events = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            args = (logprobs if i == 0 else None, finish_reason if last else None, stop_reason if last else None)
            if isinstance(piece, ToolCallDelta):
                events.append(chunks.event([tool_call_choice(chunks, index, piece, *args)], usage))
            else:
                events.append(
                    chunks.event([chunks.chat_choice(index, piece.text if piece else None, None, *args)], usage)
                )
        return events


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Neighbouring pieces of the same kind joined (one chunk per content run or per call's fragments)."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if isinstance(delta, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + delta.text)
        elif (isinstance(delta, ToolCallDelta) and isinstance(last, ToolCallDelta) and delta.id is None
              and last.id is None and delta.index == last.index):  # fmt: skip
            out[-1] = ToolCallDelta(last.index, last.arguments + delta.arguments)
        else:  # a call's first delta stays a chunk of its own (its arguments "", as OpenAI sends it)
            out.append(delta)
    return out


def tool_call_choice(
    chunks: StreamChunks,
    index: int,
    delta: ToolCallDelta,
    logprobs: BaseModel | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
) -> str:
    """One `ChatChunkChoice` whose delta holds one `DeltaToolCall`, as JSON (what pydantic would write)."""
    call: dict[str, object] = {"index": delta.index}
    if delta.id is not None:
        call.update(id=delta.id, type="function")
    call["function"] = (
        {"arguments": delta.arguments} if delta.name is None else {"name": delta.name, "arguments": delta.arguments}
    )
    return chunks.tool_call_choice(index, call, logprobs, finish_reason, stop_reason)
