"""Loading quantized Hugging Face folders: detect the scheme, convert its tensors, swap the weights.

Role: the bridge between `engine/models/loader.py` and the quantization code. `read_quant_spec`
reads ``quantization_config`` from config.json (or a GPTQ ``quantize_config.json``) and
`load_quantized` fills a freshly built model: first every quantized projection is converted to
the runtime layout (`formats`, or Tidepool's own tensors) and swapped in (`runtime`), then all
remaining tensors go through the model's ordinary `load_weights`.

Invariants:
- Fusion follows the model's own `checkpoint_layout()`: the parts of a fused parameter (q/k/v,
  gate/up) are concatenated along N in their row-offset order. A fused parameter is either fully
  quantized in the checkpoint or fully dense; a mix raises ValueError.
- Once swapped, a parameter leaves `named_parameters()`, so `load_weights` neither expects nor
  accepts its dense tensor; all-zero biases that GPTQ exporters write for bias-free models are
  skipped, non-zero ones are an error (the model has nowhere to put them).
- Unsupported schemes (other ``quant_method``, bits other than 4 for GPTQ/AWQ, AWQ GEMV) raise
  ValueError naming the field and the supported values.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from ...kernels.int4_packing import PACK_FACTOR
from .formats import Int4Parts, awq_to_int4, gptq_to_int4
from .quantize import METHODS, int4_group_size, is_quantizable
from .runtime import QuantizedWeight, fuse_int4, fuse_int8, swap_weight, weight_bytes

logger = logging.getLogger(__name__)

TIDEPOOL_QUANT_METHOD = "tidepool"
SUPPORTED = ("tidepool (int8, int4)", "gptq (4-bit)", "awq (4-bit, GEMM)")
_SUFFIXES = {
    "tidepool-int8": ("qweight", "scales"),
    "tidepool-int4": ("qweight", "scales", "zeros"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """A checkpoint's quantization scheme, normalised."""

    kind: str  # "tidepool-int8", "tidepool-int4", "gptq" or "awq"
    group_size: int | None  # None for int8 (per channel); -1: one group over all of K (GPTQ's convention)
    is_gptq_v1: bool = True  # GPTQ v1 stores zero - 1


def _int_field(raw: dict[str, Any], names: tuple[str, ...], default: int | None, source: str) -> int:
    for name in names:
        if name in raw:
            value = raw[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{source}: quantization_config.{name} must be an integer, got {value!r}")
            return value
    if default is None:
        raise ValueError(f"{source}: quantization_config lacks {names[0]}")
    return default


def parse_quant_spec(raw: dict[str, Any], source: str = "config.json") -> QuantSpec:
    method = str(raw.get("quant_method", "")).lower()
    if method == TIDEPOOL_QUANT_METHOD:
        scheme = raw.get("method")
        if scheme not in METHODS:
            raise ValueError(
                f"{source}: quantization_config.method must be one of {', '.join(METHODS)}, got {scheme!r}"
            )
        group_size = None if scheme == "int8" else _int_field(raw, ("group_size",), 128, source)
        return QuantSpec(f"tidepool-{scheme}", group_size)
    if method in ("gptq", "awq"):
        bits = _int_field(raw, ("bits", "w_bit"), None, source)
        if bits != 4:
            raise ValueError(f"{source}: only 4-bit {method.upper()} checkpoints are supported, got bits={bits}")
        group_size = _int_field(raw, ("group_size", "q_group_size"), 128 if method == "awq" else -1, source)
        if method == "awq":
            version = str(raw.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{source}: AWQ version {version!r} is not supported; only 'gemm' is")
            if raw.get("zero_point", True) is not True:
                raise ValueError(f"{source}: AWQ without zero points is not supported")
            return QuantSpec("awq", group_size)
        checkpoint_format = str(raw.get("checkpoint_format", "gptq")).lower()
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"{source}: GPTQ checkpoint_format {checkpoint_format!r}; supported: gptq, gptq_v2")
        return QuantSpec("gptq", group_size, is_gptq_v1=checkpoint_format == "gptq")
    raise ValueError(f"{source}: unsupported quant_method {method or None!r}; supported: {', '.join(SUPPORTED)}")


def read_quant_spec(folder: Path) -> QuantSpec | None:
    """The folder's quantization scheme, or None for a dense model."""
    config = json.loads((folder / "config.json").read_text())
    raw = config.get("quantization_config")
    if raw is not None:
        if not isinstance(raw, dict):
            raise ValueError(f"{folder / 'config.json'}: quantization_config must be an object")
        return parse_quant_spec(raw, str(folder / "config.json"))
    legacy = folder / "quantize_config.json"  # AutoGPTQ exports before transformers integration
    if legacy.is_file():
        return parse_quant_spec({"quant_method": "gptq", **json.loads(legacy.read_text())}, str(legacy))
    return None


def projection_targets(model: nn.Module) -> dict[str, list[str]]:
    """Dense parameter name -> the HF projection prefixes fused into it, in row order."""
    by_param: dict[str, list[tuple[int, str]]] = {}
    for hf_name, (param, offset, _rows) in model.checkpoint_layout().items():
        if is_quantizable(hf_name):
            by_param.setdefault(param, []).append((offset, hf_name.removesuffix(".weight")))
    return {param: [prefix for _, prefix in sorted(parts)] for param, parts in by_param.items()}


def _convert(spec: QuantSpec, prefix: str, t: dict[str, torch.Tensor], dtype: torch.dtype) -> Any:
    group_size = -1 if spec.group_size is None else spec.group_size

    def need(suffix: str) -> torch.Tensor:
        if suffix not in t:
            raise ValueError(f"checkpoint is missing tensor {prefix}.{suffix}")
        return t[suffix]

    if spec.kind == "tidepool-int8":
        return need("qweight"), need("scales").to(dtype)
    if spec.kind == "tidepool-int4":  # the folder's size, narrower where a projection's inputs need it
        qweight = need("qweight")
        size = int4_group_size(qweight.shape[0] * PACK_FACTOR, group_size, prefix)
        return Int4Parts(qweight, need("scales").to(dtype), need("zeros").to(dtype), size)
    if spec.kind == "gptq":
        return gptq_to_int4(
            prefix,
            need("qweight"),
            need("qzeros"),
            need("scales"),
            t.get("g_idx"),
            group_size,
            spec.is_gptq_v1,
            dtype,
        )
    return awq_to_int4(prefix, need("qweight"), need("qzeros"), need("scales"), group_size, dtype)


def load_quantized(
    model: nn.Module, files: list[Path], spec: QuantSpec, dtype: torch.dtype, show_progress: bool = True
) -> None:
    """Fill `model` (freshly built, dense parameters unset) from a quantized checkpoint."""
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        _load_quantized(model, handles, spec, dtype, show_progress)


def _load_quantized(
    model: nn.Module, handles: list[Any], spec: QuantSpec, dtype: torch.dtype, show_progress: bool
) -> None:
    suffixes = _SUFFIXES[spec.kind]
    key_file: dict[str, Any] = {}
    for handle in handles:
        key_file.update((key, handle) for key in handle.keys())  # noqa: SIM118 - safe_open handles are not dicts

    def read(key: str) -> torch.Tensor:
        return key_file[key].get_tensor(key)

    quantized_keys: set[str] = set()
    swaps: dict[str, QuantizedWeight] = {}
    targets = projection_targets(model)
    for param, prefixes in tqdm(targets.items(), desc="Converting quantized weights", disable=not show_progress):
        present = [p for p in prefixes if f"{p}.qweight" in key_file]
        if not present:
            continue  # this projection was left dense in the checkpoint
        if len(present) != len(prefixes):
            missing = sorted(set(prefixes) - set(present))
            raise ValueError(f"{', '.join(missing)} not quantized while fused partners {', '.join(present)} are")
        parts = []
        for prefix in prefixes:
            tensors = {s: read(f"{prefix}.{s}") for s in suffixes if f"{prefix}.{s}" in key_file}
            quantized_keys.update(f"{prefix}.{s}" for s in tensors)
            parts.append(_convert(spec, prefix, tensors, dtype))
        swaps[param] = fuse_int8(parts) if spec.kind == "tidepool-int8" else fuse_int4(parts)
    if not swaps:
        raise ValueError(f"the checkpoint is marked {spec.kind} but holds no quantized projection (*.qweight)")
    for param, weight in swaps.items():
        swap_weight(model, param, weight)
    layout = model.checkpoint_layout()
    quantized_prefixes = {k.rsplit(".", 1)[0] for k in quantized_keys}

    def rest() -> Any:
        for key in sorted(key_file):
            if key in quantized_keys:
                continue
            tensor = read(key)
            prefix, _, leaf = key.rpartition(".")
            if leaf == "bias" and prefix in quantized_prefixes and key not in layout:
                if bool(tensor.any()):
                    raise ValueError(f"checkpoint tensor {key!r} is a non-zero bias the model has no place for")
                continue
            yield key, tensor.to(dtype)

    model.load_weights(rest())
    logger.info(
        "loaded %s checkpoint: %d projections quantized, %.1f MiB of weights",
        spec.kind,
        len(swaps),
        weight_bytes(model) / 2**20,
    )
