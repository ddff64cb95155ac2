"""The must-be-true test of issue #37 on the tiny model: greedy tokens equal PEFT's on transformers.

Three adapters of different ranks, targets and scalings (conftest.py) and base-model requests run in one
mixed batch through `LLM.generate(..., lora_request=[...])`, with prefix caching on and prompts that share
a prefix across adapters (which must not share KV); then an adapter is unloaded and reloaded under the
same name with other weights, and must give the new weights' tokens. Also: fewer device slots than
adapters (requests wait for a slot, the step goes on), and a host store of one (evicted adapters are
re-read from their folders).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_helpers import (
    SHARED,
    AdapterSpec,
    engine_tokens,
    expected_tokens,
    greedy,
    greedy_params,
    make_adapter,
    mixed_batch,
    prompts,
)

from tidepool.engine import LLM
from tidepool.engine.lora.types import LoRAError, LoRARequest

NUM_NEW = 8


def _llm(model: Path, **kwargs: object) -> LLM:
    args = dict(dtype="float32", enable_lora=True, max_lora_rank=16, show_progress=False, enable_prefix_caching=True)
    return LLM(str(model), **{**args, **kwargs})


@pytest.mark.parametrize("max_loras", [3, 1])
def test_mixed_batch_matches_peft(tiny_model_dir: Path, lora_adapters: dict, max_loras: int) -> None:
    batch, requests = mixed_batch(lora_adapters)
    expected = expected_tokens(tiny_model_dir, lora_adapters, batch, requests, NUM_NEW)
    assert len({tuple(e) for e in expected[:4]}) == 4, "the adapters must change the shared prompt's tokens"
    llm = _llm(tiny_model_dir, max_loras=max_loras)
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected  # again: the prefix cache is warm now
    assert llm.engine.kv_cache.prefix_cache_hits > 0
    assert sorted(llm.engine.lora.names()) == sorted(lora_adapters)


def test_host_store_of_one_rereads_evicted_adapters(tiny_model_dir: Path, lora_adapters: dict) -> None:
    batch, requests = mixed_batch(lora_adapters)
    expected = expected_tokens(tiny_model_dir, lora_adapters, batch, requests, NUM_NEW)
    llm = _llm(tiny_model_dir, max_loras=1, max_cpu_loras=1, enable_prefix_caching=False)
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected


def test_unload_then_reload_with_new_weights(tiny_model_dir: Path, lora_adapters: dict, tmp_path: Path) -> None:
    llm = _llm(tiny_model_dir, max_loras=2)
    prompt = [*SHARED, 5, 6, 7]
    path, model = lora_adapters["qv"]
    assert engine_tokens(llm, [prompt], [LoRARequest("qv", str(path))], NUM_NEW) == [greedy(model, prompt, NUM_NEW)]
    registry = llm.engine.lora
    registry.unregister("qv")
    with pytest.raises(LoRAError) as err:
        llm.engine.add_request("gone", prompt, greedy_params(NUM_NEW), lora_name="qv")
    assert (err.value.status, err.value.code) == (404, "model_not_found")
    new_model = make_adapter(tiny_model_dir, tmp_path / "qv2", AdapterSpec(8, ("q_proj", "v_proj")), seed=99)
    registry.register(registry.read("qv", str(tmp_path / "qv2")))
    new_expected = greedy(new_model, prompt, NUM_NEW)
    assert new_expected != greedy(model, prompt, NUM_NEW)
    # Same name, same prompt: the old load's cached KV must not be reused.
    assert engine_tokens(llm, [prompt], [LoRARequest("qv", str(tmp_path / "qv2"))], NUM_NEW) == [new_expected]


def test_unknown_adapter_is_404_and_lora_off_refuses(tiny_model_dir: Path) -> None:
    llm = _llm(tiny_model_dir)
    with pytest.raises(LoRAError) as err:
        llm.engine.add_request("x", [5, 6], greedy_params(2), lora_name="nope")
    assert (err.value.status, err.value.code) == (404, "model_not_found")
    plain = LLM(str(tiny_model_dir), dtype="float32", show_progress=False)
    assert plain.engine.lora is None
    with pytest.raises(LoRAError) as err:
        plain.engine.add_request("x", [5, 6], greedy_params(2), lora_name="nope")
    assert err.value.status == 404


def test_steps_without_adapter_tokens_run_the_base_path(tiny_model_dir: Path, lora_adapters: dict) -> None:
    """With LoRA enabled, a step without adapter tokens calls the model exactly as without LoRA (no slots)."""
    llm = _llm(tiny_model_dir, max_loras=2)
    seen: list[object] = []
    llm.engine.model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs.get("lora_slots")),
                                               with_kwargs=True)  # fmt: skip
    batch = prompts(2, [5, 9])
    engine_tokens(llm, batch, [None, None], NUM_NEW)
    assert seen and all(slots is None for slots in seen)
    seen.clear()
    path = str(lora_adapters["qv"][0])
    engine_tokens(llm, batch, [None, LoRARequest("qv", path)], NUM_NEW)
    assert all(slots is not None and slots.tolist().count(-1) >= 1 for slots in seen)  # base rows are -1
