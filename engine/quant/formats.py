"""Published 4-bit checkpoint layouts (GPTQ, AWQ) converted to Tidepool's runtime int4 packing.

Role: read one linear layer's tensors as they appear in Hub checkpoints and return the
`Int4Parts` (``tidepool.kernels.int4_packing`` layout plus an optional input permutation).

Formats (what was relied on):
- GPTQ (AutoGPTQ ``qlinear`` modules, GPTQModel, vLLM ``quantization/gptq.py`` and its exllama
  kernels): ``qweight`` int32 ``[K // 8, N]`` packed along K, value ``i`` of a word in bits
  ``4i..4i+3`` (the same as ours); ``qzeros`` int32 ``[G, N // 8]`` packed the same way but along
  N; ``scales`` ``[G, N]``; ``g_idx`` int32 ``[K]``, the group of each input row. Dequantization:
  ``W[k, n] = scales[g, n] * (q[k, n] - z[g, n])`` with ``g = g_idx[k]``. GPTQ v1 checkpoints
  (``checkpoint_format`` absent or ``"gptq"``, e.g. every AutoGPTQ export) store ``z - 1``; the
  loaders add one after masking the nibble (AutoGPTQ ``zeros = (qzeros >> shift) & 0xF; zeros += 1``),
  so the v1 zero is ``(stored & 0xF) + 1``. ``"gptq_v2"`` stores ``z`` itself (vLLM's gptq_v2
  handling). Symmetric checkpoints are the special case ``z = 8``. ``group_size = -1`` means
  one group over all of K.
- Act-order (``desc_act``): ``g_idx`` is not ``k // group_size``; rows are quantized in the
  order of decreasing Hessian diagonal, so group ``g`` holds an arbitrary set of rows. We sort
  rows by group (a stable argsort of ``g_idx``: `perm`), repack them, and the runtime layer
  reads its input as ``x[..., perm]``; ``x[..., perm] @ W[perm] = x @ W``.
- AWQ GEMM (AutoAWQ ``WQLinear_GEMM``, ``awq/utils/packing_utils.py``; vLLM ``awq_triton.py``):
  ``qweight`` int32 ``[K, N // 8]`` packed along N; ``qzeros`` int32 ``[G, N // 8]``; ``scales``
  ``[G, N]``. Within a word, nibble ``i`` holds column ``8j + AWQ_ORDER[i]`` with
  ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (AutoAWQ's pack order; its inverse, used to unpack,
  is ``[0, 4, 1, 5, 2, 6, 3, 7]``). Zeros are stored as is: ``W = (q - z) * s``.

Invariants: only 4-bit; K divisible by 8 and the group size; every group of an act-order
checkpoint holds exactly ``group_size`` rows. Violations raise ValueError naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.int4_packing import PACK_FACTOR, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed word holds column AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(slots=True)
class Int4Parts:
    """One linear's runtime int4 tensors; ``perm`` (int64 ``[K]``) is the input permutation or None.

    The group offset is ``zeros`` (``W = (q - z) * s``: GPTQ, AWQ, Tidepool's RTN) or ``mins``
    (``W = q * s + m``: llama.cpp's Q4_0/Q4_1), exactly one of them set.
    """

    qweight: torch.Tensor  # int32 [K // 8, N]
    scales: torch.Tensor  # [K // group_size, N]
    zeros: torch.Tensor | None  # [K // group_size, N], real-valued zero points
    group_size: int
    perm: torch.Tensor | None = None
    mins: torch.Tensor | None = None  # [K // group_size, N], added after scaling


def unpack_along_last(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` -> int16 ``[R, 8 * C]``: nibble i of word c becomes column ``8c + i``."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF
    return nibbles.reshape(packed.shape[0], -1).to(torch.int16)


def unpack_along_first(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` -> int16 ``[8 * R, C]``: nibble i of word r becomes row ``8r + i``."""
    nibbles = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device).view(1, -1, 1)) & 0xF
    return nibbles.reshape(-1, packed.shape[1]).to(torch.int16)


def _check_int32(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.int32 or tensor.dim() != 2:
        raise ValueError(f"{name} must be a 2-D int32 tensor, got {tensor.dtype} {tuple(tensor.shape)}")


def _resolve_group_size(group_size: int, k: int, name: str) -> int:
    size = k if group_size == -1 else group_size
    if size <= 0 or k % size or size % PACK_FACTOR:
        raise ValueError(f"{name}: group_size {group_size} does not tile K={k} in multiples of {PACK_FACTOR}")
    return size


def _check_grouped(name: str, tensor: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")


def gptq_to_int4(
    prefix: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    is_v1: bool = True,
    dtype: torch.dtype | None = None,
) -> Int4Parts:
    """One GPTQ linear (``prefix.qweight`` …) in the runtime layout; act-order rows sorted into groups."""
    _check_int32(f"{prefix}.qweight", qweight)
    _check_int32(f"{prefix}.qzeros", qzeros)
    k, n = qweight.shape[0] * PACK_FACTOR, qweight.shape[1]
    size = _resolve_group_size(group_size, k, prefix)
    num_groups = k // size
    _check_grouped(f"{prefix}.scales", scales, (num_groups, n))
    _check_grouped(f"{prefix}.qzeros", qzeros, (num_groups, n // PACK_FACTOR))
    zeros = unpack_along_last(qzeros).float() + (1.0 if is_v1 else 0.0)
    dtype = dtype or scales.dtype
    perm = None
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,):
            raise ValueError(f"{prefix}.g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
        g_idx = g_idx.to(torch.int64)
        if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // size):
            counts = torch.bincount(g_idx, minlength=num_groups)
            if g_idx.min() < 0 or counts.numel() != num_groups or bool((counts != size).any()):
                raise ValueError(f"{prefix}.g_idx must assign exactly {size} rows to each of {num_groups} groups")
            perm = torch.argsort(g_idx, stable=True)
            qweight = pack_int4(unpack_along_first(qweight)[perm])
    return Int4Parts(qweight, scales.to(dtype), zeros.to(dtype), size, perm)


def awq_to_int4(
    prefix: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype | None = None,
) -> Int4Parts:
    """One AWQ GEMM linear in the runtime layout (de-interleaves AWQ's nibble order, repacks along K)."""
    _check_int32(f"{prefix}.qweight", qweight)
    _check_int32(f"{prefix}.qzeros", qzeros)
    k, n = qweight.shape[0], qweight.shape[1] * PACK_FACTOR
    if k % PACK_FACTOR:
        raise ValueError(f"{prefix}.qweight has K={k} rows, not a multiple of {PACK_FACTOR}")
    size = _resolve_group_size(group_size, k, prefix)
    _check_grouped(f"{prefix}.scales", scales, (k // size, n))
    _check_grouped(f"{prefix}.qzeros", qzeros, (k // size, n // PACK_FACTOR))
    # Unpacked nibble i of word j is column 8j + AWQ_ORDER[i]; scatter it there.
    columns = torch.tensor(AWQ_ORDER, dtype=torch.int64)
    order = (torch.arange(n // PACK_FACTOR).unsqueeze(1) * PACK_FACTOR + columns).reshape(-1)
    q = torch.empty((k, n), dtype=torch.int16)
    q[:, order] = unpack_along_last(qweight)
    zeros = torch.empty((k // size, n), dtype=torch.int16)
    zeros[:, order] = unpack_along_last(qzeros)
    dtype = dtype or scales.dtype
    return Int4Parts(pack_int4(q), scales.to(dtype), zeros.to(dtype), size, None)
