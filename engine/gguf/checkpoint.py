"""A GGUF file as the loading layer reads it (`engine/loading/`): config, quantized projections, dense tensors.

`GGUFCheckpoint` answers the loading layer's three questions for one file, in its stage order: the
config (`config.model_config_from_gguf`, which parses and checks the file — types, architecture —
before anything is allocated), the projections to swap in as quantized weights when a mode is asked
(`quantized.py`: "gguf" keeps Q8_0/Q4_0/Q4_1, "int8"/"int4" quantize at load), and every remaining
tensor, dequantized into the model through its own `load_weights`, which reports any tensor the file
lacks or that has the wrong shape (re-raised as `GGUFError` naming the file). A progress bar counts
tensors. This module builds no model: it knows the model only by `checkpoint_layout()` / `load_weights`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..quant.runtime import QuantizedWeight
from .config import model_config_from_gguf
from .errors import GGUFError
from .quantized import MODES, quantized_weights
from .reader import open_gguf
from .tensors import WeightSource


class GGUFCheckpoint:
    """One GGUF file; `quantization` None (dequantize), "gguf", "int8" or "int4"."""

    def __init__(self, path: str | Path, quantization: str | None) -> None:
        if quantization is not None and quantization not in MODES:
            raise ValueError(
                f"quantization={quantization!r} does not apply to a GGUF file; use None (dequantize to dtype), "
                f"{', '.join(repr(m) for m in MODES)}"
            )
        self.gguf = open_gguf(path)
        self.path = self.gguf.path
        self.quantization = quantization
        self._source: WeightSource | None = None
        self._consumed: set[str] = set()

    def read_config(self) -> ModelConfig:
        config = model_config_from_gguf(self.gguf)
        self._source = WeightSource(self.gguf, config.num_attention_heads, config.num_key_value_heads)
        return config

    def _weights(self) -> WeightSource:
        if self._source is None:
            raise RuntimeError("read_config comes first: the tensors' row order depends on the head counts")
        return self._source

    def quantized_weights(
        self, model: nn.Module, dtype: torch.dtype, show_progress: bool
    ) -> dict[str, QuantizedWeight]:
        if self.quantization is None:
            return {}
        weights, self._consumed = quantized_weights(model, self._weights(), self.quantization, dtype, show_progress)
        return weights

    def load_dense(self, model: nn.Module, dtype: torch.dtype, show_progress: bool) -> None:
        source = self._weights()
        names = [name for name in source.by_hf_name if name not in self._consumed]
        weights = source.iter_dense(names, dtype)
        bar = tqdm(weights, total=len(names), desc="Loading GGUF weights", unit="tensor", disable=not show_progress)
        try:
            model.load_weights(bar)
        except GGUFError:
            raise
        except ValueError as err:
            raise GGUFError(f"{self.path}: {err}") from None

    def close(self) -> None:
        """Nothing to release: the parsed file stays cached per process (`reader.open_gguf`)."""
