"""What one request asks its output to match: a JSON schema, any JSON object, a regex, a choice or a grammar.

Role: the plain, torch-free description of a constraint (vLLM's `StructuredOutputsParams`
names), carried in `SamplingParams.structured_outputs` from the API edge to the sampler. It is
data only: `compiler.py` turns it into a grammar, `matchers.py` applies that grammar to logits.

Invariants: an instance that exists has exactly one kind set, with a value of the right type
(`ValueError` naming the field otherwise); it is immutable and hashable through `key`, a
canonical string (compact JSON, key order kept: a schema's property order is the output's) that
two equal constraints share, so the compiler's
cache keys on it. Whether a schema, regex or grammar actually compiles is the compiler's check,
not this module's.

- `json`: a JSON schema (dict, or its JSON text); `strict` as in OpenAI's `json_schema.strict`:
  objects admit no keys besides their `properties` unless the schema says otherwise.
- `json_object`: any JSON object (OpenAI's `{"type": "json_object"}`).
- `regex`: the whole output matches this regular expression (Rust `regex` syntax, as llguidance's).
- `choice`: the output is exactly one of these strings.
- `grammar`: a Lark grammar (llguidance's dialect, which also embeds JSON schemas as `%json{...}`),
  or a GBNF grammar (llama.cpp's, recognised by its `::=` rules), converted to Lark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# How constrained JSON is written (llguidance's JSON options, also given to `%json{...}` blocks inside grammars):
# as json.dumps writes it. A grammar that allows free whitespace lets a small model fill an object with newlines
# until max_tokens.
JSON_STYLE: dict[str, object] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema as canonical JSON text (a dict given here is serialised)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool = False  # with `json`: no undeclared object keys (OpenAI's strict structured outputs)
    kind: str = field(init=False, compare=False)  # which of KINDS is set
    key: str = field(init=False, compare=False, repr=False)  # canonical form: kind + value

    def __init__(
        self,
        json: str | dict[str, Any] | bool | None = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: list[str] | tuple[str, ...] | None = None,
        grammar: str | None = None,
        strict: bool = False,
    ) -> None:
        schema = _canonical_schema(json)
        if regex is not None and not isinstance(regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {type(regex).__name__}")
        if grammar is not None and (not isinstance(grammar, str) or not grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string (a Lark or GBNF grammar)")
        if choice is not None:
            if not isinstance(choice, list | tuple) or not choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError("structured_outputs.choice must hold non-empty strings only")
            choice = tuple(choice)
        if not isinstance(json_object, bool) or not isinstance(strict, bool):
            raise ValueError("structured_outputs.json_object and .strict must be booleans")
        kinds = [name for name, value in (("json", schema), ("json_object", json_object or None), ("regex", regex),
                                          ("choice", choice), ("grammar", grammar)) if value is not None]  # fmt: skip
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(kinds) or 'none'}"
            )
        set_ = object.__setattr__
        set_(self, "json", schema)
        set_(self, "json_object", json_object)
        set_(self, "regex", regex)
        set_(self, "choice", choice)
        set_(self, "grammar", grammar)
        set_(self, "strict", strict)
        set_(self, "kind", kinds[0])
        value: Any = {"json": schema, "json_object": True, "regex": regex, "choice": choice, "grammar": grammar}[
            kinds[0]
        ]
        set_(self, "key", _dumps({"kind": kinds[0], "value": value, "strict": strict and kinds[0] == "json"}))

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (None unless `json` is the kind)."""
        return None if self.json is None else _loads(self.json)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and other.key == self.key


def _canonical_schema(value: str | dict[str, Any] | bool | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = _loads(value)
        except ValueError as err:
            raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
    if isinstance(value, bool):  # JSON Schema allows true/false as schemas; `false` matches nothing
        if not value:
            raise ValueError("structured_outputs.json is the schema `false`, which no output can match")
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(value).__name__}")
    try:
        return _dumps(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"structured_outputs.json cannot be serialised as JSON: {err}") from None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _loads(text: str) -> Any:
    return json.loads(text)
