"""llguidance as Tidepool's grammar engine (backend.py's interface).

Why llguidance (over xgrammar and outlines-core): one abi3 wheel with no torch or transformers
dependency (the engine's CPU image stays small, the wheel works for every Python we run); it
builds grammars lazily, so compiling a JSON schema takes about a millisecond and there is no
per-schema compile stall to hide; masks take tens of microseconds per token on a CPU; its JSON
schema coverage is the widest of the three (JSONSchemaBench, arXiv 2501.10868); and it matches
tokens with rollback, which speculation and re-synchronisation need. Lark grammars embed JSON
schemas (`%json{...}`), which tool calling uses; GBNF grammars are converted to Lark.

Invariants: one `LLTokenizer` per engine, built on first use from the engine's own
`tokenizers` JSON with the model's vocabulary size (ids past the tokenizer's are never allowed)
and every EOS the engine stops on; JSON is written with `", "` and `": "` and no free
whitespace, so a model cannot spend its budget on blank lines inside an object.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from .backend import GrammarError, Matcher
from .params import JSON_STYLE, StructuredOutputsParams
from .schemas import check_ref_cycles, strict_schema

_PARALLEL_ROWS = 8  # rows per step from which llguidance's own thread pool fills the masks ...
_PARALLEL_CPUS = 8  # ... on hosts with at least this many CPUs


class LLGuidanceMatcher:
    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def consume(self, token_ids: Sequence[int]) -> int:
        ids = list(token_ids)
        num_valid = self._matcher.validate_tokens(ids)
        if num_valid and not self._matcher.consume_tokens(ids[:num_valid]):
            return 0
        return num_valid

    def rollback(self, num_tokens: int) -> bool:
        return num_tokens == 0 or (self._matcher.rollback(num_tokens) and not self._matcher.is_error())

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class LLGuidanceGrammar:
    """A compiled constraint: a matcher in its start state, copied for every request."""

    __slots__ = ("_template",)

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (about 0.3 s), by whichever thread first needs it
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> LLGuidanceGrammar:
        text = grammar_text(spec)
        tokenizer = self.tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise GrammarError(_bounded(messages[0] if messages else "invalid grammar"))
        template = llguidance.LLMatcher(tokenizer, text, log_level=0)
        scratch = bytearray(4 * ((self._vocab_size + 31) // 32))
        # The first mask builds the lexer's start states: done here, off the engine thread, and checked.
        template.unsafe_compute_mask_ptr(_address(scratch), len(scratch))
        if template.is_error():
            raise GrammarError(_bounded(template.get_error()))
        if not any(scratch):
            raise GrammarError("the constraint allows no output at all")
        return LLGuidanceGrammar(template)

    def fill_bitmasks(self, rows: Sequence[tuple[Matcher, int]], data_ptr: int, row_bytes: int, num_rows: int) -> None:
        # Each call drops the GIL. On a small CPU host one thread is enough (a few hundred microseconds for a
        # batch of 16); llguidance's thread pool pays only where cores are to spare (a GPU host, big batches).
        if len(rows) >= _PARALLEL_ROWS and (os.cpu_count() or 1) >= _PARALLEL_CPUS:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            pairs = [(matcher._matcher, index) for matcher, index in rows]  # type: ignore[attr-defined]
            self._executor.unsafe_compute_mask_ptr(pairs, data_ptr, row_bytes, num_rows)
            return
        for matcher, index in rows:
            matcher._matcher.unsafe_compute_mask_ptr(data_ptr + index * row_bytes, row_bytes)  # type: ignore[attr-defined]


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a constraint; GrammarError for input it cannot even read."""
    from_schema = llguidance.LLMatcher.grammar_from_json_schema
    try:
        if spec.kind == "json":
            schema = spec.schema()
            assert schema is not None
            check_ref_cycles(schema)
            return from_schema(strict_schema(schema) if spec.strict else schema, overrides=JSON_STYLE)
        if spec.kind == "json_object":
            return from_schema({"type": "object"}, overrides=JSON_STYLE)
        if spec.kind == "regex":
            assert spec.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(ascii_classes(spec.regex))
        if spec.kind == "choice":
            assert spec.choice is not None
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            )
        assert spec.grammar is not None
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as err:
        raise GrammarError(f"cannot read the {spec.kind} constraint: {err}") from None


_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """`\\d` and `\\w` (and `\\D`, `\\W` outside brackets) with ECMAScript's ASCII meaning, as in JSON Schema
    patterns and other engines' regex constraints: llguidance's Rust syntax would let `\\d` take any Unicode
    digit (a model then writes U+1FBF9 for "9")."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            letter = regex[i + 1]
            if letter.lower() in _CLASSES and (not in_class or letter.islower()):
                chars = _CLASSES[letter.lower()]
                out.append(chars if in_class else f"[{'^' if letter.isupper() else ''}{chars}]")
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class and out and out[-1] not in ("[", "[^"):
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def _address(buffer: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def _bounded(message: str, limit: int = 400) -> str:
    """llguidance's message without its parser-state dump, bounded (it may quote a whole grammar)."""
    text = message.split("<state>")[0].strip()
    if text in _STOP_REASONS or not text:
        text = "the constraint cannot produce any output (does it refer to itself without end?)"
    return text if len(text) <= limit else text[:limit] + "..."


_STOP_REASONS = {"NoExtension", "NoExtensionBias", "NotStopped", "EndOfSentence", "InternalError"}
