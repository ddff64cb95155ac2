"""Compiled CPU ops for the engine's hot path, built on first use and cached per machine.

Today: paged attention that reads the KV cache in place (`paged_attention.py` binds
`paged_attention.cpp` and the headers beside it).

Route: plain `g++` on a self-contained C++ file (no torch headers), loaded with ctypes. Chosen over
`torch.utils.cpp_extension` because including torch's headers (pybind11 + ATen) costs tens of
seconds of compile time per build on a 2-core CI machine and ties the library to torch's C++ ABI;
this source builds in a few seconds and only exchanges raw pointers and strides. What an extension
would give for free is done by hand in `build.py`: a cache keyed on source, torch version,
compiler, flags and CPU; a file lock so concurrent processes build once; atomic installation; and
linking torch's own OpenMP runtime so the op shares torch's thread pool and thread count. The
price: the op is an opaque Python call (not a `torch.library` op), so `torch.compile` graph-breaks
around it; the engine does not compile the attention call.

Which path runs is decided once per process, on first use, and logged in one line:

    TIDEPOOL_CPU_ATTENTION=auto      (default) the compiled op; the torch path when it cannot be built
    TIDEPOOL_CPU_ATTENTION=torch     always the torch path (reference, benchmarks, an off-switch)
    TIDEPOOL_CPU_ATTENTION=compiled  the compiled op or an error (CI and benchmarks that must measure it)

`CXX` picks the compiler; `TIDEPOOL_CACHE` moves the cache (default ~/.cache/tidepool).
"""

from __future__ import annotations

import logging
import os
import threading

from .build import BuildUnavailable, build_library
from .paged_attention import CpuPagedAttention

__all__ = ["MODES", "MODE_ENV", "CpuPagedAttention", "paged_attention_op", "reset"]

MODE_ENV = "TIDEPOOL_CPU_ATTENTION"
MODES = ("auto", "torch", "compiled")

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_resolved = False
_op: CpuPagedAttention | None = None


def paged_attention_op() -> CpuPagedAttention | None:
    """The compiled op, or None where the torch path is to be used (decided once, logged once)."""
    global _resolved, _op
    if _resolved:
        return _op
    with _lock:
        if not _resolved:
            _op = _resolve()
            _resolved = True
    return _op


def reset() -> None:
    """Forget the decision so the next call re-reads the environment (tests, benchmarks)."""
    global _resolved, _op
    with _lock:
        _resolved, _op = False, None


def _resolve() -> CpuPagedAttention | None:
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "torch":
        logger.info("CPU attention: torch path (%s=torch)", MODE_ENV)
        return None
    try:
        built = build_library("paged_attention", "paged_attention.cpp")
        op = CpuPagedAttention(built.path)
    except (BuildUnavailable, OSError, RuntimeError) as err:
        if mode == "compiled":
            raise RuntimeError(f"{MODE_ENV}=compiled but the CPU attention op is unavailable: {err}") from err
        logger.warning("CPU attention: torch path, the compiled op is unavailable (%s)", err)
        return None
    threads = "OpenMP, torch's thread pool" if op.has_openmp else "single-threaded: no OpenMP runtime in torch"
    action = "built" if built.built_now else "cached"
    logger.info("CPU attention: compiled op (%s %s; %s)", action, built.path, threads)
    return op
