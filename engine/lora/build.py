"""Building the engine's LoRA parts from its config: device slots on the model, the registry (`build_lora`).

Invariants: only with `enable_lora`; the slots are attached to the model's own layers (the runner
then passes each step's per-token slots), so a model without adapters is untouched. With tensor or
pipeline parallelism the executor makes the slots (each rank its stage's layers and its shard:
`distributed/lora_tp.py`) and `build_lora` is handed rank 0's, whose fills reach every rank.
"""

from __future__ import annotations

import functools

import torch

from ..config import ModelConfig
from ..engine_config import EngineConfig
from .peft import load_adapter
from .registry import LoRARegistry
from .slots import LoRASlots


def build_lora(
    config: EngineConfig,
    model: torch.nn.Module,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    slots: LoRASlots | None = None,
) -> LoRARegistry | None:
    """The registry with `max_loras` slots attached to `model`'s layers; None unless `enable_lora`.

    `slots`: already made and attached (a parallel engine's rank 0 shard, `MultiprocExecutor.lora_slots`)."""
    if not config.enable_lora:
        return None
    if slots is None:
        slots = LoRASlots(model_config, config.max_loras, config.max_lora_rank, dtype, device)
        slots.attach(model.layers)
    loader = functools.partial(load_adapter, model_config=model_config, max_rank=config.max_lora_rank, dtype=dtype)
    return LoRARegistry(slots, loader, config.max_cpu_loras)
