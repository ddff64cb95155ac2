"""Compile a CPU op's C++ source once per machine and cache the shared library outside the clone.

Cache: `$TIDEPOOL_CACHE/cpu_ops/<name>-<key>.so` (default ~/.cache/tidepool). The key is a hash of
everything that makes a library valid for this process: the source files, torch's version, the
compiler (resolved path and `--version`), the flags, the CPU (the code is built with
`-march=native`, so a cache shared by different CPUs gets one library per CPU) and the OpenMP
runtime linked. Invariants:

- A library is built at most once per key: builders take an exclusive `flock` on `<name>-<key>.lock`
  and re-check for the library after acquiring it, so concurrent processes (TP/PP workers,
  parallel tests) wait for the first one instead of building again.
- Nobody ever loads a half-written library: it is compiled in a temporary directory beside the
  cache entry and renamed into place (atomic on one filesystem).
- OpenMP: the library is linked against the runtime torch itself loaded (found in
  /proc/self/maps), never the system's, so its parallel regions use torch's thread pool instead
  of starting a second pool that would fight torch's spinning threads for the cores. Without an
  OpenMP runtime in torch the library is built single-threaded.
- A failed build leaves `<name>-<key>.log` (the commands and the compiler's output); while it is
  there that recipe is not tried again (so every process start does not pay for a doomed compile),
  and the next recipe is: native flags without OpenMP, then portable flags. Delete the log to retry.
- The compiler is `$CXX` when set (a missing `$CXX` is an error, not a reason to guess another),
  else the first of c++, g++, clang++ on PATH.
- Vector width (vec.h): 16 floats where the native build targets AVX-512, else 8.
  `TIDEPOOL_CPU_VECTOR_WIDTH=8|16` forces one (a -D flag, so part of the key); any other value is
  an error. The library reports what it was built with (`tp_vector_width`).
- Prefetch distance (vec.h's `prefetch_ahead`, for the kernels that stream weights): 4096 bytes.
  `TIDEPOOL_CPU_PREFETCH_BYTES=off|<multiple of 64>` sets another (a -D flag, as above; for
  benchmarks comparing distances); the library reports it (`tp_prefetch_bytes`, -1 for off).
- Prefetch level (vec.h's `prefetch_line`, for the weight streams and the attention's KV rows): L2.
  `TIDEPOOL_CPU_PREFETCH_CACHE=l1` prefetches into L1 as well (a -D flag, as above); the library
  reports it (`tp_prefetch_locality`: 2 for L2, 3 for L1).
- Every library reports whether it runs OpenMP (`tp_has_openmp`); `open_library` opens one for its binding.
- Ahead of time (`build_for_target`, for `tidepool build-ops`, build_ops.py): the same flags with a fixed
  `-march` level instead of `-march=native`, no cache, no lock (build_ops.py locks its directory); the
  engine looks there first (prebuilt.py) and comes here only when it has nothing for this CPU and process.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).resolve().parent  # the .cpp/.h files ship beside the modules
COMPILE_TIMEOUT_S = 600  # generous: a busy 2-core machine builds in seconds, CI must never flake on it
# -ffp-contract=fast: a*b+c becomes one FMA (ISO modes turn contraction off); -fvisibility=hidden:
# only the marked exports leave the library, so the helpers inline and nothing goes through the PLT.
_BASE_FLAGS = ("-O3", "-std=gnu++17", "-ffp-contract=fast", "-fPIC", "-fvisibility=hidden", "-Wall")
VECTOR_WIDTH_ENV = "TIDEPOOL_CPU_VECTOR_WIDTH"
VECTOR_WIDTHS = (8, 16)
PREFETCH_ENV = "TIDEPOOL_CPU_PREFETCH_BYTES"
PREFETCH_CACHE_ENV = "TIDEPOOL_CPU_PREFETCH_CACHE"
PREFETCH_LOCALITIES = {"l2": 2, "l1": 3}  # TIDEPOOL_CPU_PREFETCH_CACHE -> __builtin_prefetch's locality
_OMP_LIB = re.compile(r"/lib(gomp|iomp5|omp)[^/]*\.so[.0-9]*$")


class BuildUnavailable(RuntimeError):
    """The op cannot be built here (no compiler, or the compiler failed); the message says why."""


@dataclass(frozen=True, slots=True)
class BuiltLibrary:
    path: Path
    built_now: bool  # False: an earlier build (this or another process) was reused
    has_openmp: bool
    flags: tuple[str, ...]
    prebuilt: str | None = None  # the ISA variant of a prebuilt library (prebuilt.py); None: built here

    def _reported(self, symbol: str) -> int:
        """A build setting the library reports about itself (vec.h's `tp_*` exports)."""
        return int(getattr(ctypes.CDLL(str(self.path)), symbol)())

    @property
    def vector_width(self) -> int:
        """Floats per SIMD vector the library was built with (vec.h's W)."""
        return self._reported("tp_vector_width")

    @property
    def prefetch_bytes(self) -> int:
        """How far ahead the library's weight streams prefetch, in bytes (-1: not at all)."""
        return self._reported("tp_prefetch_bytes")

    @property
    def prefetch_cache(self) -> str:
        """The cache level the library's software prefetches fill: "l2" or "l1"."""
        locality = self._reported("tp_prefetch_locality")
        return next(name for name, value in PREFETCH_LOCALITIES.items() if value == locality)


def open_library(path: Path, *int_functions: str) -> ctypes.CDLL:
    """A built library opened with ctypes, `int_functions` and vec.h's `tp_has_openmp` declared to return a C int."""
    lib = ctypes.CDLL(str(path))
    for name in ("tp_has_openmp", *int_functions):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def cache_root() -> Path:
    return Path(os.environ.get("TIDEPOOL_CACHE", "~/.cache/tidepool")).expanduser() / "cpu_ops"


def find_compiler() -> str:
    """Absolute path of the C++ compiler to use, or BuildUnavailable saying why there is none."""
    requested = os.environ.get("CXX")
    if requested:
        found = shutil.which(requested)
        if found is None:
            raise BuildUnavailable(f"no C++ compiler: CXX={requested} not found")
        return found
    for candidate in ("c++", "g++", "clang++"):
        found = shutil.which(candidate)
        if found is not None:
            return found
    raise BuildUnavailable("no C++ compiler: none of c++, g++, clang++ on PATH and CXX unset")


def torch_openmp_runtime() -> Path | None:
    """The OpenMP library torch loaded into this process, when torch parallelises with OpenMP."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        if len(fields) == 6 and _OMP_LIB.search(fields[5]) and Path(fields[5]).is_file():
            return Path(fields[5])
    return None


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = {line.split(":", 1)[0].strip(): line for line in info.splitlines() if ":" in line}
    return "\n".join(lines[k] for k in wanted if k in lines) or platform.machine()


def _compiler_version(cxx: str) -> str:
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BuildUnavailable(f"C++ compiler {cxx} does not run: {err}") from err
    if proc.returncode != 0:
        raise BuildUnavailable(f"C++ compiler {cxx} does not run: {proc.stderr.strip()[:200]}")
    return proc.stdout.splitlines()[0] if proc.stdout else ""


def _run(cmd: list[str], log: list[str]) -> bool:
    log.append("$ " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.append(str(err))
        return False
    log.extend(s for s in (proc.stdout, proc.stderr) if s)
    return proc.returncode == 0


@dataclass(frozen=True, slots=True)
class _Recipe:
    cxx: str
    sources: tuple[Path, ...]  # the first is compiled; the others are headers it includes
    compile_flags: tuple[str, ...]
    link_inputs: tuple[str, ...]

    def key(self, cxx_version: str, cpu: str) -> str:
        digest = hashlib.sha256()
        for part in (torch.__version__, self.cxx, cxx_version, cpu, *self.compile_flags, *self.link_inputs):
            digest.update(part.encode() + b"\0")
        for source in self.sources:
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
        return digest.hexdigest()[:20]

    def build(self, target: Path, log: list[str]) -> bool:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.stem}-") as tmp:
            obj, lib = Path(tmp) / "op.o", Path(tmp) / "op.so"
            ok = _run([self.cxx, *self.compile_flags, "-c", str(self.sources[0]), "-o", str(obj)], log)
            # Linked without -fopenmp so the driver adds no system libgomp: the runtime is link_inputs'.
            ok = ok and _run([self.cxx, "-shared", str(obj), "-o", str(lib), "-Wl,-z,defs", *self.link_inputs], log)
            if ok:
                os.replace(lib, target)
            return ok


def define_flags() -> tuple[str, ...]:
    """The -D flags for what TIDEPOOL_CPU_VECTOR_WIDTH, TIDEPOOL_CPU_PREFETCH_BYTES and
    TIDEPOOL_CPU_PREFETCH_CACHE force (none for what they leave to vec.h). Raises ValueError naming the
    variable for a value it does not take."""
    flags = []
    width = os.environ.get(VECTOR_WIDTH_ENV, "").strip().lower()
    if width not in ("", "auto"):
        if width not in {str(w) for w in VECTOR_WIDTHS}:
            raise ValueError(f"{VECTOR_WIDTH_ENV}={width!r}: expected auto, 8 or 16 (floats per SIMD vector)")
        flags.append(f"-DTIDEPOOL_VEC_WIDTH={width}")
    prefetch = os.environ.get(PREFETCH_ENV, "").strip().lower()
    if prefetch not in ("", "auto"):
        if prefetch == "off":
            prefetch = "-1"
        elif not (re.fullmatch(r"[0-9]+", prefetch) and int(prefetch) % 64 == 0 and int(prefetch) <= 1 << 16):
            raise ValueError(f"{PREFETCH_ENV}={prefetch!r}: expected auto, off or a multiple of 64 up to 65536 (bytes)")
        flags.append(f"-DTIDEPOOL_PREFETCH_BYTES={int(prefetch)}")
    level = os.environ.get(PREFETCH_CACHE_ENV, "").strip().lower()
    if level not in ("", "auto"):
        if level not in PREFETCH_LOCALITIES:
            raise ValueError(f"{PREFETCH_CACHE_ENV}={level!r}: expected auto, l2 or l1 (the cache prefetches fill)")
        flags.append(f"-DTIDEPOOL_PREFETCH_LOCALITY={PREFETCH_LOCALITIES[level]}")
    return tuple(flags)


def _recipes(cxx: str, sources: tuple[Path, ...], omp: Path | None) -> list[tuple[_Recipe, bool]]:
    """Builds to try in order: tuned for this CPU with torch's OpenMP, then portable and serial."""
    base = (*_BASE_FLAGS, *define_flags())
    native = (*base, "-march=native")
    recipes: list[tuple[_Recipe, bool]] = []
    if omp is not None:
        link = (str(omp), f"-Wl,-rpath,{omp.parent}")
        recipes.append((_Recipe(cxx, sources, (*native, "-fopenmp"), link), True))
    recipes.append((_Recipe(cxx, sources, native, ()), False))
    recipes.append((_Recipe(cxx, sources, base, ()), False))
    return recipes


def build_library(name: str, source: str) -> BuiltLibrary:
    """Return the cached library for `SOURCE_DIR/source` (and the headers beside it), building it if needed."""
    cxx = find_compiler()
    cxx_version = _compiler_version(cxx)
    cpu = _cpu_identity()
    sources = op_sources(source)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    failures: list[Path] = []
    for recipe, has_openmp in _recipes(cxx, sources, torch_openmp_runtime()):
        target = root / f"{name}-{recipe.key(cxx_version, cpu)}.so"
        built_now = _obtain(recipe, target)
        if built_now is None:
            failures.append(target.with_suffix(".log"))
            continue
        return BuiltLibrary(target, built_now, has_openmp, recipe.compile_flags)
    logs = ", ".join(map(str, failures))
    raise BuildUnavailable(f"the C++ build failed with {cxx}; compiler output in {logs} (delete to retry)")


def op_sources(source: str) -> tuple[Path, ...]:
    """The files a build of `SOURCE_DIR/source` reads: the source, then every header beside it (sorted)."""
    if not (SOURCE_DIR / source).is_file():
        raise BuildUnavailable(f"C++ source missing from the installed package: {SOURCE_DIR / source}")
    return (SOURCE_DIR / source, *sorted(SOURCE_DIR.glob("*.h")))


def sources_digest(source: str) -> str:
    """A hash of what `op_sources(source)` holds (names and bytes): a prebuilt library is for these sources."""
    digest = hashlib.sha256()
    for path in op_sources(source):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


def build_for_target(source: str, march: tuple[str, ...], target: Path) -> BuiltLibrary:
    """Build `source` for the CPUs `march` selects (not this one's) into `target`, replacing it atomically:
    with torch's OpenMP runtime where torch has one, else serial. BuildUnavailable, with the compiler's
    output, when neither builds. Used ahead of time (prebuilt.py); nothing is cached or loaded here."""
    cxx = find_compiler()
    sources = op_sources(source)
    omp = torch_openmp_runtime()
    flags = (*_BASE_FLAGS, *define_flags(), *march)
    attempts: list[tuple[_Recipe, bool]] = []
    if omp is not None:
        link = (str(omp), f"-Wl,-rpath,{omp.parent}")
        attempts.append((_Recipe(cxx, sources, (*flags, "-fopenmp"), link), True))
    attempts.append((_Recipe(cxx, sources, flags, ()), False))
    log: list[str] = []
    target.parent.mkdir(parents=True, exist_ok=True)
    for recipe, has_openmp in attempts:
        if recipe.build(target, log):
            return BuiltLibrary(target, True, has_openmp, recipe.compile_flags)
    raise BuildUnavailable(f"building {source} with {' '.join(march)} failed:\n" + "\n".join(log)[-4000:])


def _obtain(recipe: _Recipe, target: Path) -> bool | None:
    """True: built now; False: already built; None: this recipe failed (now or in an earlier run)."""
    log_path = target.with_suffix(".log")
    if target.is_file():
        return False
    if log_path.is_file():
        return None
    with open(target.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if target.is_file():
            return False  # another process built it while this one waited
        if log_path.is_file():
            return None
        log: list[str] = []
        if recipe.build(target, log):
            return True
        log_path.write_text("\n".join(log) + "\n")
        return None
