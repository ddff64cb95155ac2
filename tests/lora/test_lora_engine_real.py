"""The must-be-true test on the real model: SmolLM2-135M-Instruct with three PEFT adapters made here.

Greedy tokens of a mixed batch (three adapters of different ranks, targets and scalings, and the base
model, on chat prompts that share their template's prefix) equal PEFT's on transformers' dequantized
float32 model of the same GGUF file, with prefix caching on, before and after an unload and reload.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_helpers import AdapterSpec, engine_tokens, expected_tokens, make_adapter

from conftest import SPECS
from tidepool.engine import LLM
from tidepool.engine.lora.types import LoRARequest

pytestmark = pytest.mark.slow

NUM_NEW = 12
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
STD = 0.06  # lora_A and lora_B entries: large enough that every adapter changes the answers


def test_smollm2_mixed_batch_matches_peft(smollm_gguf: Path, tmp_path: Path) -> None:
    specs = {name: AdapterSpec(**{**vars(spec), "std": STD}) for name, spec in SPECS.items()}
    adapters = {
        name: (tmp_path / name, make_adapter(smollm_gguf, tmp_path / name, spec, seed))
        for seed, (name, spec) in enumerate(specs.items(), start=1)
    }
    llm = LLM(str(smollm_gguf), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_model_len=512, num_kv_blocks=256, enable_prefix_caching=True, show_progress=False)  # fmt: skip
    tokenizer = llm.get_tokenizer()
    chats = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    names: list[str | None] = [None, *adapters]
    batch = [chat for chat in chats for _ in names]
    requests = [None if n is None else LoRARequest(n, str(adapters[n][0])) for _ in chats for n in names]
    expected = expected_tokens(smollm_gguf, adapters, batch, requests, NUM_NEW)
    base = [t for t, r in zip(expected, requests, strict=True) if r is None]
    for name in adapters:  # each adapter must change some answer, or the test would prove nothing
        assert [t for t, r in zip(expected, requests, strict=True) if r and r.lora_name == name] != base, name
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected
    llm.engine.lora.unregister("mlp")
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected  # re-registered from its path on first use
    assert llm.engine.kv_cache.prefix_cache_hits > 0
