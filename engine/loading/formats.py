"""The format registry: the one place that decides what a model path is and which reader loads it.

`detect_format(path)` names the format (`FORMATS`): a GGUF file (by name or magic, `gguf/detect.py`),
else a folder, whose config.json's `quantization_config` (or a legacy ``quantize_config.json``) makes
it a quantized checkpoint (`quant/spec.py`), whose ``sparsity_config`` makes it a 2:4-sparse one
(`sparsity/format.py`; read by `sparse_checkpoint.SparseCheckpoint`), and whose absence of both makes it a
dense Hugging Face folder. A folder with both raises ValueError (not a supported combination).
`open_checkpoint` returns the reader for that format; every reader answers the same `Checkpoint`
protocol, which is all `loader.load_model` knows of formats. `read_model_config` is the config alone.

Invariants: a path that is neither a GGUF file nor a folder raises FileNotFoundError naming it; a folder
without config.json or with a malformed one raises as `config.read_config_json` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ..config import ModelConfig, read_config_json
from ..gguf.detect import is_gguf_file
from ..quant.runtime import QuantizedWeight
from ..quant.spec import QuantSpec, read_quant_spec
from ..sparsity.format import FORMAT as SPARSE_FORMAT
from ..sparsity.format import SparsityConfig, read_sparsity_config
from .safetensors import SafetensorsCheckpoint
from .sparse_checkpoint import SparseCheckpoint

FORMATS = {
    "hf": "Hugging Face folder: config.json and safetensors (one file, or an index of shards)",
    "gguf": "GGUF file (llama.cpp): dequantized, its Q8_0/Q4_0/Q4_1 kept ('gguf') or quantized at load (int8/int4)",
    "tidepool-int8": "Tidepool int8 folder (`tidepool quantize --method int8`): one scale per output channel",
    "tidepool-int4": "Tidepool int4 folder (`tidepool quantize --method int4`): group sizes per input width",
    "gptq": "GPTQ 4-bit folder (v1 or v2, act-order allowed)",
    "awq": "AWQ 4-bit GEMM folder",
    SPARSE_FORMAT: "Tidepool 2:4-sparse folder (`tidepool sparsify`): kept values (float or int8) + index metadata",
}


@dataclass(frozen=True, slots=True)
class ModelFormat:
    name: str  # a key of FORMATS
    path: Path
    quant: QuantSpec | None = None  # a quantized folder's scheme
    sparsity: SparsityConfig | None = None  # a 2:4 folder's sparsity_config


class Checkpoint(Protocol):
    """What the loader asks of a format's reader, in stage order (`read_config` first)."""

    path: Path

    def read_config(self) -> ModelConfig: ...

    def quantized_weights(
        self, model: nn.Module, dtype: torch.dtype, show_progress: bool
    ) -> dict[str, QuantizedWeight]: ...

    def load_dense(self, model: nn.Module, dtype: torch.dtype, show_progress: bool) -> None: ...

    def close(self) -> None: ...


def detect_format(path: str | Path) -> ModelFormat:
    """The format of `path` (see the module docstring)."""
    location = Path(path)
    if is_gguf_file(location):
        return ModelFormat("gguf", location)
    if not location.is_dir():
        raise FileNotFoundError(f"model folder {location} does not exist")
    config = read_config_json(location)
    spec = read_quant_spec(location, config)
    sparsity = read_sparsity_config(config, str(location / "config.json"))
    if sparsity is not None:
        if spec is not None:
            raise ValueError(
                f"{location / 'config.json'} has both a quantization_config ({spec.kind}) and a sparsity_config; "
                "a 2:4 checkpoint quantizes through its own int8 kept values (`tidepool sparsify --values-dtype int8`)"
            )
        return ModelFormat(SPARSE_FORMAT, location, None, sparsity)
    return ModelFormat("hf" if spec is None else spec.kind, location, spec)


def open_checkpoint(path: str | Path, quantization: str | None = None) -> Checkpoint:
    """The reader for `path`'s format. `quantization` applies to GGUF files (None: dequantize; "gguf": keep
    Q8_0/Q4_0/Q4_1; "int8"/"int4": quantize at load); a folder's own `quantization_config` decides for a folder."""
    model_format = detect_format(path)
    if model_format.name == "gguf":
        from ..gguf.checkpoint import GGUFCheckpoint  # the `gguf` package (and yaml, …): only for a GGUF file

        return GGUFCheckpoint(model_format.path, quantization)
    if model_format.sparsity is not None:
        return SparseCheckpoint(model_format.path, model_format.sparsity)
    return SafetensorsCheckpoint(model_format.path, model_format.quant)


def read_model_config(path: str | Path) -> ModelConfig:
    """Stage 1 alone: the `ModelConfig` of the model at `path`, whatever its format; no weights are read."""
    checkpoint = open_checkpoint(path)
    try:
        return checkpoint.read_config()
    finally:
        checkpoint.close()
