"""The tool-call parser interface: what a parser is fed and what it returns, and how deltas make a reply.

Role: every parser (hermes.py, one per format) implements `ToolParser`. A parser is a streaming
state machine: `feed(delta_text)` takes the next piece of the output and returns what is now safe
to send (`ContentDelta`s and `ToolCallDelta`s); `finish()` returns what was held back once the
output has ended. `extract(parser, text)` is the non-streamed form: it feeds the whole text to a
fresh parser and assembles the deltas. The registry of parsers by name is parsers.py.

Invariants:
- Streaming equals non-streaming: the non-streamed result is built from the very deltas a stream
  sends, so for any output the concatenated content deltas are the non-streamed `content` and
  each call's concatenated argument fragments are its non-streamed `arguments`, whatever the
  chunking (tests/server/test_tool_parsers.py checks this over random chunkings). A parser's
  output therefore may not depend on how its input was cut.
- A call's first delta carries its id (`call_<hex>`), and name with arguments ""; later deltas of
  the same call carry argument fragments only; calls are numbered 0, 1, ... in output order.
- Without calls the content is the output text unchanged.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .schema import FunctionCall, ToolCall


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call `index`: its start (id and name set, arguments "") or an arguments fragment."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Delta = ContentDelta | ToolCallDelta


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Delta]:
        """Take the next piece of the output; return what can be sent now."""
        ...

    def finish(self) -> list[Delta]:
        """The output has ended: return everything still held back."""
        ...


# A parser factory takes the most calls to report (None: any number; 1 for parallel_tool_calls=false).
ParserFactory = Callable[[int | None], ToolParser]


def new_call_id() -> str:
    """An OpenAI-shaped tool-call id: `call_` and 24 random hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class Extracted:
    content: str | None  # the text outside calls; None when there are calls and no such text
    tool_calls: list[ToolCall]


def assemble(deltas: list[Delta]) -> Extracted:
    """Content and calls from a parser's deltas (the non-streamed response is made of the streamed pieces)."""
    content: list[str] = []
    ids: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif delta.id is not None:
            assert delta.index == len(ids) and delta.name is not None, "calls start in order"
            ids.append(delta.id)
            names.append(delta.name)
            arguments.append([delta.arguments])
        else:
            arguments[delta.index].append(delta.arguments)
    calls = [ToolCall(id=i, function=FunctionCall(name=n, arguments="".join(a)))
             for i, n, a in zip(ids, names, arguments, strict=True)]  # fmt: skip
    text = "".join(content)
    return Extracted(None if calls and not text.strip() else text, calls)


def extract(parser: ToolParser, text: str) -> Extracted:
    """The non-streamed parse of a whole output: `text` fed to a fresh `parser` at once."""
    return assemble([*parser.feed(text), *parser.finish()])
