"""Tidepool's runtime int4 weight layout, shared by the int4 kernel and the quantization code.

A linear layer computes ``y = x @ W`` with ``W`` of shape ``[K, N]`` (the transpose of a
``torch.nn.Linear`` weight ``[N, K]``). Group-wise asymmetric int4 stores:

- ``qweight``: int32 ``[K // 8, N]``. Element ``(r, n)`` packs the eight 4-bit values
  ``q[8 * r + i, n]`` for ``i = 0..7``, value ``i`` in bits ``4 * i .. 4 * i + 3`` (lowest
  nibble first). Values are unsigned, ``0..15``. Packing runs along K, so one int32 load
  feeds eight consecutive rows of the reduction.
- ``scales``: ``[K // group_size, N]`` in the activation dtype (or float32).
- ``zeros``: ``[K // group_size, N]``, same dtype as ``scales``: the zero point as a real
  number, so GPTQ's integer zeros (stored minus one in its checkpoints), AWQ's zeros and
  symmetric schemes (zero = 8) all convert without loss.

Dequantization: ``W[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]``.

Invariants: ``K % 8 == 0`` and ``K % group_size == 0``; ``group_size % 8 == 0`` so a packed
row never straddles two groups. GPTQ act-order checkpoints (``g_idx`` not equal to
``k // group_size``) are converted at load by permuting rows of K into group order; the
layer then permutes the input features the same way (see ``tidepool.engine.quant``).
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # 4-bit values per int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i lives at bits 4i..4i+3


def check_int4_shapes(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> int:
    """Validate the layout above; returns K. Raises ValueError naming what is wrong."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D int32 tensor [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    if group_size <= 0 or group_size % PACK_FACTOR:
        raise ValueError(f"group_size must be a positive multiple of {PACK_FACTOR}, got {group_size}")
    k = qweight.shape[0] * PACK_FACTOR
    n = qweight.shape[1]
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    expected = (k // group_size, n)
    if tuple(scales.shape) != expected or tuple(zeros.shape) != expected:
        raise ValueError(
            f"scales and zeros must be {list(expected)} for K={k}, N={n}, group_size={group_size}; "
            f"got scales {list(scales.shape)}, zeros {list(zeros.shape)}"
        )
    return k


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values ``q`` ``[K, N]`` (any integer dtype, values 0..15) into int32 ``[K // 8, N]``."""
    if q.dim() != 2 or q.shape[0] % PACK_FACTOR:
        raise ValueError(f"q must be [K, N] with K a multiple of {PACK_FACTOR}, got {tuple(q.shape)}")
    k, n = q.shape
    q64 = q.to(torch.int64).view(k // PACK_FACTOR, PACK_FACTOR, n)
    if int(q64.min()) < 0 or int(q64.max()) > 15:
        raise ValueError("int4 values must lie in 0..15")
    # Nibbles do not overlap, so the sum is a bitwise OR; computed in int64, then mapped to int32's
    # two's-complement range (a nibble 7 of 8..15 sets the sign bit).
    packed = (q64 << _SHIFTS.to(device=q.device, dtype=torch.int64).view(1, PACK_FACTOR, 1)).sum(dim=1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
    return packed.to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 ``[K // 8, N]`` -> uint8 ``[K, N]`` with values 0..15."""
    rows, n = qweight.shape
    nibbles = (qweight.unsqueeze(1) >> _SHIFTS.to(qweight.device).view(1, PACK_FACTOR, 1)) & 0xF
    return nibbles.reshape(rows * PACK_FACTOR, n).to(torch.uint8)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The dense ``W`` ``[K, N]`` the layout stands for (in ``dtype``, default the scales' dtype)."""
    k = check_int4_shapes(qweight, scales, zeros, group_size)
    dtype = dtype or scales.dtype
    q = unpack_int4(qweight).to(dtype).view(k // group_size, group_size, -1)
    w = (q - zeros.to(dtype).unsqueeze(1)) * scales.to(dtype).unsqueeze(1)
    return w.view(k, -1)
