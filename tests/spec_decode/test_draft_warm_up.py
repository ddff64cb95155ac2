"""A speculative draft model is warmed up with the engine, as the target is (`ModelRunner.warm_up`).

The draft has a runner of its own; its first prefill and decode would otherwise happen inside the
first user's request (on GPU: Triton compiling the draft's kernels; on CPU: the draft's one-call decode
step being prepared). After construction the draft's decode step is ready, its KV manager still has
every block free, the log says which model each warm-up was for, and a greedy request gives the same
tokens as the engine without speculation.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tidepool.engine import LLM, SamplingParams, cpu_ops


def test_the_draft_is_warmed_up_before_the_engine_is_ready(
    tiny_model_dir: Path, tiny_draft_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tidepool.engine.model_runner")
    common = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, show_progress=False)
    spec = {"method": "draft", "draft_model": str(tiny_draft_dir), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **common)
    draft = llm.engine.speculator.draft
    assert draft is not None
    warm_ups = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up")]
    assert [m.split(":")[0] for m in warm_ups] == ["warm-up (target model)", "warm-up (draft model)"]
    if cpu_ops.decoder_op() is not None:  # the one-call CPU decode step: prepared by the warm-up's decode
        assert draft.runner.model._decoder_state is not None
    draft_blocks = draft.runner.kv_caches[0][0].shape[0]  # the draft sizes its own cache
    assert draft.kv.num_free_blocks == draft_blocks  # the warm-up's blocks were never the draft KV manager's

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 99, 5, 17, 99], [8, 9, 10, 11, 12]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = LLM(str(tiny_model_dir), **common)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
