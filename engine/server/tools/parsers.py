"""Tool-call parsers by name: the registry behind `--tool-call-parser NAME` (vLLM's names) and its checks.

Role: map a parser name to its factory (the interface every parser implements is deltas.py) and
check the server's tool flags at start-up, so a bad name exits before the model loads.

Invariant: `PARSERS` is the one list of parser names: the flag's check, its error messages and
`get_parser` all read it.
"""

from __future__ import annotations

from .deltas import ParserFactory
from .hermes import HermesParser

PARSERS: dict[str, ParserFactory] = {"hermes": HermesParser}


def parser_names() -> tuple[str, ...]:
    return tuple(sorted(PARSERS))


def get_parser(name: str) -> ParserFactory:
    """The factory registered as `name`; ValueError naming the known ones otherwise."""
    factory = PARSERS.get(name)
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
