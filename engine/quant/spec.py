"""A checkpoint's quantization scheme: `quantization_config` read (`read_quant_spec`) and written (`tidepool_config`).

Role: the one place that knows what a quantized folder's config.json says. Readers: the format
registry (`engine/loading/formats.py`, which kind of checkpoint a folder is) and the converters
(`load.py`, each projection's group size). Writer: `engine/loading/quantized_copy.py` (`tidepool
quantize`). Both sides of Tidepool's own format live here, so they cannot drift apart.

Tidepool's format (``quant_method: "tidepool"``): ``method`` int8 (per output channel) or int4; an int4
checkpoint records ``group_sizes``, the group size of every projection keyed by its input width, exactly
the sizes its tensors were quantized with (a default size narrows per width: `quantize.int4_group_size`).
The loader reads each projection's size from there; nothing is derived again at load. Folders written
before ``group_sizes`` existed record one ``group_size``, which every projection narrowed by
`quantize.int4_group_size`; they still load, by that same rule (the loader checks it against the tensors).

Invariants: unsupported schemes (other ``quant_method``, bits other than 4 for GPTQ/AWQ, AWQ GEMV)
and malformed fields raise ValueError naming the file, the field and the supported values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .quantize import METHODS, int4_group_size

TIDEPOOL_QUANT_METHOD = "tidepool"
SUPPORTED = ("tidepool (int8, int4)", "gptq (4-bit)", "awq (4-bit, GEMM)")
KINDS = ("tidepool-int8", "tidepool-int4", "gptq", "awq")


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """A checkpoint's quantization scheme, normalised."""

    kind: str  # one of KINDS
    group_size: int | None  # GPTQ/AWQ: one size (-1: one group over all of K); Tidepool int4 folders from
    # before `group_sizes`: the size each projection narrowed from; else None
    is_gptq_v1: bool = True  # GPTQ v1 stores zero - 1
    group_sizes: dict[int, int] = field(default_factory=dict)  # tidepool-int4: input width -> group size

    def group_size_for(self, in_features: int, name: str) -> int:
        """The group size the checkpoint holds for projection `name` with `in_features` inputs: GPTQ's or AWQ's
        one size (-1: one group over all of K), or the one a Tidepool int4 checkpoint records for that width."""
        if self.kind != "tidepool-int4":
            return -1 if self.group_size is None else self.group_size
        if not self.group_sizes and self.group_size is not None:  # an older folder: one size, narrowed per width
            return int4_group_size(in_features, self.group_size, name)
        if in_features not in self.group_sizes:
            raise ValueError(
                f"{name} has {in_features} inputs, for which quantization_config.group_sizes "
                f"({self.group_sizes}) records no group size"
            )
        return self.group_sizes[in_features]


def tidepool_config(method: str, group_sizes: dict[int, int]) -> dict[str, Any]:
    """The `quantization_config` of a Tidepool checkpoint whose int4 projections use `group_sizes`."""
    config: dict[str, Any] = {"quant_method": TIDEPOOL_QUANT_METHOD, "method": method}
    config["bits"] = 8 if method == "int8" else 4
    if method == "int4":
        config["group_sizes"] = {str(k): size for k, size in sorted(group_sizes.items())}
    config["zero_point"] = method == "int4"
    config["modules"] = "decoder projections (q/k/v/o, gate/up/down); embeddings, norms and lm_head dense"
    return config


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


def _group_sizes(raw: dict[str, Any], source: str) -> dict[int, int]:
    sizes = raw.get("group_sizes")
    if not isinstance(sizes, dict) or not sizes:
        raise ValueError(
            f"{source}: an int4 quantization_config needs group_sizes (input width -> group size), got {sizes!r}; "
            "quantize the dense model again with `tidepool quantize`"
        )
    out: dict[int, int] = {}
    for width, size in sizes.items():
        if not str(width).isdigit() or isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{source}: quantization_config.group_sizes[{width!r}] = {size!r} is not a width -> size")
        out[int(width)] = size
    return out


def parse_quant_spec(raw: dict[str, Any], source: str = "config.json") -> QuantSpec:
    method = str(raw.get("quant_method", "")).lower()
    if method == TIDEPOOL_QUANT_METHOD:
        scheme = raw.get("method")
        if scheme not in METHODS:
            raise ValueError(
                f"{source}: quantization_config.method must be one of {', '.join(METHODS)}, got {scheme!r}"
            )
        if scheme == "int8":
            return QuantSpec("tidepool-int8", None)
        if "group_sizes" not in raw and "group_size" in raw:  # written before group_sizes existed
            return QuantSpec("tidepool-int4", _int_field(raw, ("group_size",), None, source))
        return QuantSpec("tidepool-int4", None, group_sizes=_group_sizes(raw, source))
    if method in ("gptq", "awq"):
        return _parse_gptq_awq(raw, method, source)
    raise ValueError(f"{source}: unsupported quant_method {method or None!r}; supported: {', '.join(SUPPORTED)}")


def _parse_gptq_awq(raw: dict[str, Any], method: str, source: str) -> QuantSpec:
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


def read_quant_spec(folder: Path, config: dict[str, Any]) -> QuantSpec | None:
    """The scheme of the folder whose parsed config.json is `config`, or None for a dense model."""
    raw = config.get("quantization_config")
    if raw is not None:
        if not isinstance(raw, dict):
            raise ValueError(f"{folder / 'config.json'}: quantization_config must be an object")
        return parse_quant_spec(raw, str(folder / "config.json"))
    legacy = folder / "quantize_config.json"  # AutoGPTQ exports before transformers integration
    if legacy.is_file():
        return parse_quant_spec({"quant_method": "gptq", **json.loads(legacy.read_text())}, str(legacy))
    return None
