"""Test data for the kernel tests: paged KV caches with known dense contents, naive float64 math, tolerances.

A paged case stores each sequence's dense keys/values in randomly chosen (non-contiguous)
cache blocks; the second sequence shares its first block with the first (a prefix-cache
hit), block-table padding points at a never-written block, and every cache slot that holds
no token is NaN, so a kernel that reads a slot it should mask out produces NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# (atol, rtol) per dtype. bfloat16 is loosest: besides its 8-bit mantissa, Triton's interpreter
# rounds float32 -> bfloat16 toward zero (GPUs round to nearest), which can add an ulp or two.
KERNEL_TOL = {torch.float32: (2e-5, 2e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}
# Reference (float32 math, rounded to the dtype) against float64: one rounding of the output.
REF_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    keys: list[torch.Tensor]  # dense [seq_len, num_kv_heads, head_dim] per sequence
    values: list[torch.Tensor]


def make_paged_case(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    poison = free.pop()  # never written: padding entries point here
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables: list[list[int]] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for index, (seq_len, num_seq_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        table = [free.pop() for _ in range(num_seq_blocks)]
        shares = index == 1 and seq_lens[0] >= block_size and seq_len >= block_size
        if shares:  # a full first block shared with sequence 0: same physical block, same contents
            table[0] = tables[0][0]
            k[:block_size], v[:block_size] = keys[0][:block_size], values[0][:block_size]
        for pos in range(seq_len):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        keys.append(k)
        values.append(v)
    max_blocks = max(blocks_per_seq) + 1  # one padding entry even for the longest sequence
    padded = [t + [poison] * (max_blocks - len(t)) for t in tables]
    return PagedCase(
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
    )


def naive_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    query_positions: list[int],
    sliding_window: int | None = None,
) -> torch.Tensor:
    """float64, one (query, head) at a time: q ``[nq, Hq, D]``, dense keys/values ``[n, Hkv, D]``."""
    num_q, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    out = torch.zeros(num_q, num_heads, head_dim, dtype=torch.float64)
    for t, pos in enumerate(query_positions):
        first = max(0, pos - sliding_window + 1) if sliding_window else 0
        for h in range(num_heads):
            k = keys[first : pos + 1, h // group].double().cpu()
            v = values[first : pos + 1, h // group].double().cpu()
            scores = (k @ q[t, h].double().cpu()) * scale
            weights = torch.exp(scores - scores.max())
            out[t, h] = (weights[:, None] * v).sum(0) / weights.sum()
    return out
