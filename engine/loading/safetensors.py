"""The reader of Hugging Face folders (config.json + safetensors, one file or sharded), dense or quantized.

`safetensors_files` lists a folder's weight files (from ``model.safetensors.index.json`` when there is
one, naming a missing shard); `read_tensors` reads them all (what `tidepool quantize` quantizes).
`SafetensorsCheckpoint` answers the loading layer's `Checkpoint` protocol for a folder: the config
(`ModelConfig.from_folder`), the quantized projections when the folder's `QuantSpec` says it holds them
(`quant.load.checkpoint_weights`), then every other tensor through the model's `load_weights`, cast to
the model's dtype, with a progress bar. The files are opened on first use and held until `close`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..quant.load import checkpoint_weights, is_unplaced_zero_bias
from ..quant.runtime import QuantizedWeight
from ..quant.spec import QuantSpec


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file.name} listed in {index.name} is missing from {path}")
        return files
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in model folder {path}")


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, as stored."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                tensors[key] = f.get_tensor(key)
    return tensors


class SafetensorsCheckpoint:
    """One Hugging Face folder; `spec` is its quantization scheme (None: dense)."""

    def __init__(self, folder: Path, spec: QuantSpec | None) -> None:
        self.path = folder
        self.spec = spec
        self._stack = ExitStack()
        self._key_file: dict[str, Any] | None = None  # tensor name -> the open file holding it, in file order
        self._consumed: set[str] = set()

    def _keys(self) -> dict[str, Any]:
        if self._key_file is None:
            key_file: dict[str, Any] = {}
            for file in safetensors_files(self.path):
                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                key_file.update((key, handle) for key in handle.keys())  # noqa: SIM118 - not a dict
            self._key_file = key_file
        return self._key_file

    def _read(self, key: str) -> torch.Tensor:
        return self._keys()[key].get_tensor(key)

    def read_config(self) -> ModelConfig:
        return ModelConfig.from_folder(self.path)

    def quantized_weights(
        self, model: nn.Module, dtype: torch.dtype, show_progress: bool
    ) -> dict[str, QuantizedWeight]:
        keys = self._keys()  # a missing weight file is named before any work
        if self.spec is None:
            return {}
        weights, self._consumed = checkpoint_weights(model, set(keys), self._read, self.spec, dtype, show_progress)
        return weights

    def load_dense(self, model: nn.Module, dtype: torch.dtype, show_progress: bool) -> None:
        model.load_weights(self._dense(model.checkpoint_layout(), dtype, show_progress))

    def _dense(self, layout: dict[str, Any], dtype: torch.dtype, show_progress: bool) -> Iterator[tuple[str, Any]]:
        keys = [key for key in self._keys() if key not in self._consumed]
        for key in tqdm(keys, desc="Loading weights", unit="tensor", disable=not show_progress):
            tensor = self._read(key)
            if not is_unplaced_zero_bias(key, tensor, self._consumed, layout):
                yield key, tensor.to(dtype)

    def close(self) -> None:
        self._stack.close()
