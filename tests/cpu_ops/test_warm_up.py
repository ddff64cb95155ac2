"""The engine builds what its first request would build before it says it is ready (`ModelRunner.warm_up`).

A compiled CPU op is built (or loaded from the cache) the first time it is asked for, seconds each on a
small machine. Without the warm-up, a new server passed its readiness probe and then made its first
request wait for the fused ops and the one-call decode step to compile (seen on the real node: 10 s).
Here every op the engine's requests resolve must already be resolved when the engine exists, whatever
the weights: float32 (the one-call step), int8 (its GEMV), bfloat16 (no one-call step).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tidepool.engine import LLM, SamplingParams, cpu_ops


@pytest.fixture
def fresh_ops() -> Iterator[None]:
    cpu_ops.reset()  # nothing resolved: the engine's construction resolves what it needs
    yield
    cpu_ops.reset()


@pytest.mark.parametrize(
    "engine_args",
    [{"dtype": "float32"}, {"dtype": "float32", "quantization": "int8"}, {"dtype": "bfloat16"}],
    ids=["float32", "int8", "bfloat16"],
)
def test_no_op_is_resolved_during_the_first_requests(
    tiny_model_dir: Path, engine_args: dict[str, Any], fresh_ops: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, show_progress=False, **engine_args)
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == 64  # the warm-up's blocks were never the KV manager's

    late: list[str] = []
    resolve = cpu_ops._resolve

    def recording(label: str, *args: Any) -> Any:
        late.append(label)
        return resolve(label, *args)

    monkeypatch.setattr(cpu_ops, "_resolve", recording)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 99], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    outs = llm.generate(prompts, params, use_tqdm=False)  # prefills of 3 and 18 tokens, decodes of 2 and 1
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert late == [], f"resolved during requests, not at startup: {late}"
