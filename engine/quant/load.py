"""Quantization as one transform of a built model: quantized weights made from a checkpoint, then swapped in.

Role: the bridge between the loading layer (`engine/loading/`) and the quantization code.
`projection_targets` names the model's quantizable parameters (from its own `checkpoint_layout()`),
`checkpoint_weights` converts a quantized Hugging Face checkpoint's tensors (Tidepool's, GPTQ's or
AWQ's; `spec.py` says which) into runtime weights (`formats`, `runtime`), and `apply_quantized` is the
transform: it swaps each dense parameter for its quantized weight. The model code never changes; the
remaining (dense) tensors then load through the model's ordinary `load_weights`.

Invariants:
- Fusion follows the model's own `checkpoint_layout()`: the parts of a fused parameter (q/k/v,
  gate/up) are concatenated along N in their row-offset order. A fused parameter is either fully
  quantized in the checkpoint or fully dense; a mix raises ValueError.
- Once swapped, a parameter leaves `named_parameters()`, so `load_weights` neither expects nor
  accepts its dense tensor; `is_unplaced_zero_bias` names the all-zero biases that GPTQ exporters write
  for bias-free models (skipped), non-zero ones are an error (the model has nowhere to put them).
- Each int4 projection's group size is the one the checkpoint records for it (`QuantSpec.group_size_for`);
  the tensors must agree (`Int4Weight` checks their shapes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ...kernels.int4_packing import PACK_FACTOR
from .formats import Int4Parts, awq_to_int4, gptq_to_int4
from .quantize import is_quantizable
from .runtime import QuantizedWeight, fuse_int4, fuse_int8, swap_weight
from .spec import QuantSpec

logger = logging.getLogger(__name__)

_SUFFIXES = {
    "tidepool-int8": ("qweight", "scales"),
    "tidepool-int4": ("qweight", "scales", "zeros"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}


def projection_targets(model: nn.Module) -> dict[str, list[str]]:
    """Dense parameter name -> the HF projection prefixes fused into it, in row order."""
    by_param: dict[str, list[tuple[int, str]]] = {}
    for hf_name, (param, offset, _rows) in model.checkpoint_layout().items():
        if is_quantizable(hf_name):
            by_param.setdefault(param, []).append((offset, hf_name.removesuffix(".weight")))
    return {param: [prefix for _, prefix in sorted(parts)] for param, parts in by_param.items()}


def apply_quantized(model: nn.Module, weights: dict[str, QuantizedWeight]) -> None:
    """The quantization transform: each named dense parameter of `model` replaced by its quantized weight."""
    for param, weight in weights.items():
        swap_weight(model, param, weight)


def _convert(spec: QuantSpec, prefix: str, t: dict[str, torch.Tensor], dtype: torch.dtype) -> Any:
    def need(suffix: str) -> torch.Tensor:
        if suffix not in t:
            raise ValueError(f"checkpoint is missing tensor {prefix}.{suffix}")
        return t[suffix]

    if spec.kind == "tidepool-int8":
        return need("qweight"), need("scales").to(dtype)
    qweight = need("qweight")
    if spec.kind == "tidepool-int4":
        size = spec.group_size_for(qweight.shape[0] * PACK_FACTOR, prefix)
        return Int4Parts(qweight, need("scales").to(dtype), need("zeros").to(dtype), size)
    if spec.kind == "gptq":  # GPTQ's qweight is [K // 8, N] (packed along K), AWQ's [K, N // 8]
        size = spec.group_size_for(qweight.shape[0] * PACK_FACTOR, prefix)
        return gptq_to_int4(
            prefix, qweight, need("qzeros"), need("scales"), t.get("g_idx"), size, spec.is_gptq_v1, dtype
        )
    size = spec.group_size_for(qweight.shape[0], prefix)
    return awq_to_int4(prefix, qweight, need("qzeros"), need("scales"), size, dtype)


def checkpoint_weights(
    model: nn.Module,
    keys: set[str],
    read: Callable[[str], torch.Tensor],
    spec: QuantSpec,
    dtype: torch.dtype,
    show_progress: bool = True,
) -> tuple[dict[str, QuantizedWeight], set[str]]:
    """`(weights, consumed)`: the quantized weight of every projection the checkpoint holds quantized, by
    dense parameter name, and the checkpoint keys they were made from. `keys` are the checkpoint's tensor
    names, `read` reads one."""
    suffixes = _SUFFIXES[spec.kind]
    consumed: set[str] = set()
    weights: dict[str, QuantizedWeight] = {}
    targets = projection_targets(model)
    for param, prefixes in tqdm(targets.items(), desc="Converting quantized weights", disable=not show_progress):
        present = [p for p in prefixes if f"{p}.qweight" in keys]
        if not present:
            continue  # this projection was left dense in the checkpoint
        if len(present) != len(prefixes):
            missing = sorted(set(prefixes) - set(present))
            raise ValueError(f"{', '.join(missing)} not quantized while fused partners {', '.join(present)} are")
        parts = []
        for prefix in prefixes:
            tensors = {s: read(f"{prefix}.{s}") for s in suffixes if f"{prefix}.{s}" in keys}
            consumed.update(f"{prefix}.{s}" for s in tensors)
            parts.append(_convert(spec, prefix, tensors, dtype))
        weights[param] = fuse_int8(parts) if spec.kind == "tidepool-int8" else fuse_int4(parts)
    if not weights:
        raise ValueError(f"the checkpoint is marked {spec.kind} but holds no quantized projection (*.qweight)")
    return weights, consumed


def is_unplaced_zero_bias(key: str, tensor: torch.Tensor, consumed: set[str], layout: dict[str, Any]) -> bool:
    """True for the bias of a quantized projection that the model has no place for and that is all zero (GPTQ
    exporters write them for bias-free models); raises ValueError for a non-zero one."""
    prefix, _, leaf = key.rpartition(".")
    if leaf != "bias" or key in layout or f"{prefix}.qweight" not in consumed:
        return False
    if bool(tensor.any()):
        raise ValueError(f"checkpoint tensor {key!r} is a non-zero bias the model has no place for")
    return True
