"""Decode attention over the paged KV cache: one query token per sequence.

Shapes: ``q [num_seqs, num_heads, head_dim]``; ``k_cache``/``v_cache [num_blocks, block_size,
num_kv_heads, head_dim]``; ``block_tables`` int32 ``[num_seqs, max_blocks]`` (entries past a
sequence's last block are never read); ``seq_lens`` int32 ``[num_seqs]`` (keys per sequence,
the new token included, at least 1) -> ``[num_seqs, num_heads, head_dim]``.

Design (memory-bound, so: read each K/V row once). A program owns one (sequence, KV head)
and all the query heads that share that KV head (GQA/MQA: the group is padded to the
tensor-core minimum of 16 rows), so a K/V tile read from HBM serves the whole group. Keys
stream through in tiles of ``BLOCK_N`` positions with an online softmax.

Split-K (flash-decoding): when sequences x KV heads cannot fill the GPU (small batches, long
contexts), the key range is cut into ``num_splits`` partitions processed by separate
programs, each writing its partial max, sum and unnormalised output in float32; a second
small kernel merges them. The split count is decided from shapes only (the block table's
width bounds the context), so launching never waits on the device.

Optional ``sliding_window`` (HF semantics): the query at position ``p`` sees keys ``> p - window``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._checks import (
    cdiv,
    check_out,
    check_paged_attention,
    check_sliding_window,
    checked_once,
    dot_precision,
    next_power_of_2,
    num_sms,
)
from ._dot import upcast_dot
from ._paged_tile import attend_keys
from .flash_attention_varlen import flash_attention_varlen_ref

MIN_PARTITION = 256  # keys per split below which splitting costs more than it gains
MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    BLOCK_TABLES,
    SEQ_LENS,
    OUT,
    M_PART,
    L_PART,
    ACC_PART,
    scale_log2,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    block_size,
    partition_size,
    num_heads,
    num_splits,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + seq)
    key_begin = split * partition_size
    if WINDOW > 0:
        key_begin = tl.maximum(key_begin, seq_len - WINDOW)
    key_end = tl.minimum(split * partition_size + partition_size, seq_len)

    group = tl.arange(0, BLOCK_H)
    heads = kv_head * QUERY_GROUP + group
    head_mask = group < QUERY_GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(Q + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)

    block_table_row = BLOCK_TABLES + seq * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_ch
    m_i, l_i, acc = attend_keys(
        q,
        heads,
        K_CACHE,
        V_CACHE,
        block_table_row,
        kv_head_offset,
        key_begin,
        key_end,
        key_end,
        block_size,
        stride_cb,
        stride_cs,
        scale_log2,
        dims,
        dim_mask,
        BLOCK_N,
        False,
        0,
        DOT_PRECISION,
        UPCAST,
    )

    if IS_SPLIT:
        # Empty partitions (past the end of a shorter sequence) store m=-inf, l=0: weight 0 in the merge.
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(M_PART + part, m_i, mask=head_mask)
        tl.store(L_PART + part, l_i, mask=head_mask)
        tl.store(ACC_PART + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)
    else:
        out = acc / l_i[:, None]
        out_ptrs = OUT + seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_splits_kernel(
    M_PART,
    L_PART,
    ACC_PART,
    OUT,
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < num_splits
    part = (seq * num_heads + head) * num_splits + splits
    m = tl.load(M_PART + part, mask=split_mask, other=float("-inf"))
    sums = tl.load(L_PART + part, mask=split_mask, other=0.0)
    weight = tl.math.exp2(m - tl.max(m, axis=0))  # log2 domain, like the partial maxima
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    acc = tl.load(
        ACC_PART + part[:, None] * HEAD_DIM + dims[None, :], mask=split_mask[:, None] & dim_mask[None, :], other=0.0
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(sums * weight, axis=0)
    tl.store(OUT + seq * stride_os + head * stride_oh + dims, out.to(OUT.dtype.element_ty), mask=dim_mask)


@checked_once
def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    num_splits: int | None,
) -> int:
    group = check_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, sliding_window, "[num_seqs, num_heads, head_dim]"
    )
    if not q.shape[0] == block_tables.shape[0] == seq_lens.shape[0]:
        raise ValueError(
            f"q, block_tables and seq_lens disagree on num_seqs: {q.shape[0]}, {block_tables.shape[0]}, "
            f"{seq_lens.shape[0]}"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None (automatic), got {num_splits}")
    return group


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split the keys only when (sequences x KV heads) programs leave the GPU under-occupied."""
    num_programs = num_seqs * num_kv_heads
    target = 2 * num_sms(device)
    if num_programs >= target or max_context <= MIN_PARTITION:
        return 1
    return max(1, min(cdiv(target, num_programs), cdiv(max_context, MIN_PARTITION), MAX_SPLITS))


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's single query over its cached keys (see the module docstring).

    ``num_splits`` forces the split-K partition count (None: chosen from the shapes); ``out``
    is an optional preallocated result.
    """
    group = _check(q, k_cache, v_cache, block_tables, seq_lens, sliding_window, num_splits)
    out = check_out(out, q)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    num_splits, partition_size, block_n = _partitions(q, num_kv_heads, block_tables.shape[1] * block_size, num_splits)
    is_split = num_splits > 1
    m_part, l_part, acc_part = _split_parts(q, num_splits) if is_split else (out, out, out)  # unused unsplit
    block_d = max(next_power_of_2(head_dim), 16)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        m_part,
        l_part,
        acc_part,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        block_size,
        partition_size,
        num_heads,
        num_splits,
        QUERY_GROUP=group,
        HEAD_DIM=head_dim,
        WINDOW=check_sliding_window(sliding_window),
        BLOCK_H=max(next_power_of_2(group), 16),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        IS_SPLIT=is_split,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST=upcast_dot(q.dtype),
        num_warps=4,
    )
    if is_split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            m_part,
            l_part,
            acc_part,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_SPLITS=max(next_power_of_2(num_splits), 2),
            num_warps=4,
        )
    return out


def _partitions(q: torch.Tensor, num_kv_heads: int, table_keys: int, num_splits: int | None) -> tuple[int, int, int]:
    """``(num_splits, partition_size, block_n)``: the key range cut into partitions of whole key tiles.

    The block table's width (``table_keys`` keys) bounds every context; ``num_splits`` None: chosen
    from the shapes. The count may come out lower than asked (no empty trailing partitions).
    """
    max_context = max(table_keys, 1)
    if num_splits is None:
        num_splits = choose_num_splits(q.shape[0], num_kv_heads, max_context, q.device)
    block_n = 32 if q.dtype == torch.float32 or q.shape[2] > 128 else 64
    partition_size = cdiv(cdiv(max_context, num_splits), block_n) * block_n
    return min(num_splits, cdiv(max_context, partition_size)), partition_size, block_n


def _split_parts(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 partial max, sum and unnormalised output of every (sequence, head, split)."""
    num_seqs, num_heads, head_dim = q.shape
    m_part = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    acc_part = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    return m_part, torch.empty_like(m_part), acc_part


def paged_attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: the varlen reference with one query per sequence (splits are moot)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, sliding_window, num_splits)
    cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return flash_attention_varlen_ref(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, sliding_window=sliding_window, out=out
    )
