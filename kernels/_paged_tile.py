"""The online softmax over keys read from the paged KV cache, shared by the decode and varlen kernels.

``attend_keys`` is the whole key loop of a program (both kernels call it once): it folds the keys
of one sequence and one KV head into a running ``(max, sum, output)`` for a block of query rows,
one ``attend_tile`` at a time. A tile is ``BLOCK_N`` consecutive key positions of one sequence;
positions map to cache rows through the block table, so the tile size is independent of the
cache's block size (a tile may span several blocks, or part of one). Scores are kept in the log2
domain (``scale`` already multiplied by log2(e)), so the running max ``m`` and the final
log-sum-exp are log2 values too.

A query row may see no key of a tile (causal or sliding-window masking, or the padding rows of
the last query tile): its running max stays -inf, and the max is replaced by 0 before
subtracting so such rows add exactly nothing instead of NaN (``-inf - -inf``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import mma


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    K_CACHE,
    V_CACHE,
    block_table_row,
    kv_head_offset,
    start,
    key_begin,
    key_end,
    query_pos,
    block_size,
    stride_cb,
    stride_cs,
    scale_log2,
    dims,
    dim_mask,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold keys ``start .. start + BLOCK_N`` (limited to ``[key_begin, key_end)``) into ``(m_i, l_i, acc)``.

    ``query_pos`` holds each query row's absolute position (used when ``IS_CAUSAL`` or ``WINDOW``):
    a row sees key ``n`` iff ``n <= pos`` (causal) and ``n > pos - WINDOW`` (sliding window).
    """
    keys = start + tl.arange(0, BLOCK_N)
    key_mask = (keys >= key_begin) & (keys < key_end)
    block_ids = tl.load(block_table_row + keys // block_size, mask=key_mask, other=0).to(tl.int64)
    rows = block_ids * stride_cb + (keys % block_size).to(tl.int64) * stride_cs + kv_head_offset
    tile_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(K_CACHE + rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
    scores = mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), DOT_PRECISION, UPCAST)
    scores = scores * scale_log2
    visible = key_mask[None, :]
    if IS_CAUSAL:
        visible = visible & (keys[None, :] <= query_pos[:, None])
    if WINDOW > 0:
        visible = visible & (keys[None, :] > query_pos[:, None] - WINDOW)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(V_CACHE + rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def attend_keys(
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
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``(m, l, acc)`` of q's rows over keys ``[key_begin, key_end)``, starting from an empty state.

    Tiles in ``[key_begin, full_end)`` are visible whole to every row and skip the per-row mask.
    With ``CAUSAL``, the tiles of ``[full_end, key_end)`` follow, each row seeing the keys up to its
    ``query_pos`` (and inside ``WINDOW``); without it ``full_end`` must equal ``key_end``.
    """
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    acc = tl.zeros([q.shape[0], q.shape[1]], dtype=tl.float32)
    for start in range(key_begin, full_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q,
            m_i,
            l_i,
            acc,
            K_CACHE,
            V_CACHE,
            block_table_row,
            kv_head_offset,
            start,
            key_begin,
            full_end,
            query_pos,
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
    if CAUSAL:
        for start in range(full_end, key_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q,
                m_i,
                l_i,
                acc,
                K_CACHE,
                V_CACHE,
                block_table_row,
                kv_head_offset,
                start,
                key_begin,
                key_end,
                query_pos,
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
    return m_i, l_i, acc
