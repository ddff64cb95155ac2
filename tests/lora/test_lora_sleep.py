"""LoRA adapters across sleep mode (engine/sleep.py): adapters registered before a sleep still apply after the wake.

The adapters' device slots and host copies are not released by either level (only the base model's
parameters and the KV cache are), so after each round trip the greedy tokens of a mixed batch (base model and
every adapter) still equal PEFT's on transformers, with no adapter loaded again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_helpers import engine_tokens, expected_tokens, prompts

from tidepool.engine import LLM
from tidepool.engine.lora.types import LoRARequest

NUM_NEW = 6


@pytest.mark.parametrize("level", [1, 2])
def test_adapters_survive_a_round_trip(tiny_model_dir: Path, lora_adapters: dict, level: int) -> None:
    names = [None, *sorted(lora_adapters)]
    batch = prompts(21, [17, 30, 9, 24])
    requests = [None if (n := names[i % len(names)]) is None else LoRARequest(n, str(lora_adapters[n][0]))
                for i in range(len(batch))]  # fmt: skip
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_model_len=256, show_progress=False)  # fmt: skip
    expected = expected_tokens(tiny_model_dir, lora_adapters, batch, requests, NUM_NEW)
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected
    registered = llm.engine.lora.snapshot().names()
    llm.sleep(level)
    llm.wake_up()
    assert llm.engine.lora.snapshot().names() == registered
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected
