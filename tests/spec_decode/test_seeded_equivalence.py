"""A seeded sampled request returns the same tokens with n-gram speculation as without it, alone or in a
batch whose token budget trims its proposals: n-gram proposals are verified by matching the target's own
exponential race, drawn from the request's noise rows one per emitted token (rejection_sampler.py), so
speculation changes how many tokens a step emits, never which. Before, rejection sampling drew one
uniform per proposal, so the output depended on how many proposals the scheduler let through."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from spec_helpers import SMALL_VOCAB

from tidepool.engine import LLM, SamplingParams

# Every token occurs in the prompt, so n-gram lookup proposes at (almost) every step.
PROMPT = [*range(SMALL_VOCAB), 3, 5]  # 26 tokens; the model has 64 positions
PARAMS = [
    SamplingParams(temperature=1.0, seed=11, max_tokens=38, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=12, max_tokens=36, ignore_eos=True, top_k=8),
    SamplingParams(temperature=1.2, seed=13, max_tokens=36, ignore_eos=True, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, seed=14, max_tokens=36, ignore_eos=True, repetition_penalty=1.2),
    SamplingParams(temperature=0.9, seed=15, max_tokens=36, ignore_eos=True, presence_penalty=0.5, min_tokens=5),
    SamplingParams(temperature=0, max_tokens=36, ignore_eos=True),  # greedy beside them
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 64}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": 64}


def _generate(model: Path, speculative: dict[str, Any] | None, together: bool, **engine: Any) -> tuple[list, LLM]:
    llm = LLM(str(model), show_progress=False, max_model_len=64, speculative_config=speculative, **engine)
    if together:
        outputs = llm.generate([PROMPT] * len(PARAMS), PARAMS, use_tqdm=False)
    else:
        outputs = [llm.generate([PROMPT], params, use_tqdm=False)[0] for params in PARAMS]
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("speculative", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize(
    ("together", "engine"),
    [
        (False, {}),  # one request at a time: every proposal is verified
        (True, {"max_num_batched_tokens": 12}),  # six decoding requests share 12 tokens: proposals trimmed
        (True, {"num_kv_blocks": 20, "block_size": 8}),  # too little KV for all six: preemption too
    ],
)
def test_seeded_output_does_not_depend_on_speculation(
    together: bool, engine: dict[str, Any], speculative: dict[str, Any], small_vocab_model: Callable[[int], Path]
) -> None:
    model = small_vocab_model(0)
    want, _ = _generate(model, None, together=False)
    got, llm = _generate(model, speculative, together, **engine)
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"request {index} ({PARAMS[index]}) differs with {speculative['method']} speculation"
    stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # proposals were verified, some rejected
    if speculative is NGRAM:  # on these random weights n-gram proposals also get accepted (suffix ones may not)
        assert stats.spec_num_accepted_tokens > 0
    if "num_kv_blocks" in engine:
        assert stats.num_preemptions_total > 0
