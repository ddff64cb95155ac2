"""Tool-call parsers: the model's output text -> content and tool calls, whole or streamed, one parser per format.

Role: the registry behind `--tool-call-parser NAME` (vLLM's names) and the small interface every
parser implements. A parser is a streaming state machine: `feed(delta_text)` takes the next piece
of the output and returns what is now safe to send (`ContentDelta`s and `ToolCallDelta`s);
`finish()` returns what was held back once the output has ended. `extract(parser, text)` is the
non-streamed form: it feeds the whole text to a fresh parser and assembles the deltas.

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


def _parsers() -> dict[str, ParserFactory]:
    from .hermes import HermesParser

    return {"hermes": HermesParser}


def parser_names() -> tuple[str, ...]:
    return tuple(sorted(_parsers()))


def get_parser(name: str) -> ParserFactory:
    """The factory registered as `name`; ValueError naming the known ones otherwise."""
    factory = _parsers().get(name)
    if factory is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(parser_names())}")
    return factory


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """The server's start-up check of its tool flags (vLLM's rules); ValueError naming the flag."""
    if tool_call_parser is not None:
        try:
            get_parser(tool_call_parser)
        except ValueError as err:
            raise ValueError(f"--tool-call-parser: {err}") from None
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser NAME (the format the model writes calls in; "
            f"one of: {', '.join(parser_names())})"
        )


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
