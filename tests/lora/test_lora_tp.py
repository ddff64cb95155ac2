"""Multi-LoRA with tensor (and pipeline) parallelism: adapter weights sharded exactly like the base weights.

- In one process (fast): for 2- and 4-way TP of the tiny model (4 heads, 2 kv heads: a kv split at tp=2,
  one replicated kv head per rank at tp=4), each rank's LoRA slots applied to the identity give exactly
  the rank's shard of the merged weight W + B·A·scaling, where the merged weight is cut by the same
  `tp.shard_layer` that cuts the base weights (q/k/v heads, gate/up slices, o/down input columns).
- With worker processes (slow; gloo on CPU): a 2-way TP engine, a 2-stage PP engine and TP x PP = 2 x 2 serve a mixed
  batch of three adapters (different ranks and targets) and the base model with fewer device slots than
  adapters (so slots are refilled mid-run and every refill must reach every rank), with prefix caching on,
  and give PEFT's greedy tokens on transformers; then the same after an adapter is unloaded and another
  one is registered under its name.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lora_helpers import SHARED, AdapterSpec, engine_tokens, expected_tokens, greedy, make_adapter, mixed_batch

from tidepool.engine import LLM
from tidepool.engine.config import ModelConfig
from tidepool.engine.distributed.lora_tp import shard_layouts
from tidepool.engine.distributed.tp import shard_layer
from tidepool.engine.loading.loader import load_model
from tidepool.engine.lora.peft import LoadedAdapter, load_adapter
from tidepool.engine.lora.slots import SITE_TARGETS, LoRASlots
from tidepool.engine.lora.types import LoRARequest

NUM_NEW = 8
# Each site: the module holding it and its fused weight's attribute.
SITES = {
    "qkv": ("self_attn", "qkv_weight"),
    "o": ("self_attn", "o_weight"),
    "gate_up": ("mlp", "gate_up_weight"),
    "down": ("mlp", "down_weight"),
}


def _merged(layer: torch.nn.Module, adapter: LoadedAdapter, index: int) -> torch.nn.Module:
    """A copy of the decoder layer with the adapter's deltas merged into its fused weights (full, unsharded)."""
    merged = copy.deepcopy(layer)
    for site, (parent, attr) in SITES.items():
        weight = getattr(getattr(merged, parent), attr).data
        start = 0
        for target in SITE_TARGETS[site]:
            module = adapter.modules.get((index, target))
            width = module.b.shape[0] if module is not None else _width(merged, target)
            if module is not None:
                weight[start : start + width] += module.b @ module.a
            start += width
        assert start == weight.shape[0]
    return merged


def _width(layer: torch.nn.Module, target: str) -> int:
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "q_proj": attn.q_size,
        "k_proj": attn.kv_size,
        "v_proj": attn.kv_size,
        "o_proj": attn.o_weight.shape[0],
    }.get(target, mlp.intermediate_size if target in ("gate_proj", "up_proj") else mlp.down_weight.shape[0])


def _site_delta(slots: LoRASlots, layer: int, site: str) -> torch.Tensor:
    """The rank's delta weight of one site, [local out, local in], read through `lora_apply` on the identity."""
    sites = slots.layers[layer][site]
    num_in, num_out = sites.a.shape[2], sites.b.shape[1]
    y = torch.zeros(num_in, num_out)
    sites.apply(y, torch.eye(num_in), torch.zeros(num_in, dtype=torch.int32))
    return y.T


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[torch.nn.Module, ModelConfig]:
    return load_model(tiny_model_dir, dtype=torch.float32, device="cpu", show_progress=False)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["qv", "all", "mlp"])
def test_each_rank_holds_its_shard_of_the_merged_weights(
    tiny: tuple[torch.nn.Module, ModelConfig], lora_adapters: dict, name: str, tp: int
) -> None:
    model, config = tiny
    adapter = load_adapter(name, str(lora_adapters[name][0]), config, max_rank=16, dtype=torch.float32)
    for tp_rank in range(tp):
        layouts = shard_layouts(config, tp, tp_rank)
        slots = LoRASlots(config, 2, 16, torch.float32, torch.device("cpu"), [layouts] * config.num_hidden_layers)
        slots.load(0, adapter)
        for index, layer in enumerate(model.layers):
            base, merged = copy.deepcopy(layer), _merged(layer, adapter, index)
            shard_layer(base, tp, tp_rank, None)
            shard_layer(merged, tp, tp_rank, None)
            for site, (parent, attr) in SITES.items():
                local_base = getattr(getattr(base, parent), attr)
                local_merged = getattr(getattr(merged, parent), attr)
                delta = _site_delta(slots, index, site)
                assert delta.shape == local_base.shape, (site, tp_rank)
                torch.testing.assert_close(local_base + delta, local_merged, rtol=1e-5, atol=1e-5)
    assert any(m.b.abs().sum() > 0 for m in adapter.modules.values())


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_parallel_mixed_batch_matches_peft_and_survives_reload(
    tiny_model_dir: Path, lora_adapters: dict, tmp_path: Path, tp: int, pp: int
) -> None:
    batch, requests = mixed_batch(lora_adapters)
    expected = expected_tokens(tiny_model_dir, lora_adapters, batch, requests, NUM_NEW)
    assert len({tuple(e) for e in expected[:4]}) == 4, "the adapters must change the shared prompt's tokens"
    llm = LLM(
        str(tiny_model_dir), dtype="float32", device="cpu", show_progress=False, enable_lora=True, max_lora_rank=16,
        max_loras=2, enable_prefix_caching=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        max_num_batched_tokens=64, num_kv_blocks=96, max_model_len=256,
    )  # fmt: skip
    try:
        assert engine_tokens(llm, batch, requests, NUM_NEW) == expected
        assert engine_tokens(llm, batch, requests, NUM_NEW) == expected  # the prefix cache is warm now
        assert llm.engine.kv_cache.prefix_cache_hits > 0

        registry = llm.engine.lora
        registry.unregister("qv")
        new_path = tmp_path / "qv2"
        new_model = make_adapter(tiny_model_dir, new_path, AdapterSpec(8, ("q_proj", "v_proj")), seed=99)
        registry.register(registry.read("qv", str(new_path)))
        prompt = [*SHARED, 5, 6, 7]
        old = greedy(lora_adapters["qv"][1], prompt, NUM_NEW)
        new = greedy(new_model, prompt, NUM_NEW)
        assert new != old
        reqs = [LoRARequest("qv", str(new_path)), LoRARequest("mlp", str(lora_adapters["mlp"][0])), None]
        want = [new, greedy(lora_adapters["mlp"][1], prompt, NUM_NEW), expected_tokens(
            tiny_model_dir, lora_adapters, [prompt], [None], NUM_NEW)[0]]  # fmt: skip
        assert engine_tokens(llm, [prompt] * 3, reqs, NUM_NEW) == want
    finally:
        llm.engine.close()
