"""Python binding of the compiled float32 decode step (`decoder.cpp`): every decoder layer in one call.

`CpuDecoder(path)` loads a built library with ctypes and checks its ABI (version and the sizes of
the two argument blocks, mirrored here by `_Layer` and `_Args`). The model hands it its layers'
tensors once (`prepare`, which checks every dtype, shape and layout and returns None when anything
does not qualify: transposed weights, other dtypes, accelerators, quantized weights not laid out for
the CPU); a projection is a float32 matrix, an int8 weight whose `cpu_int8()` gives `(w_int8, scales)`,
an int4 one whose `cpu_tiles()` gives `int4_gemv.Int4Tiles` (`engine/quant/runtime.py`) or a 2:4-sparse one
whose `cpu_sparse()` gives `sparse24.SparseRows` (`engine/sparsity/weight.py`); a step then calls
`run` with the embeddings, the rotary rows, the KV caches and the attention views, and gets the
final norm's output, bit-identical to running the layers one by one with the compiled ops
(`projections.h`, `int4_tile.h`, `sparse24.h`, `fused.h` and `attention_run.h` are the same code in both).
`max_batch` is the compiled GEMV's row limit (`gemv.MAX_ROWS`): above it the layers' projections go
to torch's GEMM, and so does the step.

Invariants the caller keeps: the prepared weights are not reallocated while the prepared object
lives (load_weights copies into them in place); a step qualifies only when it is all decodes (one
query per sequence, 1..`max_batch` sequences) over float32 caches of one layout (checked whenever
the caches' storage differs from the last step's: the runner allocates them once). The C side checks
the values (query offsets, block ids, slots) and refuses, writing nothing, on any it does not take.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .build import open_library
from .gemv import MAX_ROWS
from .int4_gemv import TILE, Int4Struct, Int4Tiles
from .paged_attention import _check_views
from .sparse24 import SparseRows, SparseStruct, rows_ok

ABI_VERSION = 4
_F32 = torch.float32
_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
LAYER_FIELDS = (
    "input_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias", "post_norm",
    "gate_up_weight", "gate_up_bias", "down_weight", "down_bias", "k_cache", "v_cache",
)  # fmt: skip
_ERRORS = {
    1: "inconsistent head counts, head_dim, block size or window",
    2: "the step is not all decodes (cu_seqlens_q must be 0, 1, ..., batch) or a seq_len is 0",
    3: "a block table is shorter than its sequence needs",
    4: "a block table holds a block id outside the cache",
    6: "out of memory for the working buffers",
    7: "batch outside 1..max_batch",
    8: "a slot outside the cache",
}


# float32, int8 (`_i8`), int4 (`_q4`) or 2:4 sparse (`_sp`)
PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


class _Int8(ctypes.Structure):
    _fields_ = (("w", _ptr), ("scales", _ptr))


class _Layer(ctypes.Structure):
    _fields_ = (
        *((name, _ptr) for name in LAYER_FIELDS),
        *((name.replace("_weight", "_i8"), _Int8) for name in PROJECTIONS),
        *((name.replace("_weight", "_q4"), Int4Struct) for name in PROJECTIONS),
        *((name.replace("_weight", "_sp"), SparseStruct) for name in PROJECTIONS),
    )


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """A per-output-channel int8 projection as the step reads it: int8 ``[rows, in]`` and float32 scales ``[rows]``."""

    weight: torch.Tensor
    scales: torch.Tensor


_POINTERS = ("x", "out", "final_norm", "cos", "sin_signed", "slots", "block_tables", "seq_lens", "cu_seqlens_q")
_STRIDES = ("block_table_stride", "cache_block_stride", "cache_token_stride", "cache_head_stride")
_SIZES = (
    "num_layers", "batch", "hidden", "num_q_heads", "num_kv_heads", "head_dim", "intermediate",
    "block_size", "num_blocks", "block_table_width", "sliding_window", "num_threads",
)  # fmt: skip


class _Args(ctypes.Structure):
    _fields_ = (
        ("layers", ctypes.POINTER(_Layer)),
        *((name, _ptr) for name in _POINTERS),
        *((name, _i64) for name in _STRIDES),
        *((name, _i32) for name in _SIZES),
        ("eps", _f32),
        ("scale", _f32),
    )


@dataclass(frozen=True, slots=True)
class DecoderShape:
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


@dataclass(slots=True)
class PreparedDecoder:
    """A model's weights checked once and laid out for the op; holds the tensors it points at."""

    shape: DecoderShape
    final_norm: torch.Tensor
    layers: list[dict[str, torch.Tensor | Int8Rows | Int4Tiles | SparseRows | None]]
    _table: ctypes.Array | None = None  # the layer array, rebuilt when the caches change
    _caches: tuple[int, ...] = ()


def _matrix(t: torch.Tensor | None, rows: int, cols: int) -> bool:
    return (
        t is not None
        and type(t) in (torch.Tensor, torch.nn.Parameter)  # not a quantized weight
        and t.dtype == _F32
        and t.device.type == "cpu"
        and tuple(t.shape) == (rows, cols)
        and t.is_contiguous()
        and not t.requires_grad
    )


Projection = torch.Tensor | Int8Rows | Int4Tiles | SparseRows


def _projection(t: object, rows: int, cols: int, tile_rows: int | None = None) -> Projection | None:
    """A float32 [rows, cols] matrix as it is, an int8 weight's rows, an int4 weight's CPU tiles, a 2:4 weight's
    rows, or None when it qualifies as none of them. `tile_rows`: int4 outputs must come in whole tiles of that
    many rows (a head; the gate/up halves)."""
    if isinstance(t, torch.Tensor):
        return t if _matrix(t, rows, cols) else None
    cpu_sparse = getattr(t, "cpu_sparse", None)
    if callable(cpu_sparse):
        sparse = cpu_sparse()
        ok = isinstance(sparse, SparseRows) and rows_ok(sparse)
        return sparse if ok and (sparse.out_features, sparse.in_features) == (rows, cols) else None
    cpu_int8 = getattr(t, "cpu_int8", None)
    if callable(cpu_int8):
        found = cpu_int8()
        if found is None:
            return None
        w, scales = found
        ok = w.dtype == torch.int8 and tuple(w.shape) == (rows, cols) and w.is_contiguous() and _vector(scales, rows)
        return Int8Rows(w, scales) if ok else None
    cpu_tiles = getattr(t, "cpu_tiles", None)
    tiles = cpu_tiles() if callable(cpu_tiles) else None
    if not isinstance(tiles, Int4Tiles) or (tiles.out_features, tiles.in_features) != (rows, cols):
        return None
    return tiles if tile_rows is None or tile_rows % TILE == 0 else None


def _vector(t: torch.Tensor | None, n: int, optional: bool = False) -> bool:
    if t is None:
        return optional
    return _matrix(t.view(1, -1) if t.dim() == 1 else t, 1, n) and t.dim() == 1


class CpuDecoder:
    """The loaded op (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        names = ("tp_decoder_abi_version", "tp_decoder_args_size", "tp_decoder_layer_size", "tp_decoder_max_batch")
        lib = open_library(path, *names, "tp_decode_step_f32")
        if (
            lib.tp_decoder_abi_version() != ABI_VERSION
            or lib.tp_decoder_args_size() != ctypes.sizeof(_Args)
            or lib.tp_decoder_layer_size() != ctypes.sizeof(_Layer)
        ):
            raise RuntimeError(f"{path}: ABI mismatch with {__name__} (stale build?)")
        lib.tp_decode_step_f32.argtypes = [ctypes.POINTER(_Args)]
        self._fn = lib.tp_decode_step_f32
        self.max_batch = min(MAX_ROWS, int(lib.tp_decoder_max_batch()))  # the layer-by-layer path's GEMV limit
        self.has_openmp = bool(lib.tp_has_openmp())
        lib.tp_decoder_set_panel_min_inputs.restype = ctypes.c_int64
        lib.tp_decoder_set_panel_min_inputs.argtypes = (ctypes.c_int64,)
        self._lib = lib

    def set_panel_min_inputs(self, n: int) -> int:
        """Benchmarks only: as `CpuGemv.set_panel_min_inputs`, for the step's projections."""
        return int(self._lib.tp_decoder_set_panel_min_inputs(n))

    def prepare(
        self, shape: DecoderShape, layers: Sequence[dict[str, object]], final_norm: torch.Tensor
    ) -> PreparedDecoder | None:
        """Check every layer's tensors (keys: LAYER_FIELDS but the caches); None when any does not qualify."""
        s = shape
        q, kv = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        if s.num_q_heads % s.num_kv_heads or s.head_dim % 2 or not _vector(final_norm, s.hidden):
            return None
        prepared: list[dict[str, Projection | None]] = []
        for layer in layers:
            projections = {
                "qkv_weight": _projection(layer["qkv_weight"], q + 2 * kv, s.hidden, s.head_dim),
                "o_weight": _projection(layer["o_weight"], s.hidden, q),
                "gate_up_weight": _projection(layer["gate_up_weight"], 2 * s.intermediate, s.hidden, s.intermediate),
                "down_weight": _projection(layer["down_weight"], s.hidden, s.intermediate),
            }
            vectors: dict[str, Any] = {name: layer[name] for name in LAYER_FIELDS[:-2] if name not in PROJECTIONS}
            ok = (
                all(p is not None for p in projections.values())
                and _vector(vectors["input_norm"], s.hidden)
                and _vector(vectors["post_norm"], s.hidden)
                and _vector(vectors["qkv_bias"], q + 2 * kv, optional=True)
                and _vector(vectors["o_bias"], s.hidden, optional=True)
                and _vector(vectors["gate_up_bias"], 2 * s.intermediate, optional=True)
                and _vector(vectors["down_bias"], s.hidden, optional=True)
            )
            if not ok:
                return None
            prepared.append({**vectors, **projections})
        return PreparedDecoder(shape, final_norm, prepared)

    def run(
        self,
        prepared: PreparedDecoder,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        sliding_window: int | None,
    ) -> torch.Tensor | None:
        """The final norm's output [batch, hidden], or None (nothing done) when the step does not qualify."""
        s = prepared.shape
        batch = x.shape[0] if x.dim() == 2 else 0
        if not (
            1 <= batch <= self.max_batch
            and _matrix(x, batch, s.hidden)
            and _matrix(cos, batch, s.head_dim)
            and _matrix(sin_signed, batch, s.head_dim)
            and slots.dtype == torch.int64
            and slots.shape == (batch,)
            and slots.is_contiguous()
            and len(kv_caches) == len(prepared.layers)
        ):
            return None
        caches = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if caches != prepared._caches and not self._caches_ok(kv_caches, s):  # the runner's caches: checked once
            return None
        _check_views(block_tables, seq_lens, cu_seqlens_q)
        if seq_lens.shape[0] != batch:
            return None
        table = self._table(prepared, kv_caches, caches)
        k0 = kv_caches[0][0]
        num_blocks, block_size = k0.shape[0], k0.shape[1]
        out = torch.empty(batch, s.hidden, dtype=_F32)
        args = _Args(
            table,
            x.data_ptr(), out.data_ptr(), prepared.final_norm.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
            slots.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
            block_tables.stride(0), k0.stride(0), k0.stride(1), k0.stride(2),
            len(prepared.layers), batch, s.hidden, s.num_q_heads, s.num_kv_heads, s.head_dim, s.intermediate,
            block_size, num_blocks, block_tables.shape[1], sliding_window or 0, torch.get_num_threads(),
            s.eps, s.scale,
        )  # fmt: skip
        code = self._fn(ctypes.byref(args))
        if code:
            raise ValueError(f"CPU decode step: {_ERRORS.get(code, f'error {code}')}")
        return out

    @staticmethod
    def _caches_ok(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], s: DecoderShape) -> bool:
        k0 = kv_caches[0][0]
        if not (k0.dtype == _F32 and k0.device.type == "cpu" and k0.dim() == 4 and k0.stride(3) == 1):
            return False
        if k0.shape[2:] != (s.num_kv_heads, s.head_dim):
            return False
        shape, strides = k0.shape, k0.stride()
        return all(
            t.dtype == _F32 and t.device.type == "cpu" and t.shape == shape and t.stride() == strides
            for pair in kv_caches
            for t in pair
        )

    @staticmethod
    def _table(
        prepared: PreparedDecoder, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], caches: tuple[int, ...]
    ) -> ctypes.Array:
        if prepared._table is None or caches != prepared._caches:
            table = (_Layer * len(prepared.layers))()
            for entry, layer, (k, v) in zip(table, prepared.layers, kv_caches, strict=True):
                for name in LAYER_FIELDS[:-2]:
                    t = layer[name]
                    if isinstance(t, Int4Tiles):  # the float32 pointer stays null
                        setattr(entry, name.replace("_weight", "_q4"), t.struct())
                    elif isinstance(t, SparseRows):
                        setattr(entry, name.replace("_weight", "_sp"), t.struct())
                    elif isinstance(t, Int8Rows):
                        setattr(entry, name.replace("_weight", "_i8"), _Int8(t.weight.data_ptr(), t.scales.data_ptr()))
                    else:
                        setattr(entry, name, None if t is None else t.data_ptr())
                entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
            prepared._table, prepared._caches = table, caches
        return prepared._table
