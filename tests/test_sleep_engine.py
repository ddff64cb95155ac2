"""Sleep mode on the engine itself (engine/sleep.py), through vLLM's offline `LLM.sleep` / `LLM.wake_up` (tiny
model, CPU).

What must hold: the KV cache's pages are really given back (its mappings' resident size drops to 0) and the
prefix cache is emptied; level 2 gives back the weights' pages too (they read as zeros while asleep) and the
wake restores them bit for bit; greedy outputs are identical across both round trips; an engine with
unfinished requests refuses to sleep and carries on; a generate while asleep is refused; several ranks are
refused at once.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tidepool.engine import LLM, SamplingParams, hugepages
from tidepool.engine.sleep import EngineSleeper, check_supported

PROMPTS = [[5, 9, 12, 30, 44, 7, 81, 3, 99, 120, 64, 17, 250, 11, 6, 40, 41, 42], [300, 301, 2, 8, 8, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return LLM(
        str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=256, show_progress=False
    )


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _kv_resident(llm: LLM) -> int:
    return sum(hugepages.mapped_bytes(t, "Rss") for pair in llm.engine.runner.kv_caches for t in pair)


def test_level_one_releases_the_kv_cache_and_keeps_outputs(tiny_llm: LLM) -> None:
    llm = tiny_llm
    before = _tokens(llm)
    engine = llm.engine
    assert _kv_resident(llm) > 0
    assert engine.kv_cache.pool._cached  # the prompts' full blocks are in the prefix map
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    llm.sleep(1)
    assert llm.is_sleeping()
    assert _kv_resident(llm) == 0
    assert not engine.kv_cache.pool._cached
    assert all(torch.equal(p, weights[n]) for n, p in engine.model.named_parameters())  # level 1: weights kept
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)

    llm.wake_up()
    assert not llm.is_sleeping()
    hits = engine.kv_cache.prefix_cache_hits
    assert _tokens(llm) == before  # the cache was empty: computed afresh
    assert _tokens(llm) == before  # and now from the prefix cache filled after the wake
    assert engine.kv_cache.prefix_cache_hits > hits
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


def test_level_two_releases_the_weights_and_reloads_them_exactly(tiny_llm: LLM) -> None:
    llm = tiny_llm
    before = _tokens(llm)
    model = llm.engine.model
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    page_sized = [n for n, p in model.named_parameters() if p.numel() * p.element_size() >= 64 << 10]
    assert page_sized

    llm.sleep(2)
    # The whole pages of every weight were given back: they read as zeros until the wake writes them again.
    for name in page_sized:
        param = dict(model.named_parameters())[name]
        assert int(torch.count_nonzero(param)) < param.numel() // 2, name
    llm.wake_up()
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert _tokens(llm) == before


def test_sleep_refuses_an_engine_with_unfinished_requests(tiny_llm: LLM) -> None:
    llm = tiny_llm
    before = _tokens(llm)
    engine = llm.engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    sleeper = EngineSleeper(engine)
    with pytest.raises(RuntimeError, match="unfinished requests"):
        sleeper.sleep(1)
    assert not sleeper.is_sleeping
    done = None
    while engine.has_unfinished_requests():
        done = next((o for o in engine.step() if o.finished), done)
    assert done is not None and done.outputs[0].token_ids == before[0]
    with pytest.raises(ValueError, match="level"):
        sleeper.sleep(3)


def test_several_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
        check_supported(SimpleNamespace(executor=object()))


def test_level_two_with_quantized_projections(tiny_model_dir: Path) -> None:
    """int8 projections are not a dense parameter the checkpoint rewrites in place: the dense ones (embeddings,
    norms) are reloaded through a fresh model and copied back by name; the quantized ones stay resident."""
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", quantization="int8", num_kv_blocks=32,
              max_model_len=256, show_progress=False)  # fmt: skip
    before = _tokens(llm)
    weights = {n: p.detach().clone() for n, p in llm.engine.model.named_parameters()}
    llm.sleep(2)
    llm.wake_up()
    assert all(torch.equal(p, weights[n]) for n, p in llm.engine.model.named_parameters())
    assert _tokens(llm) == before
