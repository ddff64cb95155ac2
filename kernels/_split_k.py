"""The split-K matmul skeleton shared by the quantized matmuls (``int8_matmul``, ``int4_matmul``).

A program owns one ``[BLOCK_M, BLOCK_N]`` tile of ``y = x @ W`` and one partition of the reduction
over K: the grid is ``(M tiles, N tiles, splits)`` and partition ``s`` covers
``[s * k_per_split, (s + 1) * k_per_split)`` (``k_per_split`` a multiple of ``BLOCK_K``, so only the
last partition is ragged). Each program writes its tile into slice ``s`` of ``y [splits, M, N]``:
in x's dtype when there is one split (the result itself), in float32 otherwise (partial sums the
launcher adds, ``SplitK.result``). What differs between the kernels, reading and dequantizing the
weight tile, stays in each kernel; the jit helpers here are inlined into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import cdiv, num_sms


def choose_split_k(num_tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Split the reduction only when the output tiles leave most SMs idle (narrow N at decode batch sizes).

    Splitting costs a float32 partial buffer and a reduction launch, so a grid that already covers
    half the SMs runs unsplit; each split keeps at least 4 steps of ``block_k``.
    """
    sms = num_sms(device)
    if 2 * num_tiles > sms:
        return 1
    return max(1, min(cdiv(sms, num_tiles), k // (4 * block_k), 32))


@dataclass(frozen=True)
class SplitK:
    """One launch's tiling and the buffer its programs write (see the module docstring)."""

    block_m: int
    block_n: int
    block_k: int
    num_splits: int
    k_per_split: int
    y: torch.Tensor  # [num_splits, M, N]

    @property
    def grid(self) -> tuple[int, int, int]:
        _, m, n = self.y.shape
        return cdiv(m, self.block_m), cdiv(n, self.block_n), self.num_splits

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """``y [M, N]`` in ``dtype``: the only slice, or the sum of the partial ones."""
        return self.y[0] if self.num_splits == 1 else self.y.sum(dim=0).to(dtype)


def plan_split_k(x: torch.Tensor, n: int, k: int, block_k: int) -> SplitK:
    """Tiles for ``x [M, K] @ W [K, N]`` with K tiles of ``block_k``, and the output buffer."""
    m = x.shape[0]
    block_m = 16 if m <= 16 else 64
    block_n = 32 if m <= 16 else 64  # decode: narrower tiles, more programs streaming the weight
    num_tiles = cdiv(m, block_m) * cdiv(n, block_n)
    num_splits = choose_split_k(num_tiles, k, block_k, x.device)
    k_per_split = cdiv(cdiv(k, num_splits), block_k) * block_k
    num_splits = cdiv(k, k_per_split)
    y_dtype = x.dtype if num_splits == 1 else torch.float32
    y = torch.empty((num_splits, m, n), dtype=y_dtype, device=x.device)
    return SplitK(block_m, block_n, block_k, num_splits, k_per_split, y)


@triton.jit
def split_k_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output ``rows``, ``cols`` and their masks, and its K range ``[k_begin, k_end)``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    return rows, cols, row_mask, col_mask, k_begin, k_end


@triton.jit
def load_x_tile(X, rows, ks, row_mask, k_mask, stride_xm, stride_xk):
    """``x[rows, ks]``; masked lanes read 0, not undefined: they enter the dot product."""
    x_mask = row_mask[:, None] & k_mask[None, :]
    return tl.load(X + rows[:, None] * stride_xm + ks[None, :] * stride_xk, mask=x_mask, other=0.0)


@triton.jit
def store_y_tile(Y, acc, rows, cols, row_mask, col_mask, stride_ys, stride_ym, stride_yn):
    """``acc`` into this program's split slice of ``Y``, in Y's dtype."""
    y_ptrs = Y + tl.program_id(2) * stride_ys + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
