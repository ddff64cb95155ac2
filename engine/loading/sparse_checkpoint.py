"""The reader of tidepool-2:4 folders: a Hugging Face folder whose sparse projections load as `SparseWeight`s.

`formats.open_checkpoint` returns a `SparseCheckpoint` for a folder whose config.json has a ``sparsity_config``
(`sparsity/format.py`). It is the safetensors reader with one stage changed: the swapped-in weights are the 2:4
projections (`sparsity.load.sparse_weights`, fused as the model fuses); every other tensor loads densely, and the
sparse tensors they were made from are not offered to `load_weights` again.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..quant.runtime import QuantizedWeight
from ..sparsity.format import SparsityConfig
from ..sparsity.load import sparse_weights
from .safetensors import SafetensorsCheckpoint


class SparseCheckpoint(SafetensorsCheckpoint):
    """A tidepool-2:4 folder (see the module docstring)."""

    def __init__(self, folder: Path, sparsity: SparsityConfig) -> None:
        super().__init__(folder, None)
        self.sparsity = sparsity

    def quantized_weights(
        self, model: nn.Module, dtype: torch.dtype, show_progress: bool
    ) -> dict[str, QuantizedWeight]:
        keys = set(self._keys())
        weights, self._consumed = sparse_weights(model, keys, self._read, dtype, show_progress)
        return weights
