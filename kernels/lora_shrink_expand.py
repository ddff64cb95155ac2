"""Multi-LoRA shrink/expand kernels (Punica/S-LoRA style): ``y[t] += B[s] (A[s] x[t])``, ``s = slots[t]``.

The layout is the contract's (see ``kernels.lora_ref``, which holds the checks and the torch
reference): ``A [S, J*R, in]``, ``B [S, out, R]``, ``sub_offsets`` (J+1 output columns, J <= 3),
``slots [T]`` int32 (-1: no delta), ``ranks [S]`` or ``[S, J]``; ``y [T, out]`` may have a row stride > out.

Two passes through a float32 ``h [T, J*R]``: the shrink ``h = x @ A[s].T`` per sub-target, then
the expand ``y[:, cols of j] += h[:, j*R:(j+1)*R] @ B[s, cols of j].T``. Each comes in two forms:

- per-token gather (BGMV, decode): one program per (token, sub-target[, column block]); each reads
  its token's slot and the slot's A rows / B block. Adapters shared by several tokens are read once
  per token (from L2 after the first), which at decode sizes is cheaper than grouping.
- segmented (SGMV, prefill): tokens are ordered by slot on the device (a stable argsort plus counts,
  no host sync) and each program takes a tile of up to BLOCK_T tokens of one slot, so A and B are
  read once per tile and the products run on tensor cores (``tl.dot``).

Rows of rank at or beyond the slot's (sub-target's) rank are masked (never loaded). Nothing reads tensor values on
the host, so the launch can be captured in a CUDA graph. ``lora_apply`` picks the form by T
(``SEGMENTED_MIN_TOKENS``; untuned: no GPU was available when this was written) unless told.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ._checks import checked_once, dot_precision, next_power_of_2
from ._dot import mma, upcast_dot
from .lora_ref import check_lora_apply

MAX_SUB_TARGETS = 3  # qkv; the interior sub-target offsets are passed as two scalars
SEGMENTED_MIN_TOKENS = 64  # from this many tokens the segmented form runs (prefill-sized steps)
BLOCK_T = 16  # tokens per segmented tile (tl.dot's minimum)


@triton.jit
def _sub_range(j, off1, off2, out, NUM_SUB: tl.constexpr):
    """Output columns ``[start, stop)`` of sub-target ``j``."""
    start = tl.where(j == 0, 0, tl.where(j == 1, off1, off2))
    if NUM_SUB == 1:
        stop = out
    elif NUM_SUB == 2:
        stop = tl.where(j == 0, off1, out)
    else:
        stop = tl.where(j == 0, off1, tl.where(j == 1, off2, out))
    return start, stop


@triton.jit
def _bgmv_shrink_kernel(
    X, A, H, SLOTS, RANKS, width_in, rank_max, stride_xt, stride_as, stride_ar, stride_ht, stride_rs, stride_rj,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        rank = tl.minimum(tl.load(RANKS + slot * stride_rs + j * stride_rj), rank_max)
        rs = tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        a_rows = A + slot * stride_as + (j * rank_max + rs)[:, None] * stride_ar
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        k_end = tl.where(rank > 0, width_in, 0)  # a sub-target the adapter leaves out: nothing to read
        for k0 in range(0, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < width_in
            x = tl.load(X + t * stride_xt + ks, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + ks[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(H + t * stride_ht + j * rank_max + rs, acc, mask=rs < rank_max)


@triton.jit
def _bgmv_expand_kernel(
    H, B, Y, SLOTS, RANKS, off1, off2, out, rank_max, stride_ht, stride_bs, stride_bo, stride_yt, stride_rs,
    stride_rj, NUM_SUB: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    start, stop = _sub_range(j, off1, off2, out, NUM_SUB)
    cols = start + tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    if (slot >= 0) & (start + tl.program_id(2) * BLOCK_N < stop):
        rank = tl.minimum(tl.load(RANKS + slot * stride_rs + j * stride_rj), rank_max)
        rs = tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        c_mask = cols < stop
        h = tl.load(H + t * stride_ht + j * rank_max + rs, mask=r_mask, other=0.0)
        b_ptrs = B + slot * stride_bs + cols[:, None] * stride_bo + rs[None, :]
        b = tl.load(b_ptrs, mask=c_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        y_ptrs = Y + t * stride_yt + cols
        y = tl.load(y_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(Y.dtype.element_ty), mask=c_mask)


@triton.jit
def _segment(SEG_START, SEG_LEN, ORDER, RANK_PTR, slot, tile, rank_max, BLOCK_T: tl.constexpr):
    """The token ids of ``tile`` of ``slot``'s segment, their mask, and the rank at ``RANK_PTR``."""
    seg_len = tl.load(SEG_LEN + slot)
    offs = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs < seg_len
    toks = tl.load(ORDER + tl.load(SEG_START + slot) + offs, mask=t_mask, other=0).to(tl.int64)
    rank = tl.minimum(tl.load(RANK_PTR), rank_max)
    return toks, t_mask, rank


@triton.jit
def _sgmv_shrink_kernel(
    X, A, H, SEG_START, SEG_LEN, ORDER, RANKS, width_in, rank_max, num_tiles,
    stride_xt, stride_as, stride_ar, stride_ht, stride_rs, stride_rj,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    slot = (tl.program_id(0) // num_tiles).to(tl.int64)
    tile = tl.program_id(0) % num_tiles
    j = tl.program_id(1)
    if tile * BLOCK_T < tl.load(SEG_LEN + slot):
        rank_ptr = RANKS + slot * stride_rs + j * stride_rj
        toks, t_mask, rank = _segment(SEG_START, SEG_LEN, ORDER, rank_ptr, slot, tile, rank_max, BLOCK_T)
        rs = tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        a_cols = A + slot * stride_as + (j * rank_max + rs)[None, :] * stride_ar
        acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, width_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < width_in
            x = tl.load(X + toks[:, None] * stride_xt + ks[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_cols + ks[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc = mma(x, a, acc, DOT_PRECISION, UPCAST)
        h_ptrs = H + toks[:, None] * stride_ht + j * rank_max + rs[None, :]
        tl.store(h_ptrs, acc, mask=t_mask[:, None] & (rs < rank_max)[None, :])


@triton.jit
def _sgmv_expand_kernel(
    H, B, Y, SEG_START, SEG_LEN, ORDER, RANKS, off1, off2, out, rank_max, num_tiles,
    stride_ht, stride_bs, stride_bo, stride_yt, stride_rs, stride_rj,
    NUM_SUB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    slot = (tl.program_id(0) // num_tiles).to(tl.int64)
    tile = tl.program_id(0) % num_tiles
    j = tl.program_id(1)
    start, stop = _sub_range(j, off1, off2, out, NUM_SUB)
    col0 = start + tl.program_id(2) * BLOCK_N
    if (tile * BLOCK_T < tl.load(SEG_LEN + slot)) & (col0 < stop):
        rank_ptr = RANKS + slot * stride_rs + j * stride_rj
        toks, t_mask, rank = _segment(SEG_START, SEG_LEN, ORDER, rank_ptr, slot, tile, rank_max, BLOCK_T)
        rs = tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        cols = col0 + tl.arange(0, BLOCK_N)
        c_mask = cols < stop
        h_ptrs = H + toks[:, None] * stride_ht + j * rank_max + rs[None, :]
        h = tl.load(h_ptrs, mask=t_mask[:, None] & r_mask[None, :], other=0.0)
        b_ptrs = B + slot * stride_bs + cols[None, :] * stride_bo + rs[:, None]
        b = tl.load(b_ptrs, mask=r_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.dot(h, b, input_precision=DOT_PRECISION)
        y_ptrs = Y + toks[:, None] * stride_yt + cols[None, :]
        y_mask = t_mask[:, None] & c_mask[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(Y.dtype.element_ty), mask=y_mask)


@checked_once
def _check(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sub_offsets: tuple[int, ...],
    slots: torch.Tensor,
    ranks: torch.Tensor,
) -> tuple[int, int]:
    num_sub, rank = check_lora_apply(y, x, a, b, sub_offsets, slots, ranks)
    if num_sub > MAX_SUB_TARGETS:
        raise ValueError(f"at most {MAX_SUB_TARGETS} sub-targets per site, got sub_offsets {sub_offsets}")
    return num_sub, rank


def _segments(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids ordered by slot, and each slot's start/length in that order (all on the device)."""
    order = torch.argsort(slots, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device)
    counts.index_add_(0, (slots + 1).long(), torch.ones_like(slots))  # counts[0]: base-model rows
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    return order, ends[:num_slots], counts[1:]


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sub_offsets: tuple[int, ...],
    slots: torch.Tensor,
    ranks: torch.Tensor,
    *,
    segmented: bool | None = None,
) -> None:
    """``y += delta`` in place (see the module docstring); ``segmented`` forces a form (None: by T)."""
    num_sub, rank = _check(y, x, a, b, sub_offsets, slots, ranks)
    num_tokens, width_in = x.shape
    num_slots, out = b.shape[0], b.shape[1]
    if num_tokens == 0 or out == 0 or rank == 0:
        return
    if segmented is None:
        segmented = num_tokens >= SEGMENTED_MIN_TOKENS
    off1, off2 = [*sub_offsets[1:-1], out, out][:2]
    stride_rs, stride_rj = ranks.stride(0), (ranks.stride(1) if ranks.dim() == 2 else 0)
    h = torch.empty(num_tokens, num_sub * rank, dtype=torch.float32, device=x.device)
    block_r = max(16, next_power_of_2(rank))
    block_n = 64 if block_r <= 32 else 32
    widest = max(q - p for p, q in itertools.pairwise(sub_offsets))
    col_blocks = triton.cdiv(widest, block_n)
    if not segmented:
        block_k = max(16, min(256, 4096 // block_r))
        _bgmv_shrink_kernel[(num_tokens, num_sub)](
            x, a, h, slots, ranks, width_in, rank, x.stride(0), a.stride(0), a.stride(1), h.stride(0), stride_rs,
            stride_rj, BLOCK_R=block_r, BLOCK_K=block_k,
        )  # fmt: skip
        _bgmv_expand_kernel[(num_tokens, num_sub, col_blocks)](
            h, b, y, slots, ranks, off1, off2, out, rank, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
            stride_rs, stride_rj, NUM_SUB=num_sub, BLOCK_R=block_r, BLOCK_N=block_n,
        )  # fmt: skip
        return
    order, seg_start, seg_len = _segments(slots, num_slots)
    num_tiles = triton.cdiv(num_tokens, BLOCK_T)
    precision = dot_precision(x.dtype)
    _sgmv_shrink_kernel[(num_slots * num_tiles, num_sub)](
        x, a, h, seg_start, seg_len, order, ranks, width_in, rank, num_tiles,
        x.stride(0), a.stride(0), a.stride(1), h.stride(0), stride_rs, stride_rj,
        BLOCK_T=BLOCK_T, BLOCK_R=block_r, BLOCK_K=64, DOT_PRECISION=precision, UPCAST=upcast_dot(x.dtype),
    )  # fmt: skip
    _sgmv_expand_kernel[(num_slots * num_tiles, num_sub, col_blocks)](
        h, b, y, seg_start, seg_len, order, ranks, off1, off2, out, rank, num_tiles,
        h.stride(0), b.stride(0), b.stride(1), y.stride(0), stride_rs, stride_rj,
        NUM_SUB=num_sub, BLOCK_T=BLOCK_T, BLOCK_R=block_r, BLOCK_N=block_n, DOT_PRECISION="ieee",
    )  # fmt: skip
