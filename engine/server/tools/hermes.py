"""The `hermes` tool-call parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Hermes).

Role: a streaming state machine (deltas.py's interface). Text outside blocks is content; each
block is a call. The usual block, `{"name": "<string>", "arguments": <value>` (whitespace
anywhere, `"parameters"` accepted for `"arguments"`), is streamed: the call's first delta is sent
as soon as its name is known, then the arguments value's raw text as the model writes it, up to
its end, found by a small JSON scanner (strings, escapes, bracket depth), so the closing `}` of
the block is never mistaken for the arguments'. Anything else in a block (keys in another order,
a JSON list of calls as SmolLM2 and xLAM write, `arguments` given as a JSON string) is held
until `</tool_call>` and then parsed whole; a block that does not parse is content, verbatim.

Invariants:
- The arguments of a streamed call are the raw text of its value (never re-serialised), so what a
  client reassembles is byte for byte what the model wrote; a string value is its decoded text,
  and a call parsed whole has its arguments written by `json.dumps` (", " and ": ").
- Text that might still become `<tool_call>` is held back, and so is whitespace that might touch
  a call: whitespace adjacent to a call is dropped, every other character of content is sent
  unchanged, in order (an output without calls is its text, unchanged). The output therefore
  never depends on how the text was cut into pieces.
- At most `max_calls` calls are reported; later blocks are skipped whole.
- An output that ends inside a block: a call already started keeps the arguments sent so far
  (the finish reason says "length"); a block whose name was not yet read is parsed whole if it
  can be, else it is content.
"""

from __future__ import annotations

import json
from typing import Any

from .deltas import ContentDelta, Delta, ToolCallDelta, new_call_id

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_WS = " \t\r\n"
_NEED, _MISMATCH = "need", "mismatch"  # scan results: more text needed / not the streamed form


class HermesParser:
    def __init__(self, max_calls: int | None = None) -> None:
        self._max_calls = max_calls
        self._buf = ""  # text received and not yet consumed
        self._state = "text"  # text | head | value | after | whole
        self._pending_ws = ""  # whitespace held in content: dropped if a block follows
        self._after_block = False  # content right after a block: its leading whitespace is dropped
        self._num_calls = 0
        self._skipping = False  # the current block is past max_calls: skipped whole
        self._value: _ValueScanner | None = None

    # ---- interface ------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self._state == "head" or self._state == "whole":
            self._close_whole(self._buf, out, closed=False)
        elif self._state == "value" and self._value is not None:
            self._add_args(self._value.flush(), out)
        self._buf = ""
        if self._pending_ws:  # whitespace no block followed is content after all
            out.append(ContentDelta(self._pending_ws))
            self._pending_ws = ""
        return out

    # ---- states ---------------------------------------------------------------------------------
    def _step(self, out: list[Delta], final: bool) -> bool:
        """Advance one state transition; False when the text so far is used up (or held back)."""
        state, buf = self._state, self._buf
        if state == "text":
            at = buf.find(OPEN)
            if at >= 0:
                self._content(buf[:at], out)  # whitespace before the tag stays held: dropped if it is a call
                self._buf, self._state = buf[at + len(OPEN) :], "head"
                self._skipping = self._max_calls is not None and self._num_calls >= self._max_calls
                return True
            keep = 0 if final else _partial_suffix(buf, OPEN)
            self._content(buf[: len(buf) - keep], out)
            self._buf = buf[len(buf) - keep :]
            return False
        if state == "head":
            if self._skipping:
                self._state, self._pending_ws = "after", ""
                return True
            head = _scan_head(buf)
            if head == _NEED:
                return False
            if head == _MISMATCH:
                self._state = "whole"
                return True
            name, start = head
            out.append(ToolCallDelta(self._num_calls, "", new_call_id(), name))
            self._num_calls += 1
            self._buf, self._state, self._value = buf[start:], "value", _ValueScanner()
            self._pending_ws = ""  # it touches a call
            return True
        if state == "value":
            assert self._value is not None
            used, fragment, done = self._value.scan(buf)
            self._add_args(fragment, out)
            self._buf = buf[used:]
            if done:
                self._state, self._value = "after", None
                return True
            return False
        # "after" (the rest of a streamed or skipped block) and "whole" both end at the closing tag.
        at = buf.find(CLOSE)
        if at < 0:
            if state == "after":  # nothing of it is sent: keep only what may be the start of the tag
                self._buf = buf[len(buf) - _partial_suffix(buf, CLOSE) :]
            return False
        if state == "whole":
            self._close_whole(buf[:at], out, closed=True)
        else:
            self._after_block = True
        self._buf, self._state = buf[at + len(CLOSE) :], "text"
        return True

    def _content(self, text: str, out: list[Delta]) -> None:
        """Send `text` as content, except whitespace that may yet touch a call (held in `_pending_ws`)."""
        if self._after_block:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_block = False
        text = self._pending_ws + text
        kept = text.rstrip(_WS)
        self._pending_ws = text[len(kept) :]
        if kept:
            out.append(ContentDelta(kept))

    def _add_args(self, fragment: str, out: list[Delta]) -> None:
        if fragment:
            out.append(ToolCallDelta(self._num_calls - 1, fragment))

    def _close_whole(self, body: str, out: list[Delta], closed: bool) -> None:
        """A block read whole: its calls, or (if it does not parse) its text as content."""
        calls = _parse_block(body)
        if calls is None:  # not a call after all: its text is content, with the whitespace before it
            self._content(OPEN + body + (CLOSE if closed else ""), out)
            return
        self._pending_ws = ""
        for name, arguments in calls:
            if self._max_calls is not None and self._num_calls >= self._max_calls:
                break
            out.append(ToolCallDelta(self._num_calls, "", new_call_id(), name))
            self._num_calls += 1
            self._add_args(arguments, out)
        self._after_block = True


class _ValueScanner:
    """The arguments value, char by char: objects and arrays are streamed raw; strings and scalars whole."""

    __slots__ = ("_depth", "_escape", "_in_string", "_kind", "_seen")

    def __init__(self) -> None:
        self._kind = ""  # "" until the first character: container | string | scalar
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._seen = ""  # a string or scalar value so far (sent whole when it ends)

    def scan(self, text: str) -> tuple[int, str, bool]:
        """(characters used, fragment to send, whether the value ended)."""
        if not text:
            return 0, "", False
        if not self._kind:
            self._kind = "container" if text[0] in "{[" else "string" if text[0] == '"' else "scalar"
        for i, char in enumerate(text):
            if self._kind == "scalar" and char in ",}]" + _WS:
                return i, self._whole(self._seen + text[:i]), True
            if self._escape:
                self._escape = False
            elif self._in_string:
                if char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
                    if self._kind == "string":
                        return i + 1, self._whole(self._seen + text[: i + 1]), True
            elif char == '"':
                self._in_string = True
            elif self._kind == "container" and char in "{[":
                self._depth += 1
            elif self._kind == "container" and char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1, text[: i + 1], True
        if self._kind == "container":
            return len(text), text, False
        self._seen += text
        return len(text), "", False

    def flush(self) -> str:
        """What an unfinished string or scalar value holds, when the output ends inside it."""
        return "" if self._kind == "container" else self._seen

    @staticmethod
    def _whole(raw: str) -> str:
        if raw.startswith('"'):  # arguments written as a JSON string holding the JSON: its text
            try:
                return str(json.loads(raw))
            except ValueError:
                return raw
        return raw


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (held back: it may become the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _literal(text: str, i: int, *options: str) -> int | str:
    """The index after whichever option `text` has at `i`; _NEED if it may still be one, else _MISMATCH."""
    need = False
    for option in options:
        got = text[i : i + len(option)]
        if got == option:
            return i + len(option)
        need = need or (len(got) < len(option) and option.startswith(got))
    return _NEED if need else _MISMATCH


def _scan_head(text: str) -> tuple[str, int] | str:
    """`{"name": "<string>", "arguments": ` at the start of a block: (name, where the value starts),
    _NEED while the text may still become that, _MISMATCH once it cannot."""
    i = 0
    for part in ("{", '"name"', ":"):
        i = _literal(text, _skip_ws(text, i), part)
        if isinstance(i, str):
            return i
    i = _skip_ws(text, i)
    if i == len(text):
        return _NEED
    if text[i] != '"':
        return _MISMATCH
    end, escape = i + 1, False
    while end < len(text) and (escape or text[end] != '"'):
        escape = not escape and text[end] == "\\"
        end += 1
    if end == len(text):
        return _NEED
    try:
        name = json.loads(text[i : end + 1])
    except ValueError:
        return _MISMATCH
    i = end + 1
    for options in ((",",), ('"arguments"', '"parameters"'), (":",)):
        i = _literal(text, _skip_ws(text, i), *options)
        if isinstance(i, str):
            return i
    i = _skip_ws(text, i)
    return _NEED if i == len(text) else (name, i)


def _parse_block(body: str) -> list[tuple[str, str]] | None:
    """The calls of a block read whole (one call object, or a list of them), as (name, arguments JSON); None
    if it is not that."""
    try:
        value: Any = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append((item["name"], arguments))
    return calls or None
