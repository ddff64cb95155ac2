"""Python binding of the compiled fused elementwise ops of a decoder layer (`fused.cpp`), float32 CPU.

`CpuFused(path)` loads a built library with ctypes. Each op has the contract of the torch code it
replaces and returns None, having done nothing, when a call does not qualify (another dtype or
device, strides it does not take; `*_accepts` says so up front): the caller then runs the torch
path. One check per call: at batch 1 the checks cost as much as the arithmetic.

- `add_rms_norm(x, residual, weight, eps)` -> (normed, new residual): `RMSNorm.forward`'s contract;
  out of place (neither input is written), the new residual is `x + residual`, or `x` itself.
- `silu_mul(gate_up)` -> silu(gate) * up for a fused `[rows, 2 * inter]` projection (gate first).
- `rotary_(x, cos, sin_signed)`: `apply_rotary_`'s in-place rotation of `[tokens, heads, dim]`.
- `store_kv(k, v, k_cache, v_cache, slots)`: `store_kv`'s copy into the paged cache; a slot outside
  the cache raises ValueError (as index_copy_ raises IndexError) before anything is written past it.

Why: at small batch these are ~100 aten calls per layer (dispatch, allocation, views) around a few
thousand floats of arithmetic; one foreign call each costs a few microseconds (bench/README.md).
Every call passes torch's current intra-op thread count; the op uses one thread for small calls.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import open_library

ABI_VERSION = 1
_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_F32 = torch.float32


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == _F32 and t.device.type == "cpu"


def _rows(t: torch.Tensor) -> bool:
    """A 2-D float32 CPU tensor whose rows are contiguous (any row stride)."""
    return _plain(t) and t.dim() == 2 and t.stride(1) == 1 and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])


def _token_rows(t: torch.Tensor) -> bool:
    """A 3-D [tokens, heads, dim] tensor whose heads of a token are contiguous (any token stride)."""
    tokens, heads, dim = t.shape
    return t.stride(2) == 1 and t.stride(1) == dim and (tokens <= 1 or t.stride(0) >= heads * dim)


class CpuFused:
    """The loaded ops (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = open_library(path, "tp_fused_abi_version")
        if lib.tp_fused_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI mismatch with {__name__} (stale build?)")
        self.has_openmp = bool(lib.tp_has_openmp())
        signatures = {
            "tp_add_rms_norm_f32": (_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _i32),
            "tp_silu_mul_f32": (_ptr, _ptr, _i64, _i64, _i64, _i64, _i32),
            "tp_rotary_f32": (_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32),
            "tp_store_kv_f32": (_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64),
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
        self._norm, self._silu_mul = lib.tp_add_rms_norm_f32, lib.tp_silu_mul_f32
        self._rotary, self._store_kv = lib.tp_rotary_f32, lib.tp_store_kv_f32

    # ---- RMSNorm with the residual add ----------------------------------------------------------
    def norm_accepts(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
        return (
            _rows(x)
            and (residual is None or (_rows(residual) and residual.shape == x.shape))
            and _plain(weight)
            and weight.dim() == 1
            and weight.shape[0] == x.shape[1]
            and weight.is_contiguous()
        )

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.norm_accepts(x, residual, weight):
            return None
        rows, n = x.shape
        out = torch.empty(rows, n, dtype=_F32)
        new_residual = x if residual is None else torch.empty(rows, n, dtype=_F32)
        code = self._norm(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            new_residual.data_ptr(), rows, n, x.stride(0) if rows > 1 else n,
            n if residual is None or rows <= 1 else residual.stride(0), n,
            new_residual.stride(0) if rows > 1 else n, eps, torch.get_num_threads(),
        )  # fmt: skip
        _check(code, "tp_add_rms_norm_f32")
        return out, new_residual

    # ---- SwiGLU ---------------------------------------------------------------------------------
    def silu_mul_accepts(self, gate_up: torch.Tensor) -> bool:
        return _rows(gate_up) and gate_up.shape[1] % 2 == 0 and gate_up.shape[1] > 0

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        if not self.silu_mul_accepts(gate_up):
            return None
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=_F32)
        ld_in = gate_up.stride(0) if rows > 1 else 2 * inter
        _check(self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, ld_in, inter,
                              torch.get_num_threads()), "tp_silu_mul_f32")  # fmt: skip
        return out

    # ---- rotary ---------------------------------------------------------------------------------
    def rotary_accepts(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> bool:
        if not (_plain(x) and x.dim() == 3 and _plain(cos) and _plain(sin_signed)):
            return False
        tokens, _, dim = x.shape
        return (
            dim % 2 == 0
            and _token_rows(x)
            and cos.shape == sin_signed.shape == (tokens, dim)
            and cos.is_contiguous()
            and sin_signed.is_contiguous()
        )

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
        if not self.rotary_accepts(x, cos, sin_signed):
            return None
        tokens, heads, dim = x.shape
        ldx = x.stride(0) if tokens > 1 else heads * dim
        _check(self._rotary(x.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), tokens, heads, dim, ldx,
                            torch.get_num_threads()), "tp_rotary_f32")  # fmt: skip
        return x

    # ---- KV store -------------------------------------------------------------------------------
    def store_kv_accepts(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> bool:
        if not (_plain(k) and _plain(v) and _plain(k_cache) and _plain(v_cache) and k.dim() == 3):
            return False
        tokens, heads, dim = k.shape
        return (
            v.shape == k.shape
            and k_cache.shape == v_cache.shape
            and k_cache.dim() == 4
            and tuple(k_cache.shape[2:]) == (heads, dim)
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and _token_rows(k)
            and _token_rows(v)
            and slots.dtype == torch.int64
            and slots.device.type == "cpu"
            and slots.shape == (tokens,)
            and slots.is_contiguous()
        )

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> bool:
        """True when stored; False (nothing written) when the call does not qualify."""
        if not self.store_kv_accepts(k, v, k_cache, v_cache, slots):
            return False
        tokens, heads, dim = k.shape
        width = heads * dim
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        ldk, ldv = (k.stride(0), v.stride(0)) if tokens > 1 else (width, width)
        code = self._store_kv(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                              tokens, width, ldk, ldv, num_slots)  # fmt: skip
        if code == -2:
            raise ValueError(f"store_kv: a slot is outside the cache's {num_slots} slots")
        _check(code, "tp_store_kv_f32")
        return True


def _check(code: int, name: str) -> None:
    if code != 0:
        raise RuntimeError(f"{name} refused its arguments (code {code})")
