"""The online-softmax step over one tile of keys read from the paged KV cache.

Shared by the decode and the varlen prefill kernels. A tile is ``BLOCK_N`` consecutive key
positions of one sequence; positions map to cache rows through the block table, so the tile
size is independent of the cache's block size (a tile may span several blocks, or part of
one). Scores are kept in the log2 domain (``scale`` already multiplied by log2(e)), so the
running max ``m`` and the final log-sum-exp are log2 values too.

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
