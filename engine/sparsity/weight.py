"""Runtime 2:4-sparse weights: a drop-in for a built model's dense projection weight, as the quantized ones are.

Role: the "swap" half of sparsity (the loader, `load.py`, makes them; `quant.runtime.swap_weight` puts them in
place of the dense parameter). A `SparseWeight` holds a projection in the tidepool-2:4 layout of `format.py`
(kept values ``[out, in / 2]``, float32/float16/bfloat16 or int8 with per-row float32 ``scales``, and the
metadata ``[out, ceil(in / 8)]``) and answers ``F.linear`` only (`QuantizedWeight.__torch_function__`):
- CPU, float32 inputs of 1..`max_batch` rows: the compiled op (`engine/cpu_ops/sparse24.py`), which reads only
  the kept values and metadata; `prepare_for_cpu` (the model runner calls it once, at load) re-lays the metadata
  as the op's kept-column bitmasks (same size) and widens float16/bfloat16 values to float32. The one-call
  decode step reads the same tensors (`cpu_sparse()`).
- CUDA: torch's semi-structured sparse tensor (`cuda.py`), built once from the unpacked weight.
- Elsewhere (longer prefill chunks, other dtypes, no compiler): the unpacked dense weight through F.linear.

Invariants:
- The values and metadata are validated (`format.validate`, naming the tensor) when the weight is made; every
  path computes the product with the same pruned weight, so they agree up to float summation order.
- A fused projection (q/k/v, gate/up) is one `SparseWeight` concatenated along N (`fuse_sparse`): the layout
  is row by row, so concatenation is exact.
- `cpu_layout`: `meta` holds the CPU op's bitmasks, not the file's nibbles (`dense()` converts back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cpu_ops
from ..cpu_ops.sparse24 import SparseRows, masks_from_meta, meta_from_masks
from ..quant.runtime import QuantizedWeight
from .cuda import semi_structured_linear
from .format import unpack_2to4, validate

CPU_VALUE_DTYPES = (torch.float32, torch.int8)  # what the compiled op reads; other float values are widened


class SparseWeight(QuantizedWeight):
    """A 2:4-sparse ``[out, in]`` weight (see the module docstring)."""

    def __init__(
        self,
        values: torch.Tensor,
        meta: torch.Tensor,
        in_features: int,
        scales: torch.Tensor | None = None,
        name: str = "weight",
    ) -> None:
        super().__init__()
        validate(name, values, meta, in_features, scales)
        self.name = name
        self.out_features, self.in_features = values.shape[0], in_features
        self.register_buffer("values", values)
        self.register_buffer("meta", meta)
        self.register_buffer("scales", scales)
        self.cpu_layout = False
        self.semi: torch.Tensor | None = None  # the CUDA semi-structured tensor, built on first use (`cuda.py`)

    @property
    def is_int8(self) -> bool:
        return self.values.dtype == torch.int8

    def file_meta(self) -> torch.Tensor:
        """The metadata in the file's layout (nibbles ``i0 | i1 << 2``), whatever the CPU layout."""
        return meta_from_masks(self.meta) if self.cpu_layout else self.meta

    def dense(self) -> torch.Tensor:
        """The unpacked ``[out, in]`` weight (values' dtype; float32 ``values * scales`` for int8)."""
        return unpack_2to4(self.values, self.file_meta(), self.in_features, self.scales, self.name)

    def prepare_for_cpu(self) -> bool:
        """Lay the weight out for the compiled CPU op (bitmask metadata, float32 values unless int8) when that op is
        available here; returns whether it is ready for it."""
        if self.cpu_layout:
            return True
        if cpu_ops.sparse24_op() is None or self.values.device.type != "cpu":
            return False
        if self.values.dtype not in CPU_VALUE_DTYPES:
            self.values = self.values.to(torch.float32)
        self.values = self.values.contiguous()
        self.meta = masks_from_meta(self.meta.contiguous(), self.in_features)
        self.cpu_layout = True
        return True

    def cpu_sparse(self) -> SparseRows | None:
        """The tensors as the compiled op and the one-call decode step read them, or None where they cannot."""
        if not self.cpu_layout or self.values.device.type != "cpu":
            return None
        return SparseRows(self.values, self.meta, self.scales, self.in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cuda":
            return semi_structured_linear(self, x, bias)
        y = self._cpu_linear(x) if x.device.type == "cpu" and x.dtype == torch.float32 else None
        if y is None:
            return F.linear(x, self.dense().to(x.dtype), bias)
        return y if bias is None else y + bias

    def _cpu_linear(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = self.cpu_sparse() if self.prepare_for_cpu() else None
        op = cpu_ops.sparse24_op()
        y = None if rows is None or op is None else op(x.reshape(-1, self.in_features), rows)
        return None if y is None else y.view(*x.shape[:-1], self.out_features)


def fuse_sparse(parts: list[SparseWeight], name: str) -> SparseWeight:
    """The parts of a fused projection (q/k/v, gate/up) as one weight, concatenated along N in the given order."""
    first = parts[0]
    for part in parts[1:]:
        if part.in_features != first.in_features or part.values.dtype != first.values.dtype:
            raise ValueError(
                f"{name}: fused parts {first.name} ({first.values.dtype}, {first.in_features} inputs) and {part.name} "
                f"({part.values.dtype}, {part.in_features} inputs) must share the values' dtype and input width"
            )
    if len(parts) == 1:
        return first
    scales = torch.cat([p.scales for p in parts]) if first.is_int8 else None
    values = torch.cat([p.values for p in parts])
    meta = torch.cat([p.file_meta() for p in parts])
    return SparseWeight(values, meta, first.in_features, scales, name)
