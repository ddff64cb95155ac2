"""Where each rank's KV lives, and which piece of it goes to which rank of the other engine.

A P/D pair may run different tensor/pipeline layouts. A rank of an engine with `tp` x `pp` ranks (global
rank = pp_rank * tp + tp_rank, as in `distributed.parallel_state`) caches a *slab*: the layers of its
pipeline stage (`partition_layers`) and the KV heads of its tensor rank (`distributed.tp`: a split when
tp divides num_kv_heads, else one replicated head per group of tp / num_kv_heads ranks). The prefill
engine's rank pushes, to each decode rank, the intersection of its own slab with that rank's slab — a
*piece* — so every decode rank receives exactly its slab, each (layer, head) once, straight from a
prefill rank that computed it (no gather at a leader).

Which combinations work: any pair in which each engine's own layout is valid for the model
(`check_tp`, pp <= layers): same or different tp (heads regroup: decode tp 1 takes every prefill rank's
heads; decode tp 4 from prefill tp 2 takes half of one rank's heads; replicated heads are sent once per
decode rank that needs them, from the lowest prefill rank that holds them), same or different pp (layer
ranges intersect). What must match is the model's KV geometry: layers, KV heads, head size, block size
and dtype (`check_compatible`).

Invariant (`plan_pieces`): over all prefill ranks, the pieces sent to one decode rank tile its slab
exactly: no (layer, head) missing or sent twice. The receiver checks the same by counting (assembly.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..distributed.parallel_state import partition_layers
from ..distributed.tp import kv_head_range

MAX_RANKS = 4096


@dataclass(slots=True, frozen=True)
class KVLayout:
    """An engine's KV cache geometry and rank layout (the whole model's sizes, not one rank's)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without "torch."
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def layers_of(self, rank: int) -> range:
        return partition_layers(self.num_layers, self.pp)[rank // self.tp]

    def heads_of(self, rank: int) -> range:
        return kv_head_range(self.num_kv_heads, self.tp, rank % self.tp)

    def owner_tp_rank(self, head: int) -> int:
        """The lowest tensor rank caching `head` (the one that sends it when it is replicated)."""
        return next(r for r in range(self.tp) if head in kv_head_range(self.num_kv_heads, self.tp, r))

    def to_json(self) -> dict[str, object]:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "block_size": self.block_size, "dtype": self.dtype, "tp": self.tp, "pp": self.pp}  # fmt: skip

    @classmethod
    def from_json(cls, raw: object) -> KVLayout:
        """A peer's layout; ValueError naming the field when it is not one."""
        if not isinstance(raw, dict):
            raise ValueError("a KV layout must be an object")
        values: dict[str, int] = {}
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp", "pp"):
            value = raw.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 20:
                raise ValueError(f"KV layout field {name} must be a positive integer, got {value!r}")
            values[name] = value
        if values["tp"] * values["pp"] > MAX_RANKS or values["pp"] > values["num_layers"]:
            raise ValueError(f"KV layout tp={values['tp']} x pp={values['pp']} is not a usable rank layout")
        if not isinstance(raw.get("dtype"), str):
            raise ValueError("KV layout field dtype must be a string")
        return cls(dtype=raw["dtype"], **values)


@dataclass(slots=True, frozen=True)
class Piece:
    """The part of a source rank's slab that destination rank `dst_rank` caches: global layer and head ranges."""

    dst_rank: int
    layers: range
    heads: range


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """ValueError naming the first KV geometry field the two engines disagree on."""
    for name, hint in (("num_layers", "the same model"), ("num_kv_heads", "the same model"),
                       ("head_dim", "the same model"), ("block_size", "the same --block-size"),
                       ("dtype", "the same --dtype")):  # fmt: skip
        mine, theirs = getattr(src, name), getattr(dst, name)
        if mine != theirs:
            raise ValueError(
                f"prefill and decode KV layouts differ in {name} ({mine} vs {theirs}): run both pools with {hint}"
            )


def plan_pieces(src: KVLayout, src_rank: int, dst: KVLayout) -> list[Piece]:
    """What source rank `src_rank` sends to each destination rank (ranks it shares nothing with get nothing)."""
    check_compatible(src, dst)
    own_layers, tp_rank = src.layers_of(src_rank), src_rank % src.tp
    pieces = []
    for dst_rank in range(dst.world_size):
        layers = _intersect(own_layers, dst.layers_of(dst_rank))
        # Heads are owned in ascending order of tensor rank, so the heads this rank owns form one run.
        heads = [h for h in dst.heads_of(dst_rank) if src.owner_tp_rank(h) == tp_rank]
        if layers and heads:
            pieces.append(Piece(dst_rank, layers, range(heads[0], heads[-1] + 1)))
    return pieces


def _intersect(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))
