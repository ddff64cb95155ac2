"""`tidepool build-ops`: build the CPU ops ahead of time, for the ISAs an image targets, into a prebuilt directory.

    tidepool build-ops --isa avx2,avx512 [--out DIR] [--jobs N]

`--isa`: comma-separated names from contract/cpu_ops.py's ISAS, or `auto` (the best this machine runs);
`--out`: the directory (default: $TIDEPOOL_CPU_OPS_DIR, which the engine reads at run time, prebuilt.py).
Every op (each `<op>.cpp` beside this module) is built for each ISA with torch's OpenMP runtime, as the
run-time build links it, and `-march=<the ISA's level>` instead of `-march=native`, so the libraries run
on any CPU of that level. The TIDEPOOL_CPU_* build variables (build.define_flags) apply as at run time.

Incremental and safe to run concurrently: under an exclusive lock on `<out>/.lock`, an op whose manifest
entry already matches this process (prebuilt.op_identity) is kept; every other is built into a new file
named by its key, then the manifest is replaced atomically, so readers see either the old set or the new
one. Files are world-readable (a pod's non-root user reads them from a read-only mount). The libraries
this machine can run are opened once after the build (a library that does not load fails the command).
Exit 0 when every op was built or kept; 1 with the compiler's output otherwise (an image must not ship
without its ops).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import json
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidepool.contract.cpu_ops import AUTO_ISA, ISAS, MANIFEST_NAME, PREBUILT_DIR_ENV

from .build import SOURCE_DIR, BuiltLibrary, _compiler_version, build_for_target, find_compiler, open_library
from .isa import Isa, parse_isas, runnable
from .prebuilt import IDENTITY_KEYS, MANIFEST_FORMAT, op_identity, read_manifest


def op_names() -> list[str]:
    """Every op this package builds: one per C++ source beside it."""
    return sorted(path.stem for path in SOURCE_DIR.glob("*.cpp"))


def build_ops(
    isas: Sequence[Isa], out: Path, jobs: int = 1, ops: Sequence[str] | None = None
) -> dict[str, dict[str, str]]:
    """Build (or keep) `ops` (default: every op) for every ISA in `out`; {isa: {op: "built" | "kept"}}.
    BuildUnavailable on a failure; ValueError for an op this package does not have."""
    names = list(op_names() if ops is None else ops)
    if foreign := [isa.name for isa in isas if isa.machine != platform.machine()]:
        raise ValueError(f"--isa {','.join(foreign)}: not for this machine ({platform.machine()}); no cross-compiling")
    if unknown := sorted(set(names) - set(op_names())):
        raise ValueError(f"unknown CPU ops {unknown}; the package has {', '.join(op_names())}")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o755)
    with open(out / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            variants = read_manifest(out)
        except ValueError:
            variants = {}  # none yet (or unreadable): everything is built
        compiler = _compiler_version(find_compiler())
        todo: list[tuple[Isa, str, dict[str, Any]]] = []
        report: dict[str, dict[str, str]] = {isa.name: {} for isa in isas}
        for isa in isas:
            for name in names:
                identity = op_identity(name)
                entry = variants.get(isa.name, {}).get(name)
                if _current(entry, identity, out):
                    report[isa.name][name] = "kept"
                else:
                    todo.append((isa, name, identity))
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:  # the compiler runs in subprocesses
            built = list(pool.map(lambda job: _build_one(out, compiler, *job), todo))
        for (isa, name, identity), library in zip(todo, built, strict=True):
            variants.setdefault(isa.name, {})[name] = {
                **identity, "file": str(library.path.relative_to(out)), "flags": list(library.flags),
                "has_openmp": library.has_openmp, "compiler": compiler,
            }  # fmt: skip
            report[isa.name][name] = "built"
        _write_manifest(out, variants)
    _check_loadable(out, isas, names)
    return report


def _current(entry: Any, identity: dict[str, Any], out: Path) -> bool:
    if not isinstance(entry, dict) or any(entry.get(key) != identity[key] for key in IDENTITY_KEYS):
        return False
    return (out / str(entry.get("file", ""))).is_file()


def _build_one(out: Path, compiler: str, isa: Isa, name: str, identity: dict[str, Any]) -> BuiltLibrary:
    """Build op `name` for `isa` into a file named by everything it was built from (a rebuild of the same
    inputs replaces it atomically with the same bytes' equivalent; readers keep the inode they opened)."""
    digest = hashlib.sha256(json.dumps([identity, isa.march, compiler], sort_keys=True).encode()).hexdigest()[:16]
    target = out / isa.name / f"{name}-{digest}.so"
    library = build_for_target(f"{name}.cpp", isa.march, target)
    target.parent.chmod(0o755)
    target.chmod(0o755)
    return library


def _write_manifest(out: Path, variants: dict[str, dict[str, Any]]) -> None:
    text = json.dumps({"format": MANIFEST_FORMAT, "ops": variants}, indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".manifest-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / MANIFEST_NAME)


def _check_loadable(out: Path, isas: Sequence[Isa], names: Sequence[str]) -> None:
    """Open each library this CPU runs (others cannot be tried here): a library that does not load is an error."""
    here = {isa.name for isa in runnable()}
    variants = read_manifest(out)
    for isa in isas:
        if isa.name in here:
            for name in names:
                open_library(out / variants[isa.name][name]["file"], "tp_vector_width")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidepool build-ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", required=True, help=f"comma-separated: {', '.join(ISAS)}, or {AUTO_ISA}")
    parser.add_argument("--out", type=Path, default=None, help=f"the prebuilt directory (default: ${PREBUILT_DIR_ENV})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compilers run at once (default: CPUs)")
    args = parser.parse_args(argv)
    out = args.out or (Path(os.environ[PREBUILT_DIR_ENV]) if os.environ.get(PREBUILT_DIR_ENV) else None)
    if out is None:
        parser.error(f"--out: give the directory or set {PREBUILT_DIR_ENV}")
    if args.jobs < 1:
        parser.error("--jobs: at least 1")
    report = build_ops(parse_isas(args.isa), out.resolve(), args.jobs)
    for isa, ops in report.items():
        built = sorted(name for name, what in ops.items() if what == "built")
        print(f"{isa}: {len(ops)} ops in {out.resolve() / isa} (built {len(built)}: {', '.join(built) or '-'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
