"""Device slots: the stacked adapter weights every projection site reads, and how a slot is filled.

Role: for each decoder layer, each projection site (qkv, o, gate_up, down) holds
`A [S, J*R, in]` and `B [S, out, R]` (S = max_loras slots, R = max_lora_rank, J sub-targets
fused in the site) in the layout `ops.lora_apply` takes (see lora_contract in engine/lora/__init__.py).
`LoRASlots.load(slot, adapter)` copies one adapter in (absent sub-targets and ranks below R stay
zero); `attach(model)` puts each layer's `SiteSlots` on its attention and MLP modules, where the
model calls `SiteSlots.apply` right after the site's base projection.

Invariants: a slot's rows are all zero unless an adapter was loaded into it since the last
`clear`; `ranks[s]` is the largest rank of slot s's adapter (0 when empty). A site no loaded
adapter targets is skipped (`SiteSlots.active`), so an adapter of q/v only costs nothing at o,
gate_up or down. The layout may describe a tensor-parallel shard (`SiteLayout`, made by
`distributed/lora_tp.py` from the base weights' shard arithmetic): rows of B kept for the
column-parallel sites (qkv, gate_up: each sub-target's own rows, so the sub-offsets are the
shard's), columns of A kept for the row-parallel ones (o, down: the partial delta is added before
the layer's all-reduce, which sums it like the base output).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import ModelConfig
from .ops import lora_apply
from .peft import LoadedAdapter, ModuleWeights, module_shapes

SITE_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""Each projection site of a layer and the PEFT modules fused in it, in output order."""


@dataclass(frozen=True, slots=True)
class SiteLayout:
    """Which part of each sub-target's full weights this process keeps (all of it without tensor parallelism).

    `out_rows[j]`: rows of sub-target j's B (its output features) kept here, in order; `in_cols`: the columns
    of A (input features) kept here (same for every sub-target of the site).
    """

    out_rows: tuple[slice, ...]
    in_cols: slice


def full_layouts(config: ModelConfig) -> dict[str, SiteLayout]:
    """The unsharded layout of every site."""
    shapes = module_shapes(config)
    return {
        site: SiteLayout(tuple(slice(0, shapes[t][1]) for t in targets), slice(0, shapes[targets[0]][0]))
        for site, targets in SITE_TARGETS.items()
    }


@dataclass(slots=True)
class SiteSlots:
    """One layer's one site: its stacked slot weights and the call the model makes after the base projection."""

    a: torch.Tensor  # [S, J*R, in]
    b: torch.Tensor  # [S, out, R], PEFT scaling folded in
    sub_offsets: tuple[int, ...]  # J + 1 output columns: where each sub-target starts; last = out
    ranks: torch.Tensor  # [S, J] int32: each slot's rank per sub-target (0: not targeted), so lora_apply skips it
    layout: SiteLayout
    targets: tuple[str, ...]
    active: bool = False  # some loaded slot targets this site
    _slot_targets: dict[int, bool] = field(default_factory=dict)

    def apply(self, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        """Add each token's adapter delta to `y` in place (`slots[t]` = -1: the base model's row, untouched)."""
        if self.active:
            lora_apply(y, x, self.a, self.b, self.sub_offsets, slots, self.ranks)

    def fill(self, slot: int, modules: Mapping[tuple[int, str], ModuleWeights] | None, layer: int) -> None:
        """Copy an adapter's modules (`LoadedAdapter.modules`) of this layer and site into `slot` (None: clear it)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot].zero_()
        rank_cap = self.b.shape[2]
        used = False
        for j, target in enumerate(self.targets):
            module = None if modules is None else modules.get((layer, target))
            if module is None:
                continue
            rows, r = self.layout.out_rows[j], module.rank
            self.a[slot, j * rank_cap : j * rank_cap + r].copy_(module.a[:, self.layout.in_cols])
            self.b[slot, self.sub_offsets[j] : self.sub_offsets[j + 1], :r].copy_(module.b[rows])
            self.ranks[slot, j] = r
            used = True
        self._slot_targets[slot] = used
        self.active = any(self._slot_targets.values())


class LoRASlots:
    """Every layer's `SiteSlots` for `num_slots` device slots of rank up to `max_rank`."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        layouts: list[dict[str, SiteLayout]] | None = None,
        layer_ids: list[int] | None = None,
    ) -> None:
        """`layouts`: one per layer held here (default: every layer of `config`, unsharded); `layer_ids`: the
        model layer index of each held layer (default 0, 1, ...: a pipeline stage holds a contiguous range)."""
        self.num_slots, self.max_rank = num_slots, max_rank
        # Called after every fill or clear (a parallel engine's driver mirrors it to the other ranks).
        self.on_fill: Callable[[int, Mapping[tuple[int, str], ModuleWeights] | None, int], None] | None = None
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        if layouts is None:
            layouts = [full_layouts(config)] * config.num_hidden_layers
        self.layer_ids = list(range(len(layouts))) if layer_ids is None else list(layer_ids)
        if len(self.layer_ids) != len(layouts):
            raise ValueError(f"{len(layouts)} layer layouts for {len(self.layer_ids)} layer ids")
        self.layers: list[dict[str, SiteSlots]] = []
        for layer_layouts in layouts:
            sites = {}
            for site, layout in layer_layouts.items():
                targets = SITE_TARGETS[site]
                widths = [r.stop - r.start for r in layout.out_rows]
                offsets = tuple(sum(widths[:j]) for j in range(len(widths) + 1))
                num_in = layout.in_cols.stop - layout.in_cols.start
                a = torch.zeros(num_slots, len(targets) * max_rank, num_in, dtype=dtype, device=device)
                b = torch.zeros(num_slots, offsets[-1], max_rank, dtype=dtype, device=device)
                ranks = torch.zeros(num_slots, len(targets), dtype=torch.int32, device=device)
                sites[site] = SiteSlots(a, b, offsets, ranks, layout, targets)
            self.layers.append(sites)

    @property
    def num_bytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for sites in self.layers for s in sites.values())

    def load(self, slot: int, adapter: LoadedAdapter | None) -> None:
        """Fill `slot` with `adapter` (None: clear it)."""
        if adapter is None:
            self.load_modules(slot, None, 0)
        else:
            self.load_modules(slot, adapter.modules, adapter.info.rank)

    def load_modules(self, slot: int, modules: Mapping[tuple[int, str], ModuleWeights] | None, rank: int) -> None:
        """Fill `slot` with an adapter's modules (of at least the layers held here) and rank; None: clear it."""
        for layer, sites in zip(self.layer_ids, self.layers, strict=True):
            for site in sites.values():
                site.fill(slot, modules, layer)
        self.ranks[slot] = rank
        if self.on_fill is not None:
            self.on_fill(slot, modules, rank)

    def attach(self, layers: nn.ModuleList | list[nn.Module]) -> None:
        """Give each decoder layer's attention and MLP modules their sites (`lora_qkv`, `lora_o`, ...)."""
        for layer, sites in zip(layers, self.layers, strict=True):
            layer.self_attn.lora_qkv, layer.self_attn.lora_o = sites["qkv"], sites["o"]
            layer.mlp.lora_gate_up, layer.mlp.lora_down = sites["gate_up"], sites["down"]
