"""CUDA-graph capture and replay of decode-only steps, one graph per batch-size bucket.

Role: take the host off the decode path. A decode step of a small model on a large GPU is a
few hundred tiny kernels whose launch cost (Python, dispatch, argument checks) exceeds their
run time; a CUDA graph replays all of them with one call. Graphs need fixed shapes and fixed
addresses, so:

- Buckets: a step with ``n`` decode sequences runs the graph of the smallest captured size
  ``>= n`` (`capture_sizes`: 1, 2, 4, then every 8, up to ``max_num_seqs`` or 256, the largest
  always included). Larger steps, prefills and mixed steps run eagerly.
- Static inputs: every tensor the captured forward reads lives in one device arena
  (`StaticInputs`), laid out per bucket: input ids, positions, slots, sequence lengths, query
  offsets and a block table ``[bucket, max_blocks_per_seq]``. A step packs its values plus the
  padding into a pinned host twin and fills the arena with one non-blocking copy.
- Padding rows (``n .. bucket-1``) decode token 0 at position 0 into a sink block that the KV
  cache manager never hands out (block ``num_blocks``: the runner allocates one extra), with
  sequence length 1, so they neither touch a real sequence's KV nor read uninitialised memory.
  Their outputs are computed and ignored: `DecodeGraphs.run` returns the first ``n`` rows.
- On by default on CUDA for an in-process model (`graphs_wanted`); TIDEPOOL_CUDA_GRAPHS=0 turns
  them off.
- Capture is lazy (the first step that needs a bucket captures it), largest buckets share one
  memory pool. The output of a capture is a fixed tensor that each replay overwrites.

The mechanics are behind `GraphBackend` so the CPU tests cover all of the bookkeeping (bucket
choice, padding, static buffers, replay) with `EagerReplayBackend`, which "captures" by running
the function and "replays" by running it again from the static buffers into the captured output.

Invariant: the captured function reads its inputs only from the arena views it was given, so a
replay computes exactly what an eager call on the same (padded) inputs would.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256
CUDA_GRAPHS_ENV = "TIDEPOOL_CUDA_GRAPHS"


def graphs_wanted(model: object, device: torch.device) -> bool:
    """CUDA graphs by default on CUDA for an in-process model; TIDEPOOL_CUDA_GRAPHS=0 turns them off."""
    raw = os.environ.get(CUDA_GRAPHS_ENV, "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{CUDA_GRAPHS_ENV}={raw!r}: expected 1/0 (on/off)")
    if raw in ("0", "false", "off"):
        logger.info("CUDA graphs off (%s=%s): every step runs eagerly", CUDA_GRAPHS_ENV, raw)
        return False
    return device.type == "cuda" and isinstance(model, torch.nn.Module)


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, multiples of 8, and the limit itself."""
    limit = max(1, min(max_num_seqs, max_size))
    sizes = {s for s in (1, 2, 4, *range(8, limit + 1, 8)) if s <= limit}
    sizes.add(limit)
    return sorted(sizes)


def choose_bucket(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows; None when the step is too large (or empty)."""
    if num_seqs < 1:
        return None
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass(slots=True)
class DecodeBatch:
    """A decode-only step as host lists, one entry per sequence (the runner's view of the step)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True, frozen=True)
class GraphInputs:
    """Views into the arena for one bucket: what the captured forward reads."""

    num_seqs: int  # the bucket size (padding rows included)
    input_ids: torch.Tensor  # int32 [bucket]
    positions: torch.Tensor  # int32 [bucket]
    slot_mapping: torch.Tensor  # int32 [bucket]
    seq_lens: torch.Tensor  # int32 [bucket]
    cu_seqlens_q: torch.Tensor  # int32 [bucket + 1] = 0, 1, ..., bucket
    block_tables: torch.Tensor  # int32 [bucket, max_blocks_per_seq]


class StaticInputs:
    """One int32 device arena plus a pinned host twin; per-bucket layouts; one copy per step."""

    def __init__(self, max_bucket: int, max_blocks: int, pad_slot: int, pad_block: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self.pad_slot = pad_slot
        self.pad_block = pad_block
        size = self._size(max_bucket)
        self.device_arena = torch.zeros(size, dtype=torch.int32, device=device)
        self.host_arena = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        # The previous step's copy must have left the host twin before it is rewritten.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def _size(self, bucket: int) -> int:
        return 5 * bucket + 1 + bucket * self.max_blocks

    def views(self, bucket: int) -> GraphInputs:
        return self._views(self.device_arena, bucket)

    def _views(self, arena: torch.Tensor, b: int) -> GraphInputs:
        table = arena[5 * b + 1 : self._size(b)].view(b, self.max_blocks)
        return GraphInputs(b, arena[0:b], arena[b : 2 * b], arena[2 * b : 3 * b], arena[3 * b : 4 * b],
                           arena[4 * b : 5 * b + 1], table)  # fmt: skip

    def fill(self, batch: DecodeBatch, bucket: int) -> None:
        """Pack the step (and its padding rows) into the host twin, then one non-blocking copy to the device."""
        n = batch.num_seqs
        if not 1 <= n <= bucket:
            raise ValueError(f"a decode batch of {n} sequences does not fit bucket {bucket}")
        pad = bucket - n
        if self._copied is not None:
            self._copied.synchronize()
        host = self._views(self.host_arena, bucket)
        host.input_ids.copy_(torch.tensor(batch.input_ids + [0] * pad, dtype=torch.int32))
        host.positions.copy_(torch.tensor(batch.positions + [0] * pad, dtype=torch.int32))
        host.slot_mapping.copy_(torch.tensor(batch.slots + [self.pad_slot] * pad, dtype=torch.int32))
        host.seq_lens.copy_(torch.tensor(batch.seq_lens + [1] * pad, dtype=torch.int32))
        host.cu_seqlens_q.copy_(torch.arange(bucket + 1, dtype=torch.int32))
        rows = [t + [self.pad_block] * (self.max_blocks - len(t)) for t in batch.block_tables]
        rows += [[self.pad_block] * self.max_blocks] * pad
        host.block_tables.copy_(torch.tensor(rows, dtype=torch.int32).view(bucket, self.max_blocks))
        used = self._size(bucket)
        self.device_arena[:used].copy_(self.host_arena[:used], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record `fn`; returns (replay, output) where each replay rewrites `output` in place."""
        ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture: warm-up on a side stream (Triton JIT, cuBLAS workspaces), then record."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: tuple[int, int] | None = None  # shared by every bucket's graph

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out


class EagerReplayBackend:
    """CPU stand-in: capture runs `fn` once; replay runs it again and writes into the captured output."""

    def __init__(self) -> None:
        self.num_captures = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self.num_captures += 1
        out = fn()

        def replay() -> None:
            out.copy_(fn())

        return replay, out


@dataclass(slots=True)
class GraphStats:
    num_replays: dict[int, int] = field(default_factory=dict)  # bucket -> replays
    num_padding_rows: int = 0


class DecodeGraphs:
    """Captured decode forwards by bucket, over one static input arena."""

    def __init__(
        self,
        forward: Callable[[GraphInputs], torch.Tensor],
        sizes: list[int],
        max_blocks: int,
        pad_block: int,
        block_size: int,
        device: torch.device,
        backend: GraphBackend,
    ) -> None:
        if not sizes:
            raise ValueError("at least one capture size is needed")
        self.forward = forward
        self.sizes = sorted(sizes)
        self.backend = backend
        self.static = StaticInputs(self.sizes[-1], max_blocks, pad_block * block_size, pad_block, device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.stats = GraphStats()

    def bucket_for(self, num_seqs: int) -> int | None:
        return choose_bucket(num_seqs, self.sizes)

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """The forward's output rows for the batch's sequences (a view into the bucket's fixed output)."""
        bucket = self.bucket_for(batch.num_seqs)
        if bucket is None:
            raise ValueError(f"no captured size holds {batch.num_seqs} sequences (largest {self.sizes[-1]})")
        self.static.fill(batch, bucket)
        entry = self.graphs.get(bucket)
        if entry is None:
            inputs = self.static.views(bucket)
            entry = self.backend.capture(lambda: self.forward(inputs))
            self.graphs[bucket] = entry
            logger.info("captured the decode graph for batch size %d (%d captured)", bucket, len(self.graphs))
        replay, out = entry
        replay()
        self.stats.num_replays[bucket] = self.stats.num_replays.get(bucket, 0) + 1
        self.stats.num_padding_rows += bucket - batch.num_seqs
        return out[: batch.num_seqs]
