"""Compiled CPU ops for the engine's hot path, built on first use and cached per machine.

Today: paged attention that reads the KV cache in place (`paged_attention.py` binds
`paged_attention.cpp` and the headers beside it); the small-batch GEMV of decode's projections
(`gemv.py` binds `gemv.cpp`, float32 and int8 weights; `engine/layers/linear.py` and
`engine/quant/runtime.py` call it); the group-wise int4 matmul of quantized projections
(`int4_gemv.py` binds `int4_gemv.cpp`; `engine/quant/runtime.py` calls it); the fused elementwise
work of a layer (`fused.py` binds `fused.cpp`: RMSNorm with the residual add, SwiGLU, rotary, the KV
store; `engine/layers/` calls them); and a whole float32 decode step of the decoder layers in one
call, over float32, int8 or int4 projection weights (`decoder.py` binds `decoder.cpp`, made of the
same pieces; `engine/models/llama.py` calls it for steps of 1..8 decodes, where per-call overhead
was a quarter to a third of the step).

Route: plain `g++` on a self-contained C++ file (no torch headers), loaded with ctypes. Chosen over
`torch.utils.cpp_extension` because including torch's headers (pybind11 + ATen) costs tens of
seconds of compile time per build on a 2-core CI machine and ties the library to torch's C++ ABI;
this source builds in a few seconds and only exchanges raw pointers and strides. What an extension
would give for free is done by hand in `build.py`: a cache keyed on source, torch version,
compiler, flags and CPU; a file lock so concurrent processes build once; atomic installation; and
linking torch's own OpenMP runtime so the op shares torch's thread pool and thread count. The
price: the op is an opaque Python call (not a `torch.library` op), so `torch.compile` graph-breaks
around it; the engine does not compile the attention call.

Which path runs is decided once per process and op, on first use (the engine's warm-up step,
`ModelRunner.warm_up`, before it reports ready), and logged in one line:

    TIDEPOOL_CPU_ATTENTION=auto      (default) the compiled op; the torch path when it cannot be built
    TIDEPOOL_CPU_ATTENTION=torch     always the torch path (reference, benchmarks, an off-switch)
    TIDEPOOL_CPU_ATTENTION=compiled  the compiled op or an error (CI and benchmarks that must measure it)
    TIDEPOOL_CPU_GEMV=auto|torch|compiled   the same for the GEMV (torch: F.linear everywhere)
    TIDEPOOL_CPU_FUSED=auto|torch|compiled  the same for the fused elementwise ops
    TIDEPOOL_CPU_DECODER=auto|torch|compiled  the same for the one-call decode step, which runs only
                                    where the attention, GEMV and fused ops are all compiled too
    TIDEPOOL_CPU_INT4=auto|torch|compiled   the same for int4 projections (torch: kernels.dispatch)
    TIDEPOOL_CPU_SPARSE24=auto|torch|compiled  the same for 2:4-sparse projections (`sparse24.py` binds
                                    `sparse24.cpp`; `engine/sparsity/weight.py` calls it; torch: unpack + F.linear)
    TIDEPOOL_CPU_LORA=auto|torch|compiled  the same for the multi-LoRA apply (`lora.py` binds `lora.cpp`;
                                    `engine/lora/ops.py` calls it; torch: kernels.lora_ref)

Prebuilt first: where `TIDEPOOL_CPU_OPS_DIR` names a directory `tidepool build-ops` wrote (an engine image
carries one), the library for the best ISA this CPU runs is loaded from it and nothing is compiled
(prebuilt.py; it logs which variant once); otherwise, or where it has nothing for this CPU and process,
the op is built here as below, said once (a WARNING when a directory was named).
`CXX` picks the compiler; `TIDEPOOL_CACHE` moves the cache (default ~/.cache/tidepool).
`TIDEPOOL_CPU_VECTOR_WIDTH=auto|8|16` sets the SIMD width the ops are built with (`vec.h`; auto: 16 floats
where the CPU has AVX-512, else 8); `TIDEPOOL_CPU_PREFETCH_BYTES=auto|off|<bytes>` how far ahead the
weight streams prefetch (auto: 4096); `TIDEPOOL_CPU_PREFETCH_CACHE=auto|l2|l1` the cache level software
prefetches (weights and KV rows) fill (auto: L2). The log line above says what a library has.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from . import prebuilt
from .build import BuildUnavailable
from .decoder import CpuDecoder
from .fused import CpuFused
from .gemv import CpuGemv
from .int4_gemv import CpuInt4Gemv
from .lora import CpuLora
from .paged_attention import CpuPagedAttention
from .sparse24 import CpuSparse24

__all__ = [
    "DECODER_MODE_ENV",
    "FUSED_MODE_ENV",
    "GEMV_MODE_ENV",
    "INT4_MODE_ENV",
    "LORA_MODE_ENV",
    "MODES",
    "MODE_ENV",
    "SPARSE24_MODE_ENV",
    "CpuDecoder",
    "CpuFused",
    "CpuGemv",
    "CpuInt4Gemv",
    "CpuLora",
    "CpuPagedAttention",
    "CpuSparse24",
    "decoder_op",
    "fused_op",
    "gemv_op",
    "int4_op",
    "lora_op",
    "paged_attention_op",
    "reset",
    "sparse24_op",
]  # fmt: skip

MODE_ENV = "TIDEPOOL_CPU_ATTENTION"
GEMV_MODE_ENV = "TIDEPOOL_CPU_GEMV"
FUSED_MODE_ENV = "TIDEPOOL_CPU_FUSED"
DECODER_MODE_ENV = "TIDEPOOL_CPU_DECODER"
INT4_MODE_ENV = "TIDEPOOL_CPU_INT4"
SPARSE24_MODE_ENV = "TIDEPOOL_CPU_SPARSE24"
LORA_MODE_ENV = "TIDEPOOL_CPU_LORA"
MODES = ("auto", "torch", "compiled")

logger = logging.getLogger(__name__)
Op = TypeVar("Op", CpuPagedAttention, CpuGemv, CpuFused, CpuDecoder, CpuInt4Gemv, CpuSparse24, CpuLora)

_lock = threading.Lock()
_resolved: dict[
    str, CpuPagedAttention | CpuGemv | CpuFused | CpuDecoder | CpuInt4Gemv | CpuSparse24 | CpuLora | None
] = {}


def paged_attention_op() -> CpuPagedAttention | None:
    """The compiled attention op, or None where the torch path is to be used (decided once, logged once)."""
    return _op("CPU attention", MODE_ENV, "paged_attention", CpuPagedAttention)


def gemv_op() -> CpuGemv | None:
    """The compiled small-batch GEMV, or None where F.linear is to be used (decided once, logged once)."""
    return _op("CPU GEMV", GEMV_MODE_ENV, "gemv", CpuGemv)


def fused_op() -> CpuFused | None:
    """The compiled fused elementwise ops, or None where torch's are to be used (decided once, logged once)."""
    return _op("CPU fused ops", FUSED_MODE_ENV, "fused", CpuFused)


def int4_op() -> CpuInt4Gemv | None:
    """The compiled int4 matmul, or None where kernels.dispatch's torch path is used (decided once, logged once)."""
    return _op("CPU int4 matmul", INT4_MODE_ENV, "int4_gemv", CpuInt4Gemv)


def sparse24_op() -> CpuSparse24 | None:
    """The compiled 2:4-sparse projection, or None where the torch path (unpack + F.linear) is used (decided once,
    logged once)."""
    return _op("CPU 2:4 sparse matmul", SPARSE24_MODE_ENV, "sparse24", CpuSparse24)


def lora_op() -> CpuLora | None:
    """The compiled multi-LoRA apply, or None where kernels.lora_ref is used (decided once, logged once)."""
    return _op("CPU LoRA apply", LORA_MODE_ENV, "lora", CpuLora)


def decoder_op() -> CpuDecoder | None:
    """The compiled one-call decode step, or None: also None unless attention, GEMV and fused ops are compiled
    (it is made of them, so switching any of them to torch switches the step back to layer by layer)."""
    if paged_attention_op() is None or gemv_op() is None or fused_op() is None:
        return None
    return _op("CPU decode step", DECODER_MODE_ENV, "decoder", CpuDecoder)


def reset() -> None:
    """Forget the decisions so the next call re-reads the environment (tests, benchmarks)."""
    with _lock:
        _resolved.clear()
    prebuilt.reset()


def _op(label: str, env: str, name: str, factory: Callable[[Path], Op]) -> Op | None:
    if name in _resolved:
        return _resolved[name]  # type: ignore[return-value]
    with _lock:
        if name not in _resolved:
            _resolved[name] = _resolve(label, env, name, factory)
    return _resolved[name]  # type: ignore[return-value]


def _resolve(label: str, env: str, name: str, factory: Callable[[Path], Op]) -> Op | None:
    mode = os.environ.get(env, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{env}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "torch":
        logger.info("%s: torch path (%s=torch)", label, env)
        return None
    try:
        built = prebuilt.obtain_library(name)
        op = factory(built.path)
    except (BuildUnavailable, OSError, RuntimeError) as err:
        if mode == "compiled":
            raise RuntimeError(f"{env}=compiled but the {label} op is unavailable: {err}") from err
        logger.warning("%s: torch path, the compiled op is unavailable (%s)", label, err)
        return None
    threads = "OpenMP, torch's thread pool" if op.has_openmp else "single-threaded: no OpenMP runtime in torch"
    action = f"prebuilt {built.prebuilt}" if built.prebuilt else "built" if built.built_now else "cached"
    ahead = built.prefetch_bytes
    prefetch = f"weight prefetch {ahead} B ahead" if ahead >= 0 else "no weight prefetch"
    prefetch += f", prefetches into {built.prefetch_cache.upper()}"
    logger.info(
        "%s: compiled op (%s %s; %s; %d-float vectors, %s)", label, action, built.path, threads, built.vector_width,
        prefetch,
    )  # fmt: skip
    return op
