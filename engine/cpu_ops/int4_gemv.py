"""Python binding of the compiled group-wise int4 matmul (`int4_gemv.cpp`): quantized projections on CPU.

`CpuInt4Gemv(path)` loads a built library with ctypes. The op reads the weight in tiles of 16
output columns (`TILE`): `tile_weight(qweight, scales, zeros, group_size, mins)` turns Tidepool's int4
layout (`kernels/int4_packing.py`: int32 ``qweight [K/8, N]``, scales and offsets ``[K/g, N]``) into
`Int4Tiles` once, at load (`engine/quant/runtime.py`); `op(x, tiles)` then computes ``x @ W`` for a
float32 ``x [M, K]`` (unit column stride, any M) with torch's intra-op thread count and the GIL
released. Scales and offsets stay in their dtype (float32, bfloat16 or float16, one for both).

Why: the torch path (`kernels/dispatch.py`, unpacking into float matrices and batched matmuls) made
an int4 model 2-9x slower than the same model dense on CPU (bench/quant.py, bench/quantized_decode.py);
this reads each packed weight once and applies the scale and offset once per group.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from ...kernels.int4_packing import check_int4_shapes, offset_args
from .build import open_library

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C side's scale_dtype codes
TILE = 16  # output columns per tile (int4_gemv.cpp's TILE, checked against the library at load)


@dataclass(frozen=True)
class Int4Tiles:
    """An int4 weight re-laid for the op: N padded to a multiple of TILE with zero columns.

    qweight ``[T, K/8, TILE]`` int32; scales and offset ``[T, K/g, TILE]``; `mins`: the offset is
    the value code 0 stands for (``W = q * s + m``), else a zero point (``W = (q - z) * s``)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offset: torch.Tensor
    mins: bool
    out_features: int
    in_features: int
    group_size: int

    def struct(self) -> Int4Struct:
        """The C side's view (`TpInt4Weight`); valid while these tensors live."""
        return Int4Struct(
            self.qweight.data_ptr(), self.scales.data_ptr(), self.offset.data_ptr(), SCALE_DTYPES[self.scales.dtype],
            int(self.mins), self.group_size,
        )  # fmt: skip


class Int4Struct(ctypes.Structure):
    """int4_tile.h's TpInt4Weight, field for field."""

    _fields_ = (
        ("q", _ptr), ("scales", _ptr), ("offsets", _ptr), ("scale_dtype", _i32), ("mins", _i32), ("group", _i64),
    )  # fmt: skip


def tile_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, mins: torch.Tensor | None
) -> Int4Tiles:
    """`Int4Tiles` from the int4 layout (exactly one of `zeros` / `mins`); ValueError on a malformed layout."""
    offset, is_min = offset_args(zeros, mins)
    if offset.dtype != scales.dtype or scales.dtype not in SCALE_DTYPES:
        wanted = ", ".join(str(d) for d in SCALE_DTYPES)
        raise ValueError(f"scales and offsets must share one dtype of {wanted}; got {scales.dtype}, {offset.dtype}")
    k = check_int4_shapes(qweight, scales, offset, group_size)
    n = qweight.shape[1]
    tiles = -(-n // TILE)

    def by_tile(t: torch.Tensor) -> torch.Tensor:  # [R, N] -> [T, R, TILE], zero columns appended
        padded = torch.nn.functional.pad(t, (0, tiles * TILE - n))
        return padded.view(t.shape[0], tiles, TILE).transpose(0, 1).contiguous()

    return Int4Tiles(by_tile(qweight), by_tile(scales), by_tile(offset), is_min, n, k, group_size)


class CpuInt4Gemv:
    """The loaded op (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = open_library(path, "tp_int4_has_float16", "tp_int4_tile", "tp_int4_gemv")
        lib.tp_int4_gemv.argtypes = (_ptr, _i64, ctypes.POINTER(Int4Struct), _ptr, _i64, _i64, _i64, _i64, _i32)
        if int(lib.tp_int4_tile()) != TILE:
            raise RuntimeError(f"{path}: the library's tile width is {int(lib.tp_int4_tile())}, this binding's {TILE}")
        self._fn = lib.tp_int4_gemv
        self.has_openmp = bool(lib.tp_has_openmp())
        self.has_float16 = bool(lib.tp_int4_has_float16())  # float16 scales need the compiler's _Float16

    def takes_scales(self, dtype: torch.dtype) -> bool:
        """Whether this build reads scales of `dtype` (float16 needs the compiler's _Float16)."""
        return dtype in SCALE_DTYPES and (dtype != torch.float16 or self.has_float16)

    def __call__(self, x: torch.Tensor, w: Int4Tiles) -> torch.Tensor:
        """``x [M, K] @ W`` as float32 ``[M, N]``; `x` is converted to a float32 with unit column stride if needed."""
        if x.dim() != 2 or x.shape[1] != w.in_features or x.shape[0] < 1:
            raise ValueError(f"int4 gemv takes x [M >= 1, {w.in_features}], got {tuple(x.shape)}")
        if x.dtype != torch.float32 or x.stride(1) != 1 or x.device.type != "cpu":
            x = x.to(device="cpu", dtype=torch.float32).contiguous()
        if not self.takes_scales(w.scales.dtype):
            raise ValueError(f"this build of the int4 op cannot read {w.scales.dtype} scales")
        y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
        code = self._fn(
            x.data_ptr(), x.stride(0) if x.shape[0] > 1 else w.in_features, ctypes.byref(w.struct()), y.data_ptr(),
            w.out_features, x.shape[0], w.out_features, w.in_features, torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"tp_int4_gemv refused its arguments (code {code})")
        return y
