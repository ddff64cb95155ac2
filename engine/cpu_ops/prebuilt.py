"""Prebuilt CPU ops: the directory an image carries, looked in before anything is compiled.

`tidepool build-ops` (build_ops.py) writes, for each ISA an image targets (isa.py), one library per op
into `<dir>/<isa>/<op>-<key>.so` and records them in `<dir>/manifest.json`:

    {"format": 1, "ops": {"<isa>": {"<op>": {"file": "<isa>/<op>-<key>.so", "sources": ..., "torch": ...,
                                             "openmp": ..., "defines": [...], "flags": [...], "has_openmp": ...}}}}

At run time (`obtain_library`, called once per op and process by cpu_ops._resolve) the directory named by
`TIDEPOOL_CPU_OPS_DIR` is read; the best ISA this CPU runs that the manifest has is chosen, and its
library for the op is used when it was built for this process's op: the same sources (hash of the .cpp
and the headers), torch version, OpenMP runtime (the file torch loaded) and -D flags (the
TIDEPOOL_CPU_* build variables). Nothing is compiled and no compiler is needed then. Otherwise the op is
built at run time as before (build.build_library, cached per machine).

Logging, once per process each (cpu_ops.reset() forgets): `LOADED_LINE` with the variant and the directory
when a prebuilt library is first used; `COMPILE_LINE` with the reason when an op falls back to the run-time
build: a WARNING when a directory was named (an image that should have carried the op), an INFO when none
was (a development checkout). The per-op line of cpu_ops says `prebuilt <isa>` for a prebuilt library.

Invariants: the manifest is replaced atomically and never names a file that is not complete (build_ops.py
writes the libraries first, then the manifest), and a library file is never rewritten in place (its name
carries its key), so a reader never loads a half-written or mismatched library.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from tidepool.contract.cpu_ops import COMPILE_LINE, LOADED_LINE, MANIFEST_NAME, PREBUILT_DIR_ENV

from .build import BuiltLibrary, build_library, cache_root, define_flags, sources_digest, torch_openmp_runtime
from .isa import ISA_TABLE, runnable

MANIFEST_FORMAT = 1
IDENTITY_KEYS = ("sources", "torch", "openmp", "defines")  # what must match this process for an entry to be used

logger = logging.getLogger("tidepool.engine.cpu_ops")
_lock = threading.Lock()
_announced: set[str] = set()


def op_identity(name: str) -> dict[str, Any]:
    """What a library for op `name` must have been built against to be loaded by this process."""
    omp = torch_openmp_runtime()
    return {
        "sources": sources_digest(f"{name}.cpp"),
        "torch": torch.__version__,
        "openmp": omp.name if omp is not None else None,
        "defines": list(define_flags()),
    }


def read_manifest(root: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """`root`'s manifest as {isa: {op: entry}}; ValueError saying what is wrong with a missing or bad one."""
    path = root / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is unreadable: {err}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("ops"), dict):
        raise ValueError(f"{path} is not a format-{MANIFEST_FORMAT} prebuilt-ops manifest")
    return data["ops"]


def find_prebuilt(name: str) -> tuple[BuiltLibrary | None, str]:
    """The prebuilt library for op `name` this process should load, or (None, why there is none)."""
    configured = os.environ.get(PREBUILT_DIR_ENV, "").strip()
    if not configured:
        return None, f"{PREBUILT_DIR_ENV} is unset"
    root = Path(configured)
    try:
        variants = read_manifest(root)
    except ValueError as err:
        return None, f"{PREBUILT_DIR_ENV}={root}: {err}"
    here = runnable()
    usable = [isa for isa in here if isa.name in variants]
    if not usable:
        runs = ", ".join(isa.name for isa in here) or "none of the known ISAs"
        has = ", ".join(sorted(variants)) or "none"
        return None, f"no prebuilt variant for this CPU in {root} (it has {has}; this CPU runs {runs})"
    isa = usable[-1]
    entry = variants[isa.name].get(name)
    if not isinstance(entry, dict):
        return None, f"{root} has no {name} op for {isa.name}"
    current = op_identity(name)
    stale = [key for key in IDENTITY_KEYS if entry.get(key) != current[key]]
    if stale:
        said = "; ".join(f"{key} {entry.get(key)!r} there, {current[key]!r} here" for key in stale)
        return None, f"{root}'s {isa.name} {name} op was built for other inputs ({said})"
    path = root / str(entry.get("file", ""))
    if not path.is_file():
        return None, f"{path} (named by {root / MANIFEST_NAME}) is missing"
    flags = tuple(entry.get("flags", ()))
    return BuiltLibrary(path, False, bool(entry.get("has_openmp")), flags, prebuilt=isa.name), ""


def obtain_library(name: str) -> BuiltLibrary:
    """Op `name`'s library: prebuilt when the directory has one for this CPU and process, else built here."""
    library, why = find_prebuilt(name)
    if library is not None:
        assert library.prebuilt is not None
        isa = ISA_TABLE[library.prebuilt]
        _once(
            "loaded", logging.INFO, "%s: %s variant (%s) from %s; this CPU runs %s", LOADED_LINE, isa.name,
            " ".join(isa.march), library.path.parent.parent, ", ".join(i.name for i in runnable()),
        )  # fmt: skip
        return library
    configured = bool(os.environ.get(PREBUILT_DIR_ENV, "").strip())
    _once(
        "compile", logging.WARNING if configured else logging.INFO,
        "%s (a library per op, cached in %s): no usable prebuilt op: %s", COMPILE_LINE, cache_root(), why,
    )  # fmt: skip
    return build_library(name, f"{name}.cpp")


def reset() -> None:
    """Forget what was logged, so the next process-like use logs again (tests)."""
    with _lock:
        _announced.clear()


def _once(kind: str, level: int, message: str, *args: object) -> None:
    with _lock:
        if kind in _announced:
            return
        _announced.add(kind)
    logger.log(level, message, *args)
