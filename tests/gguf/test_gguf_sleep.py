"""Sleep mode level 2 on a GGUF model (engine/sleep.py): the wake rereads (and dequantizes) the file's tensors into
the model's own parameters, bit for bit what the start loaded, so the greedy tokens are unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tidepool.engine import LLM, SamplingParams


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_level_two_round_trip_on_a_gguf_file(gguf_model: Callable[[str, str], Path], type_name: str) -> None:
    llm = LLM(str(gguf_model("llama-gqa", type_name)), device="cpu", num_kv_blocks=32, max_model_len=256,
              show_progress=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 12, 30, 44, 7, 81, 3], [300, 301, 2, 8, 8]]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    weights = {n: p.detach().clone() for n, p in llm.engine.model.named_parameters()}
    llm.sleep(2)
    llm.wake_up()
    assert all(torch.equal(p, weights[n]) for n, p in llm.engine.model.named_parameters())
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == before
