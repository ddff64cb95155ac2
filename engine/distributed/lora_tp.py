"""Multi-LoRA on a tensor/pipeline-parallel engine: each rank's shard of the adapter slots, kept in step.

Role (issue #37, "adapter weights sharded like the base weights"):
- `shard_layouts`: which part of every adapter module a TP rank keeps, cut with the base weights' own
  arithmetic (`tp.TPShard`, one source of truth). Column-parallel sites (qkv, gate_up): the rows of each
  sub-target's B in the rank's output shard (q: its q heads; k and v: its kv heads, a split or the one
  replicated head; gate and up: its intermediate slice), and all of A; so a rank's sub-offsets are its own
  shard's. Row-parallel sites (o, down): the columns of A in the rank's input shard, and all of B; the
  rank's partial delta B (A_shard x_shard) is added to its partial output before the layer's all-reduce
  (`tp.shard_layer`'s forward hook), and the sum over ranks is the full delta (the map is linear).
- `attach_rank_slots`: every rank (driver and workers alike) builds `LoRASlots` for its stage's layers
  with its shard layouts and attaches them to those layers; the model code is untouched.
- `mirror_fills` (on the driver's slots, the registry's only handle on the device): a fill or clear of
  slot s runs on the driver's shard and goes to every other rank as one `LORA_SLOT` frame per pipeline stage
  (the modules of that stage's layers), on the same ordered control channel as FORWARD, so every rank's
  slot s holds the same adapter before any step reads it. The per-token `lora_slots` travel on FORWARD.

Why the tensors travel rather than the adapter's path: the ranks then run exactly the weights the driver
validated and registered. A re-read on each rank could see a folder changed, half-written or absent on
another node (adapters are fetched per pod) and would fail the whole group mid-serving, where the driver's
registry already turns a failed re-read into that adapter's error alone. The cost is one frame per slot
fill of the adapter's unsharded modules for the receiving stage (MBs; fills happen only when an adapter
enters a slot, not per step); each receiving rank keeps its own shard of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tidepool.contract.wire import MessageType

from ..config import ModelConfig
from ..engine_config import EngineConfig
from ..lora.peft import ModuleWeights
from ..lora.slots import SITE_TARGETS, LoRASlots, SiteLayout, full_layouts
from .parallel_state import RankInfo, partition_layers
from .pp import StageModel
from .tp import TPShard

Broadcast = Callable[..., None]
"""`MultiprocExecutor.command(kind, ranks=None, **fields)`: a send that fails as `WorkerFailedError`."""


def shard_layouts(config: ModelConfig, tp: int, tp_rank: int) -> dict[str, SiteLayout]:
    """Each site's layout on TP rank `tp_rank` of `tp` (the unsharded layouts when tp == 1)."""
    full = full_layouts(config)
    if tp == 1:
        return full
    shard = TPShard.for_model(config, tp, tp_rank)
    rows = {"q_proj": shard.q, "k_proj": shard.kv, "v_proj": shard.kv, "gate_proj": shard.inter, "up_proj": shard.inter}
    return {
        "qkv": SiteLayout(tuple(rows[t] for t in SITE_TARGETS["qkv"]), full["qkv"].in_cols),
        "o": SiteLayout(full["o"].out_rows, shard.q),
        "gate_up": SiteLayout(tuple(rows[t] for t in SITE_TARGETS["gate_up"]), full["gate_up"].in_cols),
        "down": SiteLayout(full["down"].out_rows, shard.inter),
    }


def rank_slots(
    config: EngineConfig, model_config: ModelConfig, info: RankInfo, dtype: torch.dtype, device: torch.device
) -> LoRASlots:
    """The slots of rank `info.rank`: its stage's layers, its tensor-parallel shard of every site."""
    layers = partition_layers(model_config.num_hidden_layers, info.pp_size)[info.pp_rank]
    layout = shard_layouts(model_config, info.tp_size, info.tp_rank)
    return LoRASlots(
        model_config, config.max_loras, config.max_lora_rank, dtype, device, [layout] * len(layers), list(layers)
    )


def attach_rank_slots(
    config: EngineConfig, model_config: ModelConfig, stage: StageModel, dtype: torch.dtype, device: torch.device
) -> LoRASlots | None:
    """This rank's slots attached to its stage's layers; None unless `enable_lora`."""
    if not config.enable_lora:
        return None
    slots = rank_slots(config, model_config, stage.info, dtype, device)
    slots.attach(stage.layers)
    return slots


def mirror_fills(slots: LoRASlots, model_config: ModelConfig, info: RankInfo, broadcast: Broadcast) -> None:
    """Make every fill or clear of the driver's `slots` (the registry's) reach the other ranks too."""
    stages = partition_layers(model_config.num_hidden_layers, info.pp_size)

    def mirror(slot: int, modules: Mapping[tuple[int, str], ModuleWeights] | None, rank: int) -> None:
        for pp_rank, layers in enumerate(stages):
            ranks = [r for r in info.stage_ranks(pp_rank) if r != info.rank]
            if ranks:
                broadcast(MessageType.LORA_SLOT, ranks=ranks, **slot_fields(slot, modules, rank, layers))

    slots.on_fill = mirror


def slot_fields(
    slot: int, modules: Mapping[tuple[int, str], ModuleWeights] | None, rank: int, layers: range
) -> dict[str, Any]:
    """A LORA_SLOT message's fields: the modules of `layers` (none: clear the slot)."""
    kept = sorted((key, m) for key, m in (modules or {}).items() if key[0] in layers)
    return dict(
        slot=slot,
        rank=rank if modules is not None else 0,
        layers=[layer for (layer, _), _ in kept],
        targets=[target for (_, target), _ in kept],
        a=[m.a for _, m in kept],
        b=[m.b for _, m in kept],
        scalings=[float(m.scaling) for _, m in kept],
    )


def apply_slot_message(slots: LoRASlots, fields: Mapping[str, Any]) -> None:
    """A worker's side of LORA_SLOT: fill (or, with no modules and rank 0, clear) its shard of the slot."""
    parts = (fields["layers"], fields["targets"], fields["a"], fields["b"], fields["scalings"])
    modules = {(layer, t): ModuleWeights(a, b, scaling) for layer, t, a, b, scaling in zip(*parts, strict=True)}
    rank = fields["rank"]
    slots.load_modules(fields["slot"], modules if rank else None, rank)
