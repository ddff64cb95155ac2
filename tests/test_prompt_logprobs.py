"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' log_softmax over the same weights.

Each prompt position p >= 1 must carry log_softmax(HF logits at p - 1)[prompt[p]] and the same
top-k token set, the first position None, for: a short prompt with `max_tokens=0` (prefill only),
a prompt prefilled in many chunks, a second request sharing a cached prefix with the first, a
request that arrives while others decode, and requests preempted and recomputed mid-prefill.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.outputs import RequestOutput

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4  # float32 weights: the paged path and transformers agree to rounding


def _prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def _hf_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(output: RequestOutput, prompt: list[int], reference: torch.Tensor, num_top: int) -> None:
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for position in range(1, len(prompt)):
        entry = entries[position]
        assert entry is not None
        row = reference[position - 1]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOLERANCE), f"position {position}"
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = set(row.topk(num_top).indices.tolist()) if num_top else set()
        assert set(entry) == top | {token}, f"position {position}"
        for token_id in top:
            assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=TOLERANCE)


def test_short_prompt_prefill_only(hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir("llama-gqa")
    prompt = _prompt(1, 12)
    llm = LLM(str(path), show_progress=False)
    [output] = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)
    assert output.finished and output.outputs[0].token_ids == []
    assert output.outputs[0].finish_reason == "length"
    _check(output, prompt, _hf_logprobs(path, prompt), 3)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.pool.num_blocks


def test_chunked_prefill_accumulates_positions(hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir("qwen2-tied")
    prompt = _prompt(2, 150)
    llm = LLM(str(path), show_progress=False, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2
    _check(output, prompt, _hf_logprobs(path, prompt), 0)


def test_cached_prefix_is_recomputed(hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir("llama-gqa")
    shared = _prompt(3, 40)
    first, second = shared + _prompt(4, 5), shared + _prompt(5, 9)
    llm = LLM(str(path), show_progress=False, block_size=16, enable_prefix_caching=True)
    llm.generate([first], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)  # caches the prefix
    hits = llm.engine.kv_cache.prefix_cache_hits
    [output] = llm.generate([second], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    assert output.num_cached_tokens == 0  # documented: no prefix-cache hits for prompt logprobs
    assert llm.engine.kv_cache.prefix_cache_hits == hits
    _check(output, second, _hf_logprobs(path, second), 2)
    [plain] = llm.generate([second], SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.num_cached_tokens >= 32 and plain.prompt_logprobs is None  # the cache still serves others


def test_mixed_batch_with_decodes(hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir("llama-gqa")
    llm = LLM(str(path), show_progress=False, max_num_batched_tokens=20)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"decode-{i}", _prompt(10 + i, 8), SamplingParams(temperature=0.0, max_tokens=30,
                                                                            ignore_eos=True))  # fmt: skip
    for _ in range(3):
        engine.step()
    prompt = _prompt(6, 50)
    engine.add_request("scored", prompt, SamplingParams(temperature=0.8, max_tokens=0, prompt_logprobs=4, seed=1))
    done: dict[str, RequestOutput] = {}
    mixed = False
    while engine.has_unfinished_requests():
        scheduled = len(engine.scheduler.running)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        mixed = mixed or ("scored" not in done and scheduled > 1)
    assert mixed
    assert all(len(done[f"decode-{i}"].outputs[0].token_ids) == 30 for i in range(3))
    _check(done["scored"], prompt, _hf_logprobs(path, prompt), 4)


def test_preemption_neither_duplicates_nor_loses(hf_model_dir: Callable[[str], Path]) -> None:
    path = hf_model_dir("llama-gqa")
    prompts = [_prompt(20 + i, n) for i, n in enumerate([90, 100, 110, 70, 120])]
    llm = LLM(str(path), show_progress=False, block_size=16, num_kv_blocks=20, max_model_len=300,
              max_num_batched_tokens=32)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        _check(output, prompt, _hf_logprobs(path, prompt), 1)
