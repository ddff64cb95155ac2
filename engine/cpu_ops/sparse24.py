"""Python binding of the compiled 2:4-sparse projection (`sparse24.cpp`, `sparse24.h`): sparse weights on CPU.

`CpuSparse24(path)` loads a built library with ctypes. `op(x, rows)` computes ``x @ W.T`` for a float32
``x`` of 1..`max_batch` rows (unit column stride) and a 2:4 weight as `SparseRows`: the kept values of the
tidepool-2:4 layout (`engine/sparsity/format.py`; ``[out, in / 2]`` float32, or int8 with float32 ``scales
[out]``) read in place, and its metadata re-laid once at load as kept-column bitmasks (`masks_from_meta`:
``[out, ceil(in / 8)]`` uint8, bit c of byte b = column 8b + c kept; the same size, and the kernel builds its
vector masks without a lookup). Torch's intra-op thread count, the GIL released; None (nothing done) where the
call does not qualify, and the caller falls back to torch.

Why: a decode step is bound by reading the weights; the op reads only the kept values and the metadata
(0.53x of the float32 bytes), expanding them in registers (bench/sparsity_speed.py, bench/README.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from .build import open_library
from .gemv import MAX_ROWS

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class SparseStruct(ctypes.Structure):
    """sparse24.h's TpSparseWeight, field for field."""

    _fields_ = (("values", _ptr), ("masks", _ptr), ("scales", _ptr), ("int8", _i32), ("reserved", _i32))


def _nibble_table(to_masks: bool) -> torch.Tensor:
    """Per nibble value: file nibble ``i0 | i1 << 2`` -> bitmask ``1 << i0 | 1 << i1`` (or the reverse); 0 -> 0
    (the unused high nibble of an odd group count), every other nibble -> 0."""
    table = torch.zeros(16, dtype=torch.uint8)
    for i0 in range(4):
        for i1 in range(i0 + 1, 4):
            nibble, mask = i0 | i1 << 2, 1 << i0 | 1 << i1
            table[nibble if to_masks else mask] = mask if to_masks else nibble
    return table


def _map_nibbles(meta: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    low, high = table[(meta & 15).long()], table[(meta >> 4).long()]
    return (low | (high << 4)).contiguous()


def masks_from_meta(meta: torch.Tensor, in_features: int) -> torch.Tensor:
    """The file's metadata ``[out, ceil(in / 8)]`` (a nibble ``i0 | i1 << 2`` per group, `format.py`'s layout,
    already validated) as the kernel's kept-column bitmasks of the same shape (a nibble ``1 << i0 | 1 << i1``)."""
    if tuple(meta.shape[1:]) != (-(-in_features // 8),):
        raise ValueError(f"metadata of shape {tuple(meta.shape)} does not describe {in_features} input columns")
    return _map_nibbles(meta, _nibble_table(to_masks=True))


def meta_from_masks(masks: torch.Tensor) -> torch.Tensor:
    """The inverse of `masks_from_meta`: the file's layout again."""
    return _map_nibbles(masks, _nibble_table(to_masks=False))


@dataclass(frozen=True, slots=True)
class SparseRows:
    """A 2:4 projection as the compiled ops read it (contiguous CPU tensors, checked by `rows_ok`)."""

    values: torch.Tensor  # [out, in // 2] float32 or int8
    masks: torch.Tensor  # [out, ceil(in / 8)] uint8 kept-column bitmasks (`masks_from_meta`)
    scales: torch.Tensor | None  # [out] float32 for int8 values
    in_features: int

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    def struct(self) -> SparseStruct:
        """The C side's view; valid while these tensors live."""
        scales = None if self.scales is None else self.scales.data_ptr()
        return SparseStruct(self.values.data_ptr(), self.masks.data_ptr(), scales, int(self.scales is not None), 0)


def rows_ok(rows: SparseRows) -> bool:
    """Whether the compiled ops take these tensors: dtypes, shapes and layout of the tidepool-2:4 format."""
    v, m, s, k = rows.values, rows.masks, rows.scales, rows.in_features
    int8 = v.dtype == torch.int8
    return (
        v.dtype in (torch.float32, torch.int8)
        and k >= 4
        and k % 4 == 0
        and v.dim() == 2
        and tuple(v.shape) == (v.shape[0], k // 2)
        and m.dtype == torch.uint8
        and tuple(m.shape) == (v.shape[0], -(-k // 8))
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (v, m))
        and (s is not None) == int8
        and (
            s is None
            or (
                s.dtype == torch.float32
                and tuple(s.shape) == (v.shape[0],)
                and s.is_contiguous()
                and s.device == v.device
            )
        )
    )


class CpuSparse24:
    """The loaded op (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = open_library(path, "tp_sparse24_max_batch", "tp_sparse24_gemv")
        lib.tp_sparse24_gemv.argtypes = (ctypes.POINTER(SparseStruct), _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i32)
        lib.tp_sparse24_set_panel_min_inputs.restype = _i64
        lib.tp_sparse24_set_panel_min_inputs.argtypes = (_i64,)
        self._fn = lib.tp_sparse24_gemv
        self._set_panel_min = lib.tp_sparse24_set_panel_min_inputs
        self.max_batch = min(MAX_ROWS, int(lib.tp_sparse24_max_batch()))
        self.has_openmp = bool(lib.tp_has_openmp())

    def set_panel_min_inputs(self, n: int) -> int:
        """Benchmarks and tests only: as `CpuGemv.set_panel_min_inputs`; returns the previous value."""
        return int(self._set_panel_min(n))

    def accepts(self, x: torch.Tensor, rows: SparseRows) -> bool:
        return (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and 1 <= x.shape[0] <= self.max_batch
            and x.shape[1] == rows.in_features
            and x.stride(1) == 1
            and (x.shape[0] == 1 or x.stride(0) >= x.shape[1])
            and not x.requires_grad
            and rows_ok(rows)
        )

    def __call__(self, x: torch.Tensor, rows: SparseRows) -> torch.Tensor | None:
        """``x @ W.T`` (int8: times the scales) as float32 ``[batch, out]``, or None where the call does not qualify."""
        if not self.accepts(x, rows):
            return None
        out, k = rows.out_features, rows.in_features
        y = torch.empty(x.shape[0], out, dtype=torch.float32)
        weight = rows.struct()
        code = self._fn(
            ctypes.byref(weight), x.data_ptr(), y.data_ptr(), x.shape[0], out, k,
            x.stride(0) if x.shape[0] > 1 else k, out, torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"tp_sparse24_gemv refused its arguments (code {code})")
        return y
