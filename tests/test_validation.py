"""Bad input is refused with a `ValueError` that says what to fix, and nothing else is affected.

Covers prompts (too long, empty, bad token ids), sampling values, `LLM(...)` keyword
arguments and sizes checked against the model, and the engine invariant that a rejected
request never disturbs requests already running: they finish with exactly the tokens they
would have produced had the bad request never been sent.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.engine_config import EngineConfig
from tidepool.engine.llm_engine import LLMEngine

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), show_progress=False, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)


# ---- prompts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([5] * (MAX_MODEL_LEN + 1), "max_model_len"),
        ([[]], "empty"),
        ([[5, 512]], r"\[0, 512\)"),
        ([[5, -1]], r"\[0, 512\)"),
        ([[5, 1.5]], "integers"),
        ([[5, "7"]], "integers"),
        ([[5, True]], "integers"),
        ([None], "string or a list of token ids"),
    ],
    ids=["too-long", "empty-list", "out-of-vocab", "negative", "float", "str-token", "bool-token", "not-a-prompt"],
)
def test_bad_prompt_raises_and_nothing_runs(llm: LLM, prompt: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", *prompt] if isinstance(prompt[0], list) else prompt, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_of_exactly_max_model_len_is_accepted(llm: LLM) -> None:
    [out] = llm.generate([[5] * MAX_MODEL_LEN], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1  # no room for more, but the last position's token is free
    assert out.outputs[0].finish_reason == "length"


def test_too_long_prompt_message_says_what_to_do(llm: LLM) -> None:
    with pytest.raises(ValueError, match="shorten the prompt or raise max_model_len"):
        llm.generate([[5] * (MAX_MODEL_LEN + 1)], use_tqdm=False)


def test_empty_string_prompt_raises(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)


# ---- sampling values --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        # Infinite values would turn -inf masks (min_tokens) or zero logits into NaN in the sampler.
        ({"temperature": math.inf}, "temperature"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [-5]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"seed": 1.5}, "seed"),
    ],
    ids=lambda value: str(value) if isinstance(value, str) else "-".join(f"{k}={v!r}" for k, v in value.items()),
)
def test_invalid_sampling_values_name_the_field_and_the_range(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert any(word in message for word in ("must", "exceed")), message


def test_valid_edge_values_are_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0)
    SamplingParams(max_tokens=None, min_tokens=3, logprobs=20, stop="x", n=3)
    assert SamplingParams(stop="end").stop == ["end"]


def test_sampling_params_of_the_wrong_type_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.engine.add_request("typo", "hello", {"temperature": 0.5})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- engine configuration --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_seq": 4}, "max_num_seq"),  # a typo of max_num_seqs
        ({"dtype": "float64"}, "dtype"),
        ({"dtype": "half-ish"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 4096}, "max_position_embeddings"),
        ({"max_model_len": 256, "num_kv_blocks": 8}, "raise num_kv_blocks"),
        ({"device": "tpu:7"}, "device"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16, "max_model_len": 64}, "chunked prefill"),
    ],
    ids=[
        "unknown-kwarg",
        "float64",
        "bad-dtype",
        "block-size-0",
        "max-seqs-0",
        "too-long",
        "kv-too-small",
        "device",
        "no-chunk",
    ],
)
def test_bad_llm_arguments_raise_value_error(tiny_model_dir: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_model_dir), show_progress=False, **kwargs)


# ---- a bad request never disturbs running ones -------------------------------------------------------
RUNNING = [
    ("greedy", "the cat sat on the mat", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
    ("seeded", "once upon a time", SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)),
    ("unseeded", "hello", SamplingParams(temperature=0.9, top_k=20, max_tokens=8, ignore_eos=True)),
]
BAD: list[tuple[str, Any, Any]] = [
    ("too-long", [5] * (MAX_MODEL_LEN + 1), SamplingParams()),
    ("empty", [], SamplingParams()),
    ("out-of-vocab", [5, 9999], SamplingParams()),
    ("n-2", "hi", SamplingParams(n=2)),
    ("duplicate-id", "hi", SamplingParams()),
]


def _run(model_dir: Path, inject_bad: bool) -> dict[str, list[int]]:
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), show_progress=False, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    )
    for request_id, prompt, params in RUNNING:
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {}
    for step in range(200):
        if step == 3 and inject_bad:
            for request_id, prompt, params in BAD:
                with pytest.raises(ValueError):
                    engine.add_request("greedy" if request_id == "duplicate-id" else request_id, prompt, params)
            assert engine.scheduler.num_running + engine.scheduler.num_waiting == len(RUNNING)
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    return tokens


def test_rejected_request_leaves_running_requests_untouched(tiny_model_dir: Path) -> None:
    clean = _run(tiny_model_dir, inject_bad=False)
    disturbed = _run(tiny_model_dir, inject_bad=True)
    assert set(clean) == {request_id for request_id, _, _ in RUNNING}
    assert disturbed == clean
