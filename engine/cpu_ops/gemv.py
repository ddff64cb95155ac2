"""Python binding of the compiled small-batch GEMV (`gemv.cpp`): decode's projections on CPU.

`CpuGemv(path)` loads a built library with ctypes. `gemv(x, weight)` computes `x @ weight.T` for a
float32 `x` of 1..`max_batch` rows (`MAX_ROWS`) and a contiguous float32 `[out, in]` weight, with
torch's current intra-op thread count and the GIL released; `accepts(x, weight)` says whether a call
qualifies (the caller falls back to `F.linear` otherwise: long prefill chunks, other dtypes,
quantized or sliced weights). `int8(x, w_int8, scales)` is the same for per-output-channel int8
weights with float32 scales (`engine/quant/runtime.py`'s `Int8Weight` on CPU), or None.

Why: at 2-8 rows torch's CPU GEMM reads the weights at a fraction of the bandwidth it reaches at one
row (measured in bench/gemv.py), so a decode batch of a few requests cost several times one request
although the weights are read once either way; at 9-32 rows a decode step through MKL took twice
the time of one at 8. The kernel reads each weight row once per call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import open_library

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

# Input rows a call takes. Above 8 the row kernel runs the inputs in groups of 8 over each block of weight
# rows, and from 24 (16 with 16-float vectors) the packed-panel kernel takes them (gemv.cpp, panel.h): one
# read of the weights, arithmetic that grows with the rows. Measured in the engine, before the panel kernel,
# on SmolLM2 against the torch path it replaces (bench/decode_batches.py; bench/README.md, "Weights in
# huge pages; decode batches above 8"): decode steps 1.1-1.7x faster at 9-64 sequences, 0.93x at 96,
# 1.37x at 128; a microbenchmark with the weights cache-hot has MKL ahead from ~192 rows, where
# prefill-sized products belong to it. With 16-float vectors (an Intel AVX-512 VM) the one-call step at
# 256 rows measured even with MKL at 160 sequences (one round: 138 vs 137 ms), so the limit stays.
MAX_ROWS = 128


class CpuGemv:
    """The loaded op (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = open_library(path, "tp_gemv_max_batch", "tp_gemv_f32", "tp_gemv_i8")
        lib.tp_gemv_f32.argtypes = (_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i32)
        lib.tp_gemv_i8.argtypes = (_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i32)
        lib.tp_gemv_set_panel_min_inputs.restype = _i64
        lib.tp_gemv_set_panel_min_inputs.argtypes = (_i64,)
        self._fn = lib.tp_gemv_f32
        self._fn_i8 = lib.tp_gemv_i8
        self._set_panel_min = lib.tp_gemv_set_panel_min_inputs
        lib.tp_gemv_panel_min_inputs.restype = _i64
        self.panel_min_inputs = int(lib.tp_gemv_panel_min_inputs())  # inputs from which the panel kernel runs
        self.max_batch = min(MAX_ROWS, int(lib.tp_gemv_max_batch()))
        self.has_openmp = bool(lib.tp_has_openmp())

    def set_panel_min_inputs(self, n: int) -> int:
        """Benchmarks only: the fewest inputs that take the packed-panel kernel (a value above `max_batch`:
        never, the row kernel only); returns the previous value."""
        return int(self._set_panel_min(n))

    def accepts(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        plain = type(weight) in (torch.Tensor, torch.nn.Parameter)  # not a quantized weight (it answers F.linear)
        return plain and self._takes(x, weight, torch.float32)

    def accepts_int8(self, x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether `int8` takes the call: int8 `[out, in]` weights and float32 per-row scales `[out]`."""
        return (
            self._takes(x, w_int8, torch.int8)
            and scales.dtype == torch.float32
            and scales.device.type == "cpu"
            and tuple(scales.shape) == (w_int8.shape[0],)
            and scales.is_contiguous()
        )

    def _takes(self, x: torch.Tensor, weight: torch.Tensor, weight_dtype: torch.dtype) -> bool:
        return (
            weight.dtype == weight_dtype
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and x.dim() == 2
            and 1 <= x.shape[0] <= self.max_batch
            and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1
            and (x.shape[0] == 1 or x.stride(0) >= x.shape[1])
            and weight.is_contiguous()
            and not (x.requires_grad or weight.requires_grad)
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = self.try_call(x, weight)
        if y is None:
            raise ValueError(
                f"gemv takes float32 x [1..{self.max_batch}, in] (unit stride) and a contiguous float32 [out, in] "
                f"weight; got x {tuple(x.shape)} {x.dtype} strides {x.stride()}, weight {tuple(weight.shape)} "
                f"{weight.dtype} contiguous={weight.is_contiguous()}"
            )
        return y

    def int8(self, x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
        """`(x @ w_int8.T) * scales` (per-output-channel int8), or None (nothing done) where it does not qualify."""
        if not self.accepts_int8(x, w_int8, scales):
            return None
        rows, cols = w_int8.shape
        y = torch.empty(x.shape[0], rows, dtype=torch.float32)
        code = self._fn_i8(
            w_int8.data_ptr(), scales.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], rows, cols,
            x.stride(0) if x.shape[0] > 1 else cols, rows, torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"tp_gemv_i8 refused its arguments (code {code})")
        return y

    def try_call(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """`x @ weight.T`, or None (nothing done) when the call does not qualify: one check per call."""
        if not self.accepts(x, weight):
            return None
        rows, cols = weight.shape
        y = torch.empty(x.shape[0], rows, dtype=torch.float32)
        code = self._fn(
            weight.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], rows, cols,
            x.stride(0) if x.shape[0] > 1 else cols, rows,
            torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"tp_gemv_f32 refused its arguments (code {code})")
        return y
