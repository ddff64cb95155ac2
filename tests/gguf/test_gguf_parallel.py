"""Tensor parallelism loads a GGUF file in every rank: greedy tokens equal one process's; kept-quantized is refused."""

from __future__ import annotations

import pytest

from tidepool.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256, show_progress=False)


def test_tensor_parallel_gguf_matches_one_process(gguf_model) -> None:
    file = gguf_model("llama-gqa", "Q8_0")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 99, 3], [200, 201, 7, 7, 7, 42, 11]]
    want = [o.outputs[0].token_ids for o in LLM(str(file), **ENGINE).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(file), tensor_parallel_size=2, **ENGINE)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.engine.close()


def test_kept_quantized_gguf_with_tensor_parallelism_is_refused(gguf_model) -> None:
    with pytest.raises(Exception, match=r"tensor parallelism splits only unquantized layers"):
        LLM(str(gguf_model("llama-gqa", "Q4_1")), tensor_parallel_size=2, quantization="gguf", **ENGINE)
