"""Independent, deliberately plain packers/unpackers for the tests (loops over bit positions).

Written from the format descriptions, not from `tidepool.engine.quant`: the code under test must
agree with these. Python ints (unbounded) hold words, then map to int32's two's complement.
"""

from __future__ import annotations

import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0..2**32-1 -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def to_uint(words: torch.Tensor) -> torch.Tensor:
    """int32 -> int64 in 0..2**32-1 with the same bits."""
    return words.to(torch.int64) & 0xFFFFFFFF


def pack_along_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] nibbles -> int32 [K // 8, N]: word r holds rows 8r..8r+7, row 8r+i at bits 4i."""
    k, n = q.shape
    words = torch.zeros((k // 8, n), dtype=torch.int64)
    for r in range(k // 8):
        for i in range(8):
            words[r] += (q[8 * r + i].to(torch.int64) & 0xF) << (4 * i)
    return to_int32(words)


def pack_along_cols(q: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, N] nibbles -> int32 [R, N // 8]: nibble i of word j holds column 8j + order[i]."""
    order = order or list(range(8))
    r, n = q.shape
    words = torch.zeros((r, n // 8), dtype=torch.int64)
    for j in range(n // 8):
        for i in range(8):
            words[:, j] += (q[:, 8 * j + order[i]].to(torch.int64) & 0xF) << (4 * i)
    return to_int32(words)


def unpack_along_rows(words: torch.Tensor) -> torch.Tensor:
    u = to_uint(words)
    rows, n = u.shape
    q = torch.zeros((rows * 8, n), dtype=torch.int64)
    for r in range(rows):
        for i in range(8):
            q[8 * r + i] = (u[r] >> (4 * i)) & 0xF
    return q


def unpack_along_cols(words: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    order = order or list(range(8))
    u = to_uint(words)
    r, cols = u.shape
    q = torch.zeros((r, cols * 8), dtype=torch.int64)
    for j in range(cols):
        for i in range(8):
            q[:, 8 * j + order[i]] = (u[:, j] >> (4 * i)) & 0xF
    return q


def dense_from_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """W [K, N] with W[k, n] = scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n])."""
    return scales[g_idx].float() * (q.float() - zeros[g_idx].float())
