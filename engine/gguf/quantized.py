"""Decoder projections of a GGUF file as Tidepool quantized weights instead of dense tensors.

Modes (`LLM(quantization=...)` on a GGUF file):
- ``"gguf"`` keeps the file's own quantization where Tidepool has a layout for it:
  Q4_0 / Q4_1 -> int4 with group size 32 in the ``mins`` form (``W = q * d + m``; Q4_0's
  ``d * (q - 8)`` is ``q * d + (-8 d)``), the same codes, scales and mins as the file, so the
  weights are bit-for-bit those the file stands for; Q8_0 -> int8 with one scale per output
  channel (Tidepool's int8 layout), which re-rounds each 32-value block (error at most half a
  per-channel step). Scales and mins stay in float16, the file's own precision (float32 in the rare
  case an ``8 d`` overflows float16).
- ``"int8"`` / ``"int4"`` quantize the dequantized projections with Tidepool's round-to-nearest
  (`engine/quant/quantize.py`), as `quantization=` does for a dense Hugging Face folder (int4: groups
  of 128, narrower where a projection's inputs need it: `int4_group_size`).

A fused projection (q/k/v, gate/up) is quantized only if every part can be; a part of another
type (F16, a K-quant) leaves the whole fused weight dense, which is logged. Parts of different
layouts (one Q8_0 part beside Q4_1 parts) sit side by side in a `ConcatWeight`. Embeddings, norms
and the LM head always stay dense, as in published GPTQ/AWQ checkpoints.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn
from tqdm.auto import tqdm

from ...kernels.int4_packing import pack_int4
from ..quant.formats import Int4Parts
from ..quant.load import projection_targets
from ..quant.quantize import DEFAULT_GROUP_SIZE, int4_group_size, quantize_int4, quantize_int8
from ..quant.runtime import ConcatWeight, Int4Weight, Int8Weight, QuantizedWeight, fuse_int4, fuse_int8
from .tensors import QK, WeightSource, q4_parts

logger = logging.getLogger(__name__)

MODES = ("gguf", "int8", "int4")
KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")

Part = Int4Parts | tuple[torch.Tensor, torch.Tensor]


def _exact_half(values: torch.Tensor) -> torch.Tensor:
    """float16 when it holds every value exactly (always, for a file's own d/m), else float32."""
    half = values.half()
    return half if torch.equal(half.float(), values) else values


def q4_to_int4(source: WeightSource, hf: str) -> Int4Parts:
    """A Q4_0/Q4_1 weight ``[N, K]`` as Tidepool int4 (group 32, mins form), rows in Hugging Face order."""
    info = source.by_hf_name[hf]
    q, d, m = q4_parts(info)
    order = source.row_order(info)
    if order is not None:
        q, d, m = q.index_select(0, order), d.index_select(0, order), m.index_select(0, order)
    scales, mins = d.t().contiguous(), m.t().contiguous()
    dtype = torch.float16 if _exact_half(scales).dtype == _exact_half(mins).dtype == torch.float16 else torch.float32
    return Int4Parts(pack_int4(q.t()), scales.to(dtype), None, QK, None, mins.to(dtype))


def _part(source: WeightSource, hf: str, mode: str, dtype: torch.dtype) -> Part | None:
    info = source.by_hf_name[hf]
    if mode == "gguf":
        if info.type_name in ("Q4_0", "Q4_1"):
            return q4_to_int4(source, hf)
        if info.type_name == "Q8_0":
            return quantize_int8(source.dense(hf, torch.float32), scale_dtype=dtype)
        return None
    dense = source.dense(hf, torch.float32)
    if mode == "int8":
        return quantize_int8(dense, scale_dtype=dtype)
    group_size = int4_group_size(dense.shape[1], DEFAULT_GROUP_SIZE, hf)  # as `quantization="int4"` on a folder
    qweight, scales, zeros = quantize_int4(dense, group_size, scale_dtype=dtype)
    return Int4Parts(qweight, scales, zeros, group_size)


def _fuse(parts: list[Part]) -> QuantizedWeight:
    int4 = [p for p in parts if isinstance(p, Int4Parts)]
    int8 = [p for p in parts if not isinstance(p, Int4Parts)]
    if not int8:
        return fuse_int4(int4)
    if not int4:
        return fuse_int8(int8)
    return ConcatWeight([Int4Weight(p) if isinstance(p, Int4Parts) else Int8Weight(*p) for p in parts])


def quantized_weights(
    model: nn.Module, source: WeightSource, mode: str, dtype: torch.dtype, show_progress: bool = True
) -> tuple[dict[str, QuantizedWeight], set[str]]:
    """`(weights, consumed)`: a quantized weight per projection of `model` that can be one, by dense parameter
    name (the loading layer swaps them in: `quant.load.apply_quantized`), and the Hugging Face names used."""
    if mode not in MODES:
        raise ValueError(f"GGUF quantization mode must be one of {', '.join(MODES)}, got {mode!r}")
    weights: dict[str, QuantizedWeight] = {}
    consumed: set[str] = set()
    left_dense: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    group_sizes: Counter[int] = Counter()  # int4 projections by group size
    targets = projection_targets(model)
    for param, prefixes in tqdm(targets.items(), desc=f"Quantizing ({mode})", disable=not show_progress):
        names = [f"{prefix}.weight" for prefix in prefixes]
        if any(name not in source.by_hf_name for name in names):
            continue  # the dense load names the missing tensor
        types = [source.by_hf_name[name].type_name for name in names]
        maybe = [_part(source, name, mode, dtype) for name in names]
        parts = [part for part in maybe if part is not None]
        if len(parts) != len(names):
            left_dense.update(types)
            continue
        weights[param] = _fuse(parts)
        consumed.update(names)
        kept.update(types)
        group_sizes.update(part.group_size for part in parts if isinstance(part, Int4Parts))
    logger.info(
        "GGUF projections quantized (%s): %s; left dense: %s; int4 projections by group size: %s",
        mode,
        dict(kept) or "none",
        dict(left_dense) or "none",
        dict(sorted(group_sizes.items())) or "none",
    )
    return weights, consumed
