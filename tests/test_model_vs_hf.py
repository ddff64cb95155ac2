"""Model correctness: Tidepool's batched, paged, continuous-batching engine against transformers.

For each architecture variant (GQA, MQA, tied/untied, llama3 and linear rope scaling, odd
head_dim, Mistral's sliding window, Qwen2's qkv bias), greedy tokens of prompts generated
together must equal transformers generating each prompt alone, also with prefix caching on
shared prefixes, with a KV cache small enough to force preemption, and with a token budget
small enough to force chunked prefill. Prompt logits must be close in every dtype.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model_variants import HF_VARIANTS
from tidepool.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 12


def _prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        generated: list[int] = []
        for _ in range(num_new):
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def _hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def _greedy(num_tokens: int = NUM_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)


LENGTHS = [1, 2, 15, 16, 17, 63, 130, 300]


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_batched_greedy_matches_transformers(variant: str, hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir(variant)
    prompts = _prompts(1, LENGTHS)
    llm = LLM(str(path), show_progress=False, max_num_seqs=16)
    outputs = llm.generate(prompts, _greedy(), use_tqdm=False)
    hf = _hf_model(path)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == _hf_greedy(hf, prompt, NUM_NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        assert output.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-window", "qwen2-tied"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_prompt_logits_close(
    variant: str, dtype: torch.dtype, tolerance: float, hf_model_dir: Callable[[str], Path]
) -> None:
    path = hf_model_dir(variant)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    llm = LLM(str(path), dtype=name, show_progress=False, num_kv_blocks=64)
    prompt = _prompts(2, [200])[0]
    ours = llm.engine.runner.prompt_logits(prompt)
    with torch.no_grad():
        theirs = _hf_model(path, dtype)(torch.tensor([prompt])).logits[0].float()
    scale = theirs.abs().max().item()
    error = (ours - theirs).abs().max().item()
    assert error <= tolerance * max(scale, 1.0), f"{name}: max error {error:.3g} vs logits scale {scale:.3g}"


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-window"])
def test_prefix_caching_shared_prefixes(variant: str, hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir(variant)
    shared = _prompts(3, [37])[0]  # crosses two block boundaries with block_size 16
    suffixes = _prompts(4, [1, 5, 16, 29, 40, 3, 11, 60])
    prompts = [shared + s for s in suffixes] + [shared[:16], [*shared[:32], 7]]
    llm = LLM(str(path), show_progress=False, block_size=16)
    first = llm.generate(prompts, _greedy(), use_tqdm=False)
    second = llm.generate(prompts, _greedy(), use_tqdm=False)  # everything cached now
    kv = llm.engine.kv_cache
    assert kv.prefix_cache_hits > 0
    assert any(out.num_cached_tokens >= 32 for out in second)
    hf = _hf_model(path)
    for prompt, a, b in zip(prompts, first, second, strict=True):
        expected = _hf_greedy(hf, prompt, NUM_NEW_TOKENS)
        assert a.outputs[0].token_ids == expected
        assert b.outputs[0].token_ids == expected
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_preemption_keeps_outputs_identical(hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir("llama-gqa")
    prompts = _prompts(5, [90, 100, 110, 70, 120, 80, 60, 95])
    llm = LLM(str(path), show_progress=False, block_size=16, num_kv_blocks=20, max_model_len=300)
    outputs = llm.generate(prompts, _greedy(40), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    hf = _hf_model(path)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == _hf_greedy(hf, prompt, 40)
    assert llm.engine.kv_cache.num_free_blocks == 20


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill_tiny_budget(prefix_caching: bool, hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir("qwen2-tied")
    prompts = _prompts(6, [1, 9, 33, 150, 64, 5, 17, 250])
    llm = LLM(str(path), show_progress=False, max_num_batched_tokens=7, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(prompts, _greedy(), use_tqdm=False)
    hf = _hf_model(path)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == _hf_greedy(hf, prompt, NUM_NEW_TOKENS)
