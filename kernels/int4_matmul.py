"""Matmul with group-wise asymmetric int4 weights in Tidepool's packing (``int4_packing``).

``int4_matmul(x, qweight, scales, zeros, group_size)``: ``x [M, K]`` (float16/bfloat16/float32),
``qweight`` int32 ``[K // 8, N]`` (eight nibbles along K per int32, lowest first), ``scales``
and ``zeros`` ``[K // group_size, N]`` -> ``y = x @ W`` ``[M, N]`` in x's dtype, with
``W[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]``; or, with
``zeros=None, mins=...`` (llama.cpp Q4_1's form), ``W[k, n] = q[k, n] * scales[g, n] + mins[g, n]``.

Each K tile unpacks its nibbles in registers (row ``k`` reads int32 row ``k // 8`` and shifts
by ``4 * (k % 8)``; the eight rows sharing an int32 hit the same cache line), dequantizes in
float32, rounds to x's dtype and feeds the tensor cores. When the tile's K range lies inside
one quantization group (``group_size`` a multiple of ``BLOCK_K``) a single row of scales and
zeros serves the whole tile. Weight bytes are a quarter of bf16's (plus the scales), which is
what decode, a weight-streaming workload, pays for; small batches split K across programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_matmul_input, checked_once, dot_precision
from ._dot import mma, upcast_dot
from ._split_k import load_x_tile, plan_split_k, split_k_tile, store_y_tile
from .int4_packing import check_int4_shapes, dequantize_int4, offset_args


@triton.jit
def _int4_matmul_kernel(
    X,
    QWEIGHT,
    SCALES,
    ZEROS,
    Y,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_ys,
    stride_ym,
    stride_yn,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_IN_GROUP: tl.constexpr,
    OFFSET_IS_MIN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows, cols, row_mask, col_mask, k_begin, k_end = split_k_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        w_mask = k_mask[:, None] & col_mask[None, :]
        x = load_x_tile(X, rows, ks, row_mask, k_mask, stride_xm, stride_xk)
        packed = tl.load(QWEIGHT + (ks // 8)[:, None] * stride_qk + cols[None, :] * stride_qn, mask=w_mask, other=0)
        q = ((packed >> ((ks % 8) * 4)[:, None]) & 0xF).to(tl.float32)
        if TILE_IN_GROUP:
            group = k0 // group_size
            scale = tl.load(SCALES + group * stride_sg + cols * stride_sn, mask=col_mask, other=0.0)[None, :]
            zero = tl.load(ZEROS + group * stride_zg + cols * stride_zn, mask=col_mask, other=0.0)[None, :]
        else:
            groups = (ks // group_size)[:, None]
            scale = tl.load(SCALES + groups * stride_sg + cols[None, :] * stride_sn, mask=w_mask, other=0.0)
            zero = tl.load(ZEROS + groups * stride_zg + cols[None, :] * stride_zn, mask=w_mask, other=0.0)
        if OFFSET_IS_MIN:
            w = q * scale.to(tl.float32) + zero.to(tl.float32)  # `zero` holds the group's min here
        else:
            w = (q - zero.to(tl.float32)) * scale.to(tl.float32)
        acc = mma(x, w.to(x.dtype), acc, DOT_PRECISION, UPCAST)
    store_y_tile(Y, acc, rows, cols, row_mask, col_mask, stride_ys, stride_ym, stride_yn)


@checked_once
def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor, group_size: int) -> int:
    k = check_int4_shapes(qweight, scales, offset, group_size)
    if not scales.is_floating_point() or offset.dtype != scales.dtype:
        raise ValueError(f"scales and zeros/mins must share one float dtype, got {scales.dtype} and {offset.dtype}")
    if scales.device != qweight.device or offset.device != qweight.device:
        raise ValueError("qweight, scales and zeros/mins must be on one device")
    check_matmul_input(x, k, qweight.device)
    return k


def _block_k(group_size: int) -> int:
    """The largest K tile (<= 128, >= 16 for the tensor cores) that divides the group, else 16."""
    for block_k in (128, 64, 32, 16):
        if group_size % block_k == 0:
            return block_k
    return 16


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    *,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W [K, N] -> [M, N]`` with ``W`` stored as int4 (see the module docstring)."""
    offset, is_min = offset_args(zeros, mins)
    k = _check(x, qweight, scales, offset, group_size)
    m, n = x.shape[0], qweight.shape[1]
    if m == 0 or n == 0:
        return torch.zeros((m, n), dtype=x.dtype, device=x.device)
    block_k = _block_k(group_size)
    tiles = plan_split_k(x, n, k, min(block_k, 64) if x.dtype == torch.float32 else block_k)
    y = tiles.y
    _int4_matmul_kernel[tiles.grid](
        x,
        qweight,
        scales,
        offset,
        y,
        m,
        n,
        k,
        group_size,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        scales.stride(1),
        offset.stride(0),
        offset.stride(1),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        tiles.k_per_split,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        TILE_IN_GROUP=group_size % tiles.block_k == 0,
        OFFSET_IS_MIN=is_min,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot(x.dtype),
        num_warps=4,
    )
    return tiles.result(x.dtype)


def int4_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    *,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: unpack and dequantize to float32 (``int4_packing``), matmul, round to x's dtype."""
    _check(x, qweight, scales, offset_args(zeros, mins)[0], group_size)
    w = dequantize_int4(qweight, scales, zeros, group_size, dtype=torch.float32, mins=mins)
    return (x.float() @ w).to(x.dtype)
