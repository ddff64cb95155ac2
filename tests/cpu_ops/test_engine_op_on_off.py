"""Engine level: greedy output is identical with the compiled CPU attention op and with the torch path.

Every model variant of the model-vs-transformers tests (GQA, MQA, head_dim 24, sliding window, qkv
bias, tied embeddings), run through continuous batching with a small token budget (so prompts are
prefilled in chunks after a cached part of themselves), shared prefixes (prefix-cache hits: chunks
whose prefix is in blocks another sequence wrote), and a second pass that finds everything cached.
Prompt logits agree closely in float32, bfloat16 and float16.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from model_variants import HF_VARIANTS
from tidepool.engine import LLM, SamplingParams, cpu_ops

pytestmark = [pytest.mark.usefixtures("vector_width"), pytest.mark.slow]


@pytest.fixture
def use_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    def switch(mode: str) -> None:
        monkeypatch.setenv(cpu_ops.MODE_ENV, mode)
        cpu_ops.reset()

    yield switch
    cpu_ops.reset()


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(37)]  # crosses two block boundaries
    alone = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 2, 16, 17, 63, 130, 300)]
    return alone + [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 29, 60)] + [shared[:32]]


def _generate(path: Path, mode: str, use_path: Callable[[str], None], **kwargs: object) -> tuple[list, LLM]:
    use_path(mode)
    llm = LLM(str(path), show_progress=False, max_num_seqs=6, max_num_batched_tokens=48, **kwargs)
    assert llm.engine.runner.backend.name == f"cpu-{mode}"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(1)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return [first, second], llm


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_greedy_identical_with_op_on_and_off(
    variant: str, hf_model_dir: Callable[[str], Path], use_path: Callable[[str], None]
) -> None:
    path = hf_model_dir(variant)
    reference, _ = _generate(path, "torch", use_path)
    got, llm = _generate(path, "compiled", use_path)
    assert llm.engine.kv_cache.prefix_cache_hits > 0
    assert got == reference


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 3e-2), ("float16", 5e-3)])
def test_prompt_logits_close_with_op_on_and_off(
    dtype: str, tolerance: float, hf_model_dir: Callable[[str], Path], use_path: Callable[[str], None]
) -> None:
    path = hf_model_dir("mistral-window")
    prompt = random.Random(2).choices(range(3, 512), k=200)
    logits = {}
    for mode in ("torch", "compiled"):
        use_path(mode)
        llm = LLM(str(path), dtype=dtype, show_progress=False, num_kv_blocks=64)
        logits[mode] = llm.engine.runner.prompt_logits(prompt).float()
    scale = logits["torch"].abs().max().item()
    error = (logits["compiled"] - logits["torch"]).abs().max().item()
    assert error <= tolerance * max(scale, 1.0), f"max error {error:.3g} vs logits scale {scale:.3g}"
    if dtype == "float32":
        assert torch.equal(logits["compiled"].argmax(-1), logits["torch"].argmax(-1))
