"""Causal flash attention for variable-length query chunks over the paged KV cache.

Shapes: ``q [total_q, num_heads, head_dim]``; sequence ``s`` owns query rows
``cu_seqlens_q[s] .. cu_seqlens_q[s + 1]`` (int32 ``[num_seqs + 1]``, non-decreasing; the first
entry need not be 0, so a caller can pass the prefill part of a step whose first rows are
decodes: rows outside the covered range of ``out`` are left untouched); ``seq_lens`` int32
``[num_seqs]`` counts the keys of each sequence after this step (cached prefix + its new
tokens, which must already be in the cache: see ``store_kv``); ``block_tables`` int32
``[num_seqs, max_blocks]``. Query ``i`` of a chunk of ``n`` tokens sits at absolute position
``seq_len - n + i`` and sees keys ``0 ..`` that position: one kernel serves prefill, chunked
prefill and prefix-cache hits. Optional ``sliding_window``: keys ``> position - window`` only.

Design (FlashAttention-2 forward): a program owns ``BLOCK_M`` query rows of one sequence and
one head, streams keys in ``BLOCK_N`` tiles with an online softmax, and never writes the
score matrix. Tiles fully below the diagonal skip the causal mask; only the diagonal tiles
pay for it. Programs are laid out without knowing the longest chunk on the host: program
``p`` belongs to the sequence ``s`` with ``cu[s] // BLOCK_M + s <= p`` (found by binary
search), which bounds the grid by ``total_q // BLOCK_M + num_seqs`` and needs no device sync.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._checks import (
    check_dim,
    check_int,
    check_out,
    check_paged_attention,
    check_same_device,
    check_sliding_window,
    checked_once,
    dot_precision,
    next_power_of_2,
)
from ._dot import upcast_dot
from ._paged_tile import attend_keys


@triton.jit
def _flash_varlen_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    CU_SEQLENS_Q,
    SEQ_LENS,
    BLOCK_TABLES,
    OUT,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    block_size,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    # Largest seq with cu[seq] // BLOCK_M + seq <= pid; branch-free, fixed step count.
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        mid_start = tl.load(CU_SEQLENS_Q + mid) // BLOCK_M + mid
        go_right = (mid_start <= pid) & (lo + 1 < hi)
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right | (lo + 1 >= hi), hi, mid)
    seq = lo
    q_start = tl.load(CU_SEQLENS_Q + seq)
    num_q = tl.load(CU_SEQLENS_Q + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_M + seq)
    seq_len = tl.load(SEQ_LENS + seq)
    # Tiles past this chunk's end (and programs before the first sequence) do nothing.
    is_live = (tile >= 0) & (tile * BLOCK_M < num_q)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = (rows >= 0) & (rows < num_q)  # all false unless is_live
    query_pos = seq_len - num_q + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    token = (q_start + rows).to(tl.int64)
    q = tl.load(Q + token[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=io_mask, other=0.0)

    first_pos = seq_len - num_q + tile * BLOCK_M
    key_end = tl.minimum(first_pos + BLOCK_M, seq_len)
    key_begin = 0
    if WINDOW > 0:
        key_begin = tl.maximum(first_pos - WINDOW + 1, 0)
    # Keys below full_end are visible to every row of the tile (no causal mask needed).
    full_end = tl.maximum((first_pos + 1) // BLOCK_N * BLOCK_N, key_begin)
    if WINDOW > 0:
        full_end = key_begin  # every tile needs the per-row window mask
    key_end = tl.where(is_live, key_end, 0)
    full_end = tl.where(is_live, full_end, 0)

    block_table_row = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    kv_head_offset = (head // QUERY_GROUP).to(tl.int64) * stride_ch
    _, l_i, acc = attend_keys(
        q,
        query_pos,
        K_CACHE,
        V_CACHE,
        block_table_row,
        kv_head_offset,
        key_begin,
        full_end,
        key_end,
        block_size,
        stride_cb,
        stride_cs,
        scale_log2,
        dims,
        dim_mask,
        BLOCK_N,
        True,
        WINDOW,
        DOT_PRECISION,
        UPCAST,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0 only on masked-out rows
    out_ptrs = OUT + token[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=io_mask)


@checked_once
def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    sliding_window: int | None,
) -> int:
    group = check_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, sliding_window, "[total_q, num_heads, head_dim]"
    )
    check_dim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    check_int("cu_seqlens_q", cu_seqlens_q)
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    if not cu_seqlens_q.shape[0] - 1 == seq_lens.shape[0] == block_tables.shape[0]:
        raise ValueError(
            f"cu_seqlens_q must have num_seqs + 1 entries for seq_lens and block_tables' num_seqs: got "
            f"{cu_seqlens_q.shape[0]}, {seq_lens.shape[0]}, {block_tables.shape[0]}"
        )
    return group


def flash_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (see the module docstring).

    Without ``out``, rows no sequence covers come back as zeros.
    """
    group = _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, sliding_window)
    out = torch.zeros_like(q) if out is None else check_out(out, q)
    total_q, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or total_q == 0:
        return out
    is_wide = q.dtype == torch.float32 or head_dim > 128
    block_m, block_n = (64, 32) if is_wide else (128, 64)
    num_programs = total_q // block_m + num_seqs
    _flash_varlen_kernel[(num_programs, num_heads)](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        out,
        scale * math.log2(math.e),
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_cache.shape[1],
        QUERY_GROUP=group,
        HEAD_DIM=head_dim,
        WINDOW=check_sliding_window(sliding_window),
        SEARCH_STEPS=max(num_seqs.bit_length(), 1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(next_power_of_2(head_dim), 16),
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST=upcast_dot(q.dtype),
        num_warps=4 if is_wide else 8,
        num_stages=2 if is_wide else 3,
    )
    return out


def flash_attention_varlen_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: per sequence, gather its keys and apply the end-aligned causal (and window) mask."""
    group = _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, sliding_window)
    out = torch.zeros_like(q) if out is None else check_out(out, q)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    bounds = cu_seqlens_q.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = bounds[seq], bounds[seq + 1]
        if q_end == q_begin:
            continue
        blocks = block_tables[seq, : -(-seq_len // block_size)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float().repeat_interleave(group, dim=1)
        query_pos = torch.arange(seq_len - (q_end - q_begin), seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if sliding_window:
            visible &= key_pos > query_pos - sliding_window
        scores = torch.einsum("thd,nhd->htn", q[q_begin:q_end].float(), keys) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[q_begin:q_end] = torch.einsum("htn,nhd->thd", probs, values).to(out.dtype)
    return out
