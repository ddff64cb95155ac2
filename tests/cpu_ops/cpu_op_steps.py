"""Random attention steps over a paged KV cache, and a dense float64 reference, for the CPU op tests.

A step is a batch of sequences, each with a context length and a number of new tokens (1 for a
decode, more for a prefill chunk or a chunk after a cached prefix); decodes come first, as the
scheduler orders them. Block ids are shuffled across the whole cache, so block tables are never
contiguous. The K/V of the new tokens are already in the cache, so storing them again (as the
engine's attention does) changes nothing and every path reads the same cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tidepool.engine.layers import attention_backend as backend
from tidepool.engine.layers.attention_metadata import AttentionMetadata, PrefillChunk


@dataclass
class Step:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # this step's keys, [num_tokens, num_kv_heads, head_dim] (already in the cache)
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[list[int]]  # per sequence, in token-layout order
    seqs: list[tuple[int, int]]  # (context_len, num_new), in token-layout order
    window: int | None
    scale: float

    @property
    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int32 block tables (padded), seq_lens, cu_seqlens_q: what the op takes."""
        width = max(len(t) for t in self.tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        lens = torch.tensor([c for c, _ in self.seqs], dtype=torch.int32)
        cu = torch.tensor([0, *torch.tensor([n for _, n in self.seqs]).cumsum(0).tolist()], dtype=torch.int32)
        return tables, lens, cu

    def to(self, dtype: torch.dtype) -> Step:
        cast = {name: getattr(self, name).to(dtype) for name in ("q", "k", "v", "k_cache", "v_cache")}
        return Step(**cast, tables=self.tables, seqs=self.seqs, window=self.window, scale=self.scale)


def random_step(
    seed: int,
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    seqs: list[tuple[int, int]],
    window: int | None = None,
) -> Step:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = sorted(seqs, key=lambda s: s[1] != 1)  # decodes first
    needed = [-(-ctx // block_size) for ctx, _ in seqs]
    ids = list(range(sum(needed) + 3))  # a few blocks nobody owns
    rng.shuffle(ids)
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    shape = (len(ids), block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    index = _slots(tables, seqs, block_size)
    k = k_cache.view(-1, num_kv_heads, head_dim)[index].clone()
    v = v_cache.view(-1, num_kv_heads, head_dim)[index].clone()
    q = torch.randn(len(index), num_kv_heads * group, head_dim, generator=gen)
    return Step(q, k, v, k_cache, v_cache, tables, seqs, window, head_dim**-0.5)


def random_seqs(rng: random.Random, num_seqs: int, max_context: int = 2000) -> list[tuple[int, int]]:
    """Mixed decodes, fresh prefills and chunks after a cached prefix, contexts 1..max_context."""
    seqs = []
    for _ in range(num_seqs):
        ctx = rng.choice([1, 2, 15, 16, 17, rng.randint(1, max_context), max_context])
        kind = rng.random()
        num_new = 1 if kind < 0.5 else ctx if kind < 0.7 else rng.randint(1, min(ctx, 200))
        seqs.append((ctx, num_new))
    return seqs


def dense_reference(step: Step) -> torch.Tensor:
    """float64 attention from the dense K/V of each sequence: end-aligned causal mask, optional window."""
    num_kv_heads, head_dim = step.k_cache.shape[2:]
    group = step.q.shape[1] // num_kv_heads
    out = torch.empty(step.q.shape, dtype=torch.float64)
    row = 0
    for table, (ctx, num_new) in zip(step.tables, step.seqs, strict=True):
        blocks = torch.tensor(table)
        keys = step.k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].double().repeat_interleave(group, 1)
        values = step.v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].double().repeat_interleave(group, 1)
        query_pos = torch.arange(ctx - num_new, ctx)[:, None]
        key_pos = torch.arange(ctx)[None, :]
        visible = key_pos <= query_pos
        if step.window is not None:
            visible &= key_pos > query_pos - step.window
        scores = torch.einsum("thd,khd->htk", step.q[row : row + num_new].double(), keys) * step.scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[row : row + num_new] = torch.einsum("htk,khd->thd", probs, values)
        row += num_new
    return out


def torch_path_metadata(step: Step) -> AttentionMetadata:
    """The metadata the runner builds for the torch path (masks, padded decode tables, prefill chunks)."""
    block_size = step.k_cache.shape[1]
    decodes = [(t, c) for t, (c, n) in zip(step.tables, step.seqs, strict=True) if n == 1]
    chunks, start = [], len(decodes)
    for table, (ctx, num_new) in zip(step.tables[len(decodes) :], step.seqs[len(decodes) :], strict=True):
        mask = backend.build_prefill_mask(ctx - num_new, num_new, ctx, step.window, torch.device("cpu"))
        chunks.append(PrefillChunk(start, num_new, ctx, torch.tensor(table), mask))
        start += num_new
    width = max((len(t) for t, _ in decodes), default=0)
    padded = torch.tensor([t + [0] * (width - len(t)) for t, _ in decodes], dtype=torch.long).view(len(decodes), width)
    lens = [c for _, c in decodes]
    mask = backend.build_decode_mask(lens, width * block_size, step.window, torch.device("cpu")) if decodes else None
    return AttentionMetadata(
        slot_mapping=_slots(step.tables, step.seqs, block_size),
        num_decode_seqs=len(decodes),
        decode_block_tables=padded,
        decode_mask=mask,
        prefills=chunks,
    )


def kernel_view_metadata(step: Step) -> AttentionMetadata:
    """The metadata the runner builds when the compiled op is in use (views, no decode mask or scratch)."""
    meta = torch_path_metadata(step)
    meta.decode_mask = None
    backend.attach_kernel_views(meta, step.tables, [c for c, _ in step.seqs], [n for _, n in step.seqs], step.window)
    return meta


def _slots(tables: list[list[int]], seqs: list[tuple[int, int]], block_size: int) -> torch.Tensor:
    """Flat cache slot of every new token, in token-layout order."""
    slots = []
    for table, (ctx, num_new) in zip(tables, seqs, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - num_new, ctx)]
    return torch.tensor(slots)
