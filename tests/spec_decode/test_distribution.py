"""End to end on a 24-token model at temperature 1: with speculation (draft model with sampled proposals,
and n-gram), the first three generated tokens follow the target's exact marginal distributions, computed
here from the model's own logits. A wrong residual rule in the engine is caught by the same check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from spec_helpers import SMALL_VOCAB, chi_square_p_value, perturbed_copy

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.spec_decode import rejection_sampler

# Every token occurs in the prompt, so n-gram lookup has a proposal at every step.
PROMPT = [*range(SMALL_VOCAB), 3, 5]
NUM_SAMPLES = 2400
NUM_POSITIONS = 3
ALPHA = 1e-4


def _engine_kwargs(speculative: dict[str, Any] | None) -> dict[str, Any]:
    # Every request runs at once: speculation must stay on for the whole batch (the off-switch is raised).
    kwargs: dict[str, Any] = dict(show_progress=False, num_kv_blocks=1200, max_num_seqs=256, seed=7)
    if speculative is not None:
        kwargs["speculative_config"] = {"disable_by_batch_size": 10_000, **speculative}
    return kwargs


def _exact_marginals(llm: LLM) -> list[torch.Tensor]:
    """P(t_i = x) for i = 1..3 by enumerating every prefix (1 + 24 + 576 short forward passes)."""
    runner = llm.engine.runner

    def next_probs(prefix: list[int]) -> torch.Tensor:
        return torch.softmax(runner.prompt_logits(PROMPT + prefix)[-1].double(), dim=-1)

    p1 = next_probs([])
    p2 = torch.zeros(SMALL_VOCAB, dtype=torch.float64)
    p3 = torch.zeros(SMALL_VOCAB, dtype=torch.float64)
    for a in range(SMALL_VOCAB):
        p_b = next_probs([a])
        p2 += p1[a] * p_b
        for b in range(SMALL_VOCAB):
            p3 += p1[a] * p_b[b] * next_probs([a, b])
    return [p1, p2, p3]


@pytest.fixture(scope="module")
def target_and_marginals(small_vocab_model: Callable[[int], Path]) -> tuple[Path, list[torch.Tensor]]:
    target = small_vocab_model(0)
    return target, _exact_marginals(LLM(str(target), **_engine_kwargs(None)))


def _sample(
    target: Path, speculative: dict[str, Any], num_samples: int = NUM_SAMPLES
) -> tuple[list[torch.Tensor], LLM]:
    llm = LLM(str(target), **_engine_kwargs(speculative))
    params = SamplingParams(temperature=1.0, max_tokens=NUM_POSITIONS)
    outputs = llm.generate([PROMPT] * num_samples, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outputs])
    return [torch.bincount(tokens[:, i], minlength=SMALL_VOCAB) for i in range(NUM_POSITIONS)], llm


def _draft_config(target: Path, tmp_path: Path) -> dict[str, Any]:
    draft = perturbed_copy(target, tmp_path / "draft", scale=0.5)
    return {"method": "draft", "draft_model": str(draft), "num_speculative_tokens": 2}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_tokens_follow_the_target(
    method: str, target_and_marginals: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    target, marginals = target_and_marginals
    spec = _draft_config(target, tmp_path) if method == "draft" else {"method": "ngram", "num_speculative_tokens": 2}
    counts, llm = _sample(target, spec)
    stats = llm.engine.get_stats()
    # Speculation really ran, and both outcomes happened.
    assert stats.spec_num_draft_tokens > NUM_SAMPLES // 2
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    for position, (observed, expected) in enumerate(zip(counts, marginals, strict=True)):
        assert chi_square_p_value(observed, expected) > ALPHA, f"token {position + 1} is off the target's distribution"


@pytest.mark.slow
def test_a_wrong_residual_is_caught_end_to_end(
    monkeypatch: pytest.MonkeyPatch, target_and_marginals: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    monkeypatch.setattr(rejection_sampler, "residual_distribution", lambda p, q: p)
    target, marginals = target_and_marginals
    counts, _ = _sample(target, _draft_config(target, tmp_path))
    # The check the correct engine passes (every p-value above ALPHA) fails, by a wide margin.
    assert min(chi_square_p_value(c, m) for c, m in zip(counts, marginals, strict=True)) < ALPHA / 100
