"""Matmul with per-output-channel int8 weights: ``y = x @ (w_int8 * scales[:, None]).T``.

Shapes: ``x [M, K]`` (float16/bfloat16/float32), ``w_int8 [N, K]`` int8 (a ``torch.nn.Linear``
weight layout), ``scales [N]`` float -> ``y [M, N]`` in x's dtype. Weights are converted to x's
dtype inside the tile (exact: |w| <= 127), accumulated in float32, and the per-channel scale is
applied once to the output tile, since it commutes with the reduction over K.

Decode is memory-bound on the weight read: int8 halves the bytes of a bf16 weight. At decode
batch sizes the ``[M, N]`` output has too few tiles to occupy every SM, so the K reduction is
split across programs (partial sums in float32, summed afterwards).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_dim, check_matmul_input, checked_once, dot_precision
from ._dot import mma, upcast_dot
from ._split_k import load_x_tile, plan_split_k, split_k_tile, store_y_tile


@triton.jit
def _int8_matmul_kernel(
    X,
    W,
    SCALES,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ys,
    stride_ym,
    stride_yn,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows, cols, row_mask, col_mask, k_begin, k_end = split_k_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        x = load_x_tile(X, rows, ks, row_mask, k_mask, stride_xm, stride_xk)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(W + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=w_mask, other=0)
        # Through float32: exact, free on GPUs, and the interpreter has no direct int8 -> bfloat16 cast.
        acc = mma(x, w.to(tl.float32).to(x.dtype), acc, DOT_PRECISION, UPCAST)
    acc *= tl.load(SCALES + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    store_y_tile(Y, acc, rows, cols, row_mask, col_mask, stride_ys, stride_ym, stride_yn)


@checked_once
def _check(x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor) -> None:
    check_dim("w_int8", w_int8, 2, "[N, K]")
    if w_int8.dtype != torch.int8:
        raise ValueError(f"w_int8 must be int8, got {w_int8.dtype}")
    if scales.shape != (w_int8.shape[0],) or not scales.is_floating_point():
        raise ValueError(f"scales must be a float tensor [{w_int8.shape[0]}], got {tuple(scales.shape)} {scales.dtype}")
    if scales.device != w_int8.device:
        raise ValueError(f"scales are on {scales.device} but w_int8 is on {w_int8.device}")
    check_matmul_input(x, w_int8.shape[1], w_int8.device)


def int8_matmul(x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (w_int8 [N, K] * scales [N, 1]).T -> [M, N]`` in x's dtype."""
    _check(x, w_int8, scales)
    (m, k), n = x.shape, w_int8.shape[0]
    if m == 0 or n == 0:
        return torch.zeros((m, n), dtype=x.dtype, device=x.device)
    tiles = plan_split_k(x, n, k, 64 if x.dtype == torch.float32 else 128)
    y = tiles.y
    _int8_matmul_kernel[tiles.grid](
        x,
        w_int8,
        scales,
        y,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w_int8.stride(0),
        w_int8.stride(1),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        tiles.k_per_split,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot(x.dtype),
        num_warps=4,
    )
    return tiles.result(x.dtype)


def int8_matmul_ref(x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Torch reference: dequantize to float32, matmul, round to x's dtype."""
    _check(x, w_int8, scales)
    w = w_int8.float() * scales.float()[:, None]
    return (x.float() @ w.T).to(x.dtype)
