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
        ({"max_tokens": -1}, "max_tokens"),  # 0 is valid: prefill only (scoring)
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
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
        # The engine's documented limits (sampling_params.py): a value past them cannot reach torch.
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**70}, "min_tokens"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"temperature": 10**309}, "temperature"),  # an int too large for a float
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),
        ({"repetition_penalty": 1e308}, "repetition_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
    ],
    ids=lambda value: str(value) if isinstance(value, str) else "-".join(f"{k}={v!r}"[:40] for k, v in value.items()),
)
def test_invalid_sampling_values_name_the_field_and_the_range(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert any(word in message for word in ("must", "exceed")), message


def test_valid_edge_values_are_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0)
    SamplingParams(max_tokens=None, min_tokens=3, logprobs=20, stop="x", n=3)
    SamplingParams(seed=2**63 - 1, top_k=2**31 - 1, repetition_penalty=100.0, logit_bias={0: -100, 7: 100})
    SamplingParams(seed=-(2**63), repetition_penalty=0.01, max_tokens=2**31 - 1)
    assert SamplingParams(stop="end").stop == ["end"]


def test_temperatures_below_the_floor_are_greedy() -> None:
    from tidepool.engine.sampling_params import GREEDY_TEMPERATURE

    assert all(SamplingParams(temperature=t).is_greedy for t in (0.0, 5e-324, 1e-39, GREEDY_TEMPERATURE / 2))
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy


def test_a_huge_bad_value_makes_a_short_message() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=["x" * 1_000_000, ""])
    assert len(str(info.value)) < 500


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


# ---- a request that fails inside a step is finished alone ---------------------------------------------
VICTIM = ("victim", "a request that will fail", SamplingParams(temperature=0.7, seed=5, max_tokens=12, ignore_eos=True))


def _run_failing(model_dir: Path, where: str | None) -> dict[str, Any]:
    """Steps RUNNING + VICTIM; from step 3 on, the victim's processing raises in `where` (None: never)."""
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), show_progress=False, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    )
    for request_id, prompt, params in [*RUNNING, VICTIM]:
        engine.add_request(request_id, prompt, params)

    def boom(*_: Any) -> Any:
        raise RuntimeError("injected failure")

    finals: dict[str, Any] = {}
    for step in range(200):
        if step == 3 and where == "sampler":
            apply = engine.sampler._apply_penalties_and_masks

            def failing(logits: Any, row: int, request: Any, apply: Any = apply) -> None:
                if request.request_id == VICTIM[0]:
                    boom()
                apply(logits, row, request)

            engine.sampler._apply_penalties_and_masks = failing  # type: ignore[method-assign]
        if step == 3 and where == "detokenizer":
            engine._tracked[VICTIM[0]].detokenizer.update = boom  # type: ignore[method-assign]
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks  # nothing leaked
    after = engine.add_request("after", "still serving", SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert after.num_output_tokens == 3
    return finals


@pytest.mark.parametrize("where", ["sampler", "detokenizer"])
def test_a_request_failing_inside_a_step_is_finished_alone(tiny_model_dir: Path, where: str) -> None:
    clean = _run_failing(tiny_model_dir, None)
    failed = _run_failing(tiny_model_dir, where)
    victim = failed.pop(VICTIM[0])
    assert victim.error is not None and "injected failure" in victim.error
    assert victim.outputs[0].finish_reason == "abort"
    assert clean[VICTIM[0]].error is None
    assert {rid: out.outputs[0].token_ids for rid, out in failed.items()} == {
        rid: clean[rid].outputs[0].token_ids for rid, _, _ in RUNNING
    }


# ---- ...but a broken engine is never hidden behind per-request failures --------------------------------
def _step_of(*request_ids: str) -> Any:
    from tidepool.engine.request import Request
    from tidepool.engine.sched_output import ScheduledSeq, SchedulerOutput

    seqs = [ScheduledSeq(Request(rid, [5], SamplingParams()), 0, 1, [0], True) for rid in request_ids]
    return SchedulerOutput(seqs, len(seqs))


def _runner(failing: set[str], error: Exception | None = None) -> Any:
    from tidepool.engine.sched_output import ModelRunnerOutput

    def run(sched_out: Any) -> ModelRunnerOutput:
        ids = {seq.request.request_id for seq in sched_out.scheduled}
        if ids & failing:
            raise error or RuntimeError(f"fails on {sorted(ids & failing)}")
        return ModelRunnerOutput(sampled_token_ids=dict.fromkeys(ids, 7))

    return run


def test_step_isolation_tells_a_request_fault_from_an_engine_fault() -> None:
    from tidepool.engine.distributed.executor import WorkerFailedError
    from tidepool.engine.isolation import StepIsolation

    isolation = StepIsolation(max_failed_steps=3)
    out, errors = isolation.execute(_runner({"b"}), _step_of("a", "b", "c"))
    assert out.sampled_token_ids == {"a": 7, "c": 7} and set(errors) == {"b"}
    # Every sequence fails even alone: the engine is at fault, not a request.
    with pytest.raises(RuntimeError):
        isolation.execute(_runner({"a", "b"}), _step_of("a", "b"))
    # A dead worker is fatal at once, whatever the batch.
    with pytest.raises(WorkerFailedError):
        isolation.execute(_runner({"b"}, WorkerFailedError("rank 1 died")), _step_of("a", "b"))
    # A lone sequence failing is its own fault... until nothing has run for max_failed_steps steps in a row.
    for _ in range(2):
        assert set(isolation.execute(_runner({"x"}), _step_of("x"))[1]) == {"x"}
    isolation.execute(_runner(set()), _step_of("y"))  # a healthy step resets the count
    for _ in range(2):
        assert set(isolation.execute(_runner({"x"}), _step_of("x"))[1]) == {"x"}
    with pytest.raises(RuntimeError):
        isolation.execute(_runner({"x"}), _step_of("x"))
