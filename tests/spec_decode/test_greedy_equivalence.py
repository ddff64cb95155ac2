"""Greedy output is identical with and without speculation, for both proposers, across a mixed batch:
different prompt lengths, stop strings, stop tokens, max_tokens, max_model_len, penalties, logprobs,
shared prefixes (prefix caching on), and with a KV cache so small that requests are preempted. A second
wave continues the first wave's outputs, so it reads prefix-cache blocks written while speculating."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tidepool.engine import LLM, SamplingParams

SHARED = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 2
PROMPTS = [
    SHARED + "def mul(a, b):",
    SHARED + "def div(a, b):",
    "hello",
    "the cat sat on the mat and the cat sat on the",
    "a b c d e f g a b c d e f g a b c",
    "one two three four five six seven eight nine ten",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,",
    "lorem ipsum dolor sit amet",
]
SCENARIOS = {
    # name: engine kwargs (both runs), expect preemption
    "prefix-cache": (dict(num_kv_blocks=256, enable_prefix_caching=True), False),
    "tiny-kv": (dict(num_kv_blocks=14, enable_prefix_caching=True), True),
}


def _params(free_run: list[list[int]], free_text: list[str]) -> list[SamplingParams]:
    """Per-prompt parameters; stop string/token picked from a free greedy run so they really fire mid-way."""
    stop_text = free_text[3][6:9]
    return [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=33, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=40, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free_run[4][7]]),
        SamplingParams(temperature=0, max_tokens=None),  # runs into max_model_len
        SamplingParams(temperature=0, max_tokens=25, logprobs=2),  # no speculation for it, same result
        SamplingParams(temperature=0, max_tokens=30, min_tokens=10, stop_token_ids=[free_run[7][2]]),
    ]


def _run(model: Path, engine: dict[str, Any], speculative: dict[str, Any] | None) -> tuple[list[Any], LLM]:
    llm = LLM(str(model), show_progress=False, max_model_len=128, speculative_config=speculative, **engine)
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    params = _params([o.outputs[0].token_ids for o in free], [o.outputs[0].text for o in free])
    wave1 = llm.generate(PROMPTS, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    wave2_prompts = [tokenizer.encode(p) + o.outputs[0].token_ids for p, o in zip(PROMPTS, wave1, strict=True)]
    wave2_prompts = [p[:100] for p in wave2_prompts]
    wave2 = llm.generate(wave2_prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    summary = [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
        for o in [*free, *wave1, *wave2]
    ]
    logprobs = wave1[6].outputs[0].logprobs
    return [summary, logprobs], llm


@pytest.fixture(scope="module")
def baselines(tiny_model_dir: Path) -> dict[str, list[Any]]:
    return {name: _run(tiny_model_dir, engine, None)[0] for name, (engine, _) in SCENARIOS.items()}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", ["suffix", "ngram", "draft"])
def test_greedy_identical(
    method: str, scenario: str, baselines: dict[str, list[Any]], tiny_model_dir: Path, tiny_draft_dir: Path
) -> None:
    engine, expect_preemption = SCENARIOS[scenario]
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 4, "disable_by_batch_size": 64}
    if method == "draft":
        spec["draft_model"] = str(tiny_draft_dir)
    result, llm = _run(tiny_model_dir, engine, spec)
    expected = baselines[scenario]
    for index, (got, want) in enumerate(zip(result[0], expected[0], strict=True)):
        assert got == want, f"request {index} differs with {method} speculation"
    # Logprobs: same tokens; values equal up to float rounding (the batch around the request differs).
    for got_step, want_step in zip(result[1], expected[1], strict=True):
        assert got_step.keys() == want_step.keys()
        assert all(abs(got_step[t] - want_step[t]) < 1e-4 for t in got_step)
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # accepted and rejected both happened
    assert (stats.num_preemptions_total > 0) == expect_preemption
    pool = llm.engine.kv_cache.pool
    pool.check_invariants()
    # Only whole blocks of real tokens were ever registered (never a block holding proposals).
    assert all(len(block.token_ids) == llm.engine.kv_cache.block_size for block in pool._cached.values())
    assert pool.num_free_blocks == pool.num_blocks
    if method == "draft":
        draft = llm.engine.speculator.draft
        assert draft.kv.pool.num_free_blocks == draft.kv.pool.num_blocks  # draft KV released with the requests


def test_off_switch_when_the_batch_is_large(tiny_model_dir: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 3}
    llm = LLM(str(tiny_model_dir), show_progress=False, max_model_len=128, speculative_config=spec)
    prompt = "a b c a b c a b c a b c"
    llm.generate([prompt] * 3, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert llm.engine.get_stats().spec_num_draft_tokens == 0  # three running requests: speculation off
    llm.generate([prompt] * 2, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert llm.engine.get_stats().spec_num_draft_tokens > 0


def test_stops_inside_an_accepted_run(tiny_model_dir: Path) -> None:
    """The target as its own draft accepts everything: each step emits K+1 = 5 tokens, so stop strings,
    stop tokens and max_tokens at offsets 1..12 mostly land inside a run; nothing after them is emitted."""
    llm_plain = LLM(str(tiny_model_dir), show_progress=False, max_model_len=128)
    spec = {"method": "draft", "draft_model": str(tiny_model_dir), "num_speculative_tokens": 4}
    llm_spec = LLM(str(tiny_model_dir), show_progress=False, max_model_len=128, speculative_config=spec)
    prompt = "the quick brown fox"
    free = llm_plain.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    params = []
    for offset in range(1, 13):
        params.append(SamplingParams(temperature=0, max_tokens=offset))
        params.append(SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[free.token_ids[offset]]))
        text = llm_plain.get_tokenizer().decode(free.token_ids[: offset + 1])
        if len(text) >= 2 and text[-2:] not in text[:-1]:
            params.append(SamplingParams(temperature=0, max_tokens=20, stop=[text[-2:]]))
    for param in params:  # one at a time: batch size 1 keeps speculation on
        want = llm_plain.generate([prompt], param, use_tqdm=False)[0].outputs[0]
        got = llm_spec.generate([prompt], param, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        ), param
    stats = llm_spec.engine.get_stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
