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

from ._checks import cdiv, check_matmul_input, checked_once, choose_split_k, dot_precision
from ._dot import mma, upcast_dot
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
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        w_mask = k_mask[:, None] & col_mask[None, :]
        x_mask = row_mask[:, None] & k_mask[None, :]
        # Masked lanes must be 0, not undefined: they enter the dot product.
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :] * stride_xk, mask=x_mask, other=0.0)
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
    y_ptrs = Y + split * stride_ys + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


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
    block_m = 16 if m <= 16 else 64
    block_n = 32 if m <= 16 else 64  # decode: narrower tiles, more programs streaming the weight
    block_k = _block_k(group_size)
    if x.dtype == torch.float32:
        block_k = min(block_k, 64)
    num_tiles = cdiv(m, block_m) * cdiv(n, block_n)
    num_splits = choose_split_k(num_tiles, k, block_k, x.device)
    k_per_split = cdiv(cdiv(k, num_splits), block_k) * block_k
    num_splits = cdiv(k, k_per_split)
    if num_splits == 1:
        y = torch.empty((1, m, n), dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device)
    _int4_matmul_kernel[(cdiv(m, block_m), cdiv(n, block_n), num_splits)](
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
        k_per_split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        TILE_IN_GROUP=group_size % block_k == 0,
        OFFSET_IS_MIN=is_min,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot(x.dtype),
        num_warps=4,
    )
    return y[0] if num_splits == 1 else y.sum(dim=0).to(x.dtype)


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
