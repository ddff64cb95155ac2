"""Python binding of the compiled CPU paged-attention op (`paged_attention.cpp`).

`CpuPagedAttention(path)` loads a built library with ctypes and checks its ABI (version and the
argument block's size) against `_Args`, which mirrors `TpAttentionArgs` field for field. A call
checks shapes, dtypes and strides (the C side checks the values: query offsets, sequence lengths,
block ids), passes raw pointers and strides, and runs with torch's current intra-op thread count,
with the GIL released (ctypes does so for every foreign call).

Semantics (those of the Triton varlen kernels and of the torch reference): for sequence i, the
query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]` are its last `n_i` positions of `seq_lens[i]`;
each attends causally to the cached keys of its sequence (within `sliding_window` keys when set).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import open_library

ABI_VERSION = 1
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ERRORS = {
    1: "inconsistent head counts, head_dim, block size, window or token count",
    2: "cu_seqlens_q is not a valid prefix sum for these seq_lens (or points past q)",
    3: "a block table is shorter than its sequence needs",
    4: "a block table holds a block id outside the cache",
    5: "dtype not supported by this build",
    6: "out of memory for the working buffers",
}

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class _Args(ctypes.Structure):
    _fields_ = (
        *((name, _ptr) for name in ("q", "out", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q")),
        *(
            (name, _i64)
            for name in (
                "q_token_stride",
                "q_head_stride",
                "out_token_stride",
                "out_head_stride",
                "cache_block_stride",
                "cache_token_stride",
                "cache_head_stride",
                "block_table_stride",
            )
        ),
        *(
            (name, _i32)
            for name in (
                "num_tokens",
                "num_seqs",
                "num_q_heads",
                "num_kv_heads",
                "head_dim",
                "block_size",
                "num_blocks",
                "block_table_width",
                "sliding_window",
                "dtype",
                "num_threads",
            )
        ),
        ("scale", ctypes.c_float),
    )


class CpuPagedAttention:
    """The loaded op; call it like the Triton launchers (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = open_library(path, "tp_abi_version", "tp_args_size", "tp_supports_dtype", "tp_paged_attention")
        if lib.tp_abi_version() != ABI_VERSION or lib.tp_args_size() != ctypes.sizeof(_Args):
            raise RuntimeError(f"{path}: ABI mismatch with {__name__} (stale build?)")
        lib.tp_supports_dtype.argtypes = [ctypes.c_int32]
        lib.tp_paged_attention.argtypes = [ctypes.POINTER(_Args)]
        self._fn = lib.tp_paged_attention
        self.has_openmp = bool(lib.tp_has_openmp())
        self.dtypes = frozenset(dt for dt, code in DTYPE_CODES.items() if lib.tp_supports_dtype(code))
        self._lib = lib  # keeps the library mapped for as long as the op lives
        # The last step's views, already checked (what is checked, dtype/shape/layout, cannot change in place;
        # the values are checked by the C side on every call).
        self._checked_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in self.dtypes and k_cache.dtype == q.dtype

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; int32 tables/lengths/offsets -> [T, Hq, D]."""
        _check_layer(q, k_cache, v_cache, self.dtypes)
        views = (block_tables, seq_lens, cu_seqlens_q)
        checked = self._checked_views  # every layer of a step passes the same three tensors: check them once
        if checked is None or any(a is not b for a, b in zip(views, checked, strict=True)):
            _check_views(*views)
            self._checked_views = views  # held, so the identities cannot be reused by other tensors
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device.type != "cpu" or out.stride(2) != 1:
            raise ValueError("out must be a CPU tensor shaped and typed like q, with a contiguous head dimension")
        if q.shape[0] == 0 or seq_lens.shape[0] == 0:
            return out
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        args = _Args(
            q.data_ptr(),
            out.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            cu_seqlens_q.data_ptr(),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            q.shape[0],
            seq_lens.shape[0],
            q.shape[1],
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            block_tables.shape[1],
            sliding_window or 0,
            DTYPE_CODES[q.dtype],
            torch.get_num_threads(),
            scale,
        )
        code = self._fn(ctypes.byref(args))
        if code:
            raise ValueError(f"CPU paged attention: {_ERRORS.get(code, f'error {code}')}")
        return out


def _check_layer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dtypes: frozenset[torch.dtype]) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("expected q [T, Hq, D] and K/V caches [num_blocks, block_size, Hkv, D] of one layout")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)} (head_dim, GQA group)")
    if q.dtype not in dtypes or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtypes q={q.dtype} cache={k_cache.dtype}: both must be one of {sorted(map(str, dtypes))}")
    if any(t.device.type != "cpu" for t in (q, k_cache, v_cache)):
        raise ValueError("the CPU op takes CPU tensors")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("q and the caches need a contiguous head dimension")


def _check_views(block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    if any(t.device.type != "cpu" for t in (block_tables, seq_lens, cu_seqlens_q)):
        raise ValueError("the CPU op takes CPU tensors")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if block_tables.dim() != 2 or (block_tables.numel() and block_tables.stride(1) != 1):
        raise ValueError("block_tables must be [num_seqs, width] with contiguous rows")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or not seq_lens.is_contiguous() or block_tables.shape[0] < num_seqs:
        raise ValueError("seq_lens must be contiguous [num_seqs], with a block table row per sequence")
    if cu_seqlens_q.shape != (num_seqs + 1,) or not cu_seqlens_q.is_contiguous():
        raise ValueError(f"cu_seqlens_q must be contiguous [num_seqs + 1] = [{num_seqs + 1}]")
