"""One receiving rank's side of a transfer: pieces from prefill ranks assembled into this rank's slab.

`SlabStore` is thread-safe (receiver threads add, the rank's command loop or engine thread pops). A
transfer's slab buffer is allocated on its first valid piece, sized by the rank's own slab and the
piece's checked block count; a coverage mask over (layer, head) refuses a piece that overlaps one
already stored or disagrees on the block count, and the slab is complete when the mask is full (the
sender's plan tiles the slab exactly: layout.plan_pieces). Invariants: the blocks held by incomplete
and unclaimed slabs never exceed `max_pending_blocks` (a flood of transfer ids cannot exhaust memory);
a complete slab is handed out once (`pop`) or dropped (`drop`, `expire`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .protocol import FrameLimits, KVTransferError, PieceHeader


@dataclass(slots=True)
class _Slab:
    kv: torch.Tensor  # [layers, 2, num_blocks, block_size, heads, head_dim] of this rank's slab
    covered: torch.Tensor  # bool [layers, heads]
    arrived: float = field(default_factory=time.monotonic)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def is_complete(self) -> bool:
        return bool(self.covered.all())


class SlabStore:
    def __init__(self, limits: FrameLimits, max_pending_blocks: int, on_complete: Callable[[str], None]) -> None:
        self.limits = limits
        self.max_pending_blocks = max_pending_blocks
        self._on_complete = on_complete
        self._slabs: dict[str, _Slab] = {}
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._slabs)

    def add(self, piece: PieceHeader, kv: torch.Tensor) -> None:
        """Store one checked piece; KVTransferError when it does not fit the transfer's slab so far."""
        limits = self.limits
        layers, heads = len(limits.layers), len(limits.heads)
        with self._lock:
            slab = self._slabs.get(piece.transfer_id)
            if slab is None:
                held = sum(s.num_blocks for s in self._slabs.values())
                if held + piece.num_blocks > self.max_pending_blocks:
                    raise KVTransferError(
                        f"transfer {piece.transfer_id}: {held} blocks of unclaimed transfers are already held "
                        f"here (limit {self.max_pending_blocks}); decode requests are not claiming their KV"
                    )
                shape = [layers, 2, piece.num_blocks, limits.block_size, heads, limits.head_dim]
                covered = torch.zeros(layers, heads, dtype=torch.bool)
                slab = self._slabs[piece.transfer_id] = _Slab(torch.empty(shape, dtype=limits.dtype), covered)
            if piece.num_blocks != slab.num_blocks:
                raise KVTransferError(
                    f"transfer {piece.transfer_id}: a piece of {piece.num_blocks} blocks for a slab of "
                    f"{slab.num_blocks}"
                )
            rows = slice(piece.layers.start - limits.layers.start, piece.layers.stop - limits.layers.start)
            cols = slice(piece.heads.start - limits.heads.start, piece.heads.stop - limits.heads.start)
            if slab.covered[rows, cols].any() or slab.is_complete:
                raise KVTransferError(f"transfer {piece.transfer_id}: layers {piece.layers} x heads {piece.heads} "
                                      "arrived twice")  # fmt: skip
            slab.kv[rows, :, :, :, cols] = kv
            slab.covered[rows, cols] = True
            complete = slab.is_complete
        if complete:
            self._on_complete(piece.transfer_id)

    def pop(self, transfer_id: str) -> torch.Tensor | None:
        """The complete slab of `transfer_id`, forgotten here; None when it is missing or incomplete."""
        with self._lock:
            slab = self._slabs.get(transfer_id)
            if slab is None or not slab.is_complete:
                return None
            del self._slabs[transfer_id]
            return slab.kv

    def drop(self, transfer_id: str) -> bool:
        with self._lock:
            return self._slabs.pop(transfer_id, None) is not None

    def expire(self, ttl_s: float) -> list[str]:
        """Drop slabs older than `ttl_s`; their transfer ids."""
        cutoff = time.monotonic() - ttl_s
        with self._lock:
            old = [t for t, slab in self._slabs.items() if slab.arrived < cutoff]
            for transfer_id in old:
                del self._slabs[transfer_id]
        return old
