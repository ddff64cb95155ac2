"""Structured outputs in the engine: the constraint's checks, the compiler's cache and limits, and constrained
generation that stays valid (checked with `jsonschema`, the library clients use) and unchanged by everything else
the engine does: batching with free-text requests, n-gram speculation (proposals masked, rejected ones rolled
back), preemption by recompute, chunked prefill and prefix caching."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.structured_outputs import GrammarCompiler, GrammarError, StructuredOutputsParams
from tidepool.engine.structured_outputs.llguidance_backend import ascii_classes
from tidepool.engine.structured_outputs.schemas import check_ref_cycles, strict_schema

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 6},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3},
    },
    "required": ["kind", "count", "ok", "tag", "sizes"],
    "additionalProperties": False,
}
NESTED: dict[str, Any] = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "y": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
# JSON text in the prompt gives n-gram lookup something to propose.
PROMPT = 'Examples: {"kind": "dog", "count": 12, "ok": true, "tag": "ab", "sizes": [1, 2]} ' * 2


@pytest.fixture(scope="module")
def structured_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), show_progress=False)


def _json(schema: dict[str, Any], strict: bool = False) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, strict=strict)


def _params(count: int, spec: StructuredOutputsParams | None, max_tokens: int = 120) -> list[SamplingParams]:
    """Greedy and seeded sampled requests, alternating."""
    return [
        SamplingParams(
            temperature=0 if i % 2 == 0 else 1.0, seed=100 + i, max_tokens=max_tokens, structured_outputs=spec
        )
        for i in range(count)
    ]


def _assert_valid(texts_and_reasons: Sequence[tuple[str, str | None]], schema: dict[str, Any]) -> None:
    for text, reason in texts_and_reasons:
        assert reason == "stop", f"did not finish: {text!r}"
        jsonschema.validate(json.loads(text), schema)


# ---- the constraint ------------------------------------------------------------------------------
def test_exactly_one_kind_and_a_canonical_key() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="no output can match"):
        StructuredOutputsParams(json=False)
    assert StructuredOutputsParams(json=SCHEMA) == StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert StructuredOutputsParams(json=SCHEMA).key != StructuredOutputsParams(json=SCHEMA, strict=True).key
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


def test_strict_closes_objects_the_schema_leaves_open() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}, "b": {"type": "object",
              "additionalProperties": True}}, "$defs": {"d": {"properties": {"x": {}}}}}  # fmt: skip
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert strict["properties"]["b"]["additionalProperties"] is True  # said by the schema: kept
    assert strict["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not modified


def test_strict_leaves_the_parts_of_an_all_of_open(structured_llm: LLM) -> None:
    """Each allOf branch declares some keys of one object: closing a branch would refuse the others' keys, so
    the holder is closed over their union instead."""
    schema = {
        "$defs": {"named": {"type": "object", "properties": {"name": {"enum": ["kim", "lee"]}}, "required": ["name"]}},
        "allOf": [
            {"$ref": "#/$defs/named"},
            {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]},
        ],
    }
    strict = strict_schema(schema)
    assert "additionalProperties" not in strict["$defs"]["named"]
    assert all("additionalProperties" not in branch for branch in strict["allOf"])
    assert strict["additionalProperties"] is False and strict["properties"] == {"n": True, "name": True}
    for output in structured_llm.generate([PROMPT] * 2, _params(2, _json(schema, strict=True)), use_tqdm=False):
        _assert_valid([(output.outputs[0].text, output.outputs[0].finish_reason)], schema)
        assert set(json.loads(output.outputs[0].text)) == {"name", "n"}


def test_regex_classes_are_ascii_as_in_json_schema() -> None:
    assert ascii_classes(r"\d{3}-\w+") == "[0-9]{3}-[0-9A-Za-z_]+"
    assert ascii_classes(r"[\d.]\D\\d") == r"[0-9.][^0-9]\\d"


@pytest.mark.parametrize(
    ("schema", "chain"),
    [
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "#/$defs/a -> #/$defs/a"),
        (
            {
                "$ref": "#/$defs/a",
                "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
            },
            "#/$defs/a -> #/$defs/b -> #/$defs/a",
        ),
    ],
)
def test_ref_cycles_that_write_nothing_are_refused(schema: dict[str, Any], chain: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(chain)):
        check_ref_cycles(schema)


def test_recursion_through_properties_is_a_tree_not_a_cycle() -> None:
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}}}  # fmt: skip
    check_ref_cycles(tree)


# ---- the compiler --------------------------------------------------------------------------------
class _CountingBackend:
    name = "counting"

    def __init__(self, delay_s: float = 0.0, release: threading.Event | None = None) -> None:
        self.compiled: list[str] = []
        self.release = release

    def compile(self, spec: StructuredOutputsParams) -> object:
        if spec.regex == "bad":
            raise GrammarError("bad regex")
        if self.release is not None:
            self.release.wait(30)
        self.compiled.append(spec.key)
        return object()

    def fill_bitmasks(self, *args: Any) -> None:
        raise AssertionError("not used")


def test_compiler_caches_by_constraint_and_evicts_least_recently_used() -> None:
    backend = _CountingBackend()
    compiler = GrammarCompiler(lambda: backend, max_entries=2)  # type: ignore[arg-type, return-value]
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a", "b", "c"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutputsParams(regex="a")) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert compiler.cached(a) is first and compiler.cached(b) is None
    assert len(backend.compiled) == 3
    for _ in range(2):  # an error is not cached: the second try compiles again
        with pytest.raises(GrammarError):
            compiler.compile(StructuredOutputsParams(regex="bad"))
    assert compiler.num_compiled == 3


def test_a_compile_over_the_time_limit_is_an_error_not_a_wait() -> None:
    release = threading.Event()
    compiler = GrammarCompiler(lambda: _CountingBackend(release=release), timeout_s=0.2)  # type: ignore[arg-type, return-value]
    try:
        start = time.monotonic()
        with pytest.raises(GrammarError, match=r"longer than 0\.2 s"):
            asyncio.run(compiler.compile_async(StructuredOutputsParams(regex="slow")))
        assert time.monotonic() - start < 25  # it did not wait for the compile (released below)
    finally:
        release.set()
        compiler.close()


def test_the_real_backend_names_what_is_wrong(structured_llm: LLM) -> None:
    compile_ = structured_llm.engine.grammars.compile
    with pytest.raises(GrammarError, match="foo"):
        compile_(_json({"type": "foo"}))
    with pytest.raises(GrammarError, match="unclosed group"):
        compile_(StructuredOutputsParams(regex="(("))
    with pytest.raises(GrammarError, match="nowhere"):
        compile_(StructuredOutputsParams(grammar="start: nowhere"))
    with pytest.raises(GrammarError, match="cycle"):
        compile_(_json({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}))
    with pytest.raises(ValueError, match="foo"):  # offline: add_request refuses it before queueing anything
        structured_llm.generate(["x"], SamplingParams(structured_outputs=_json({"type": "foo"})), use_tqdm=False)
    assert not structured_llm.engine.has_unfinished_requests()


# ---- constrained generation ----------------------------------------------------------------------
@pytest.mark.parametrize("schema", [SCHEMA, NESTED], ids=["flat", "refs"])
def test_outputs_validate_in_a_batch_mixed_with_free_text(structured_llm: LLM, schema: dict[str, Any]) -> None:
    constrained = _params(6, _json(schema))
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=30) for i in range(3)]
    outputs = structured_llm.generate([PROMPT] * 9, constrained[:3] + free + constrained[3:], use_tqdm=False)
    _assert_valid([(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs[:3] + outputs[6:]], schema)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outputs[3:6])  # the free ones were not constrained


def test_regex_choice_and_grammar(structured_llm: LLM) -> None:
    cases = [
        (
            StructuredOutputsParams(regex=r"\d{3}-[a-c]{2}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-c]{2}", t),
        ),
        (StructuredOutputsParams(choice=["yes", "no", 'say "maybe"']), lambda t: t in ("yes", "no", 'say "maybe"')),
        (
            StructuredOutputsParams(grammar='start: "(" num ("+" num)* ")"\nnum: /[1-9]/'),
            lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t),
        ),
        (
            StructuredOutputsParams(grammar='root ::= "x" [0-9] [0-9]'),
            lambda t: re.fullmatch(r"x\d\d", t),
        ),
    ]
    for spec, ok in cases:
        for output in structured_llm.generate([PROMPT] * 4, _params(4, spec, max_tokens=40), use_tqdm=False):
            text = output.outputs[0].text
            assert output.outputs[0].finish_reason == "stop" and ok(text), (spec.kind, text)


def test_strict_json_admits_no_extra_keys(structured_llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    for output in structured_llm.generate([PROMPT] * 4, _params(4, _json(schema, strict=True)), use_tqdm=False):
        assert list(json.loads(output.outputs[0].text)) == ["a"]


def _tokens(model: Path, params: list[SamplingParams], **engine: Any) -> tuple[list[list[int]], LLM]:
    structured_llm = LLM(str(model), show_progress=False, **engine)
    outputs = structured_llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], structured_llm


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 64}


@pytest.mark.parametrize(
    "engine",
    [
        {"speculative_config": NGRAM},
        {"speculative_config": NGRAM, "max_num_batched_tokens": 24},  # proposals trimmed by the budget, chunked prefill
        {"num_kv_blocks": 40, "block_size": 8, "max_model_len": 320},  # too little KV for all: preemption and recompute
        {"max_num_batched_tokens": 7, "enable_prefix_caching": True},  # tiny chunks; the shared prompt is cached
    ],
    ids=["ngram", "ngram-budget", "preemption", "chunked-prefix"],
)
def test_tokens_do_not_depend_on_speculation_preemption_or_chunking(
    tiny_model_dir: Path, engine: dict[str, Any]
) -> None:
    params = [*_params(6, _json(SCHEMA)), SamplingParams(temperature=1.0, seed=7, max_tokens=40)]
    want, _ = _tokens(tiny_model_dir, params)
    got, structured_llm = _tokens(tiny_model_dir, params, **engine)
    assert got == want
    stats = structured_llm.engine.get_stats()
    if "speculative_config" in engine:
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # accepted and rejected both
    if "num_kv_blocks" in engine:
        assert stats.num_preemptions_total > 0
    texts = [structured_llm.engine.tokenizer.decode(t) for t in got[:6]]
    _assert_valid([(t, "stop") for t in texts], SCHEMA)


def test_n_completions_each_follow_their_own_grammar_state(structured_llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120, structured_outputs=_json(SCHEMA))
    [output] = structured_llm.generate([PROMPT], params, use_tqdm=False)
    assert len(output.outputs) == 4
    _assert_valid([(c.text, c.finish_reason) for c in output.outputs], SCHEMA)
    assert len({c.text for c in output.outputs}) > 1
    assert len(structured_llm.engine.sampler.grammar_masks) == 0  # released with their requests


def test_bitmask_unpacking_matches_the_bit_definition() -> None:
    import torch

    from tidepool.engine.structured_outputs.matchers import refused_tokens

    generator = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 512, 49152):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
        expected = torch.tensor(
            [[not (int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)]
        )
        assert torch.equal(refused_tokens(bitmask, vocab), expected)
