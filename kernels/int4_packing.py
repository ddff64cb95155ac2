"""Tidepool's runtime int4 weight layout, shared by the int4 kernel and the quantization code.

A linear layer computes ``y = x @ W`` with ``W`` of shape ``[K, N]`` (the transpose of a
``torch.nn.Linear`` weight ``[N, K]``). Group-wise asymmetric int4 stores:

- ``qweight``: int32 ``[K // 8, N]``. Element ``(r, n)`` packs the eight 4-bit values
  ``q[8 * r + i, n]`` for ``i = 0..7``, value ``i`` in bits ``4 * i .. 4 * i + 3`` (lowest
  nibble first). Values are unsigned, ``0..15``. Packing runs along K, so one int32 load
  feeds eight consecutive rows of the reduction.
- ``scales``: ``[K // group_size, N]`` in the activation dtype (or another float dtype, e.g. a file's own fp16).
- the group's offset, ``[K // group_size, N]`` in the same dtype as ``scales``, in one of two forms:
  - ``zeros``: the zero point as a real number, so GPTQ's integer zeros (stored minus one in its
    checkpoints), AWQ's zeros and symmetric schemes (zero = 8) all convert without loss:
    ``W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]`` with ``g = k // group_size``.
  - ``mins``: the value code 0 stands for, added after scaling (llama.cpp's Q4_1 blocks store
    ``d`` and ``m`` with ``x = d * q + m``): ``W[k, n] = q[k, n] * scales[g, n] + mins[g, n]``.
    A min is a float that is in general no integer multiple of the scale, so a zero point
    ``-m / d`` would round it (and not exist for ``d = 0``); this form keeps it exact.
  A layer holds exactly one of the two (`offset_args` checks that).

Invariants: ``K % 8 == 0`` and ``K % group_size == 0``; ``group_size % 8 == 0`` so a packed
row never straddles two groups. GPTQ act-order checkpoints (``g_idx`` not equal to
``k // group_size``) are converted at load by permuting rows of K into group order; the
layer then permutes the input features the same way (see ``tidepool.engine.quant``).
"""

from __future__ import annotations

import sys

import torch

PACK_FACTOR = 8  # 4-bit values per int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i lives at bits 4i..4i+3


def offset_args(zeros: torch.Tensor | None, mins: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """``(offset tensor, is_min)`` from the two optional forms; ValueError unless exactly one is given."""
    if zeros is not None and mins is None:
        return zeros, False
    if mins is not None and zeros is None:
        return mins, True
    raise ValueError("give exactly one of zeros (W = (q - z) * s) and mins (W = q * s + m)")


def check_int4_shapes(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> int:
    """Validate the layout above (`zeros` stands for either offset form); returns K. ValueError naming what is wrong."""
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
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 values must lie in 0..15")
    if sys.byteorder == "little":
        # Byte j of a little-endian word holds nibbles 2j (low) and 2j + 1 (high): build the bytes in
        # uint8 and reinterpret four of them as one int32 (no wide integer temporaries).
        pairs = q.to(torch.uint8).reshape(k // 2, 2, n)
        packed_bytes = pairs[:, 0] | (pairs[:, 1] << 4)  # [K / 2, N]
        words = packed_bytes.view(k // PACK_FACTOR, 4, n).permute(0, 2, 1).contiguous()
        return words.reshape(-1).view(torch.int32).view(k // PACK_FACTOR, n)
    q64 = q.to(torch.int64).view(k // PACK_FACTOR, PACK_FACTOR, n)
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
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype | None = None,
    *,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense ``W`` ``[K, N]`` the layout stands for (in ``dtype``, default the scales' dtype)."""
    offset, is_min = offset_args(zeros, mins)
    k = check_int4_shapes(qweight, scales, offset, group_size)
    dtype = dtype or scales.dtype
    q = unpack_int4(qweight).to(dtype).view(k // group_size, group_size, -1)
    if is_min:
        w = q * scales.to(dtype).unsqueeze(1) + offset.to(dtype).unsqueeze(1)
    else:
        w = (q - offset.to(dtype).unsqueeze(1)) * scales.to(dtype).unsqueeze(1)
    return w.view(k, -1)
