"""The instruction sets the CPU ops are prebuilt for, and which of them this CPU runs.

Each `Isa` is a compiler target (`-march=...`) and the CPU feature flags (/proc/cpuinfo's `flags` on
x86-64, `Features` on aarch64) a CPU must have to run code built for it. The x86-64 ones are the psABI
micro-architecture levels, so a library built for one runs on every CPU of that level, whatever its
vendor or generation: the kernels' code paths depend only on __AVX512F__, __AVX2__ and __F16C__ (vec.h,
gemv.h, int4_tile.h, sparse24.h), which the levels fix. Rank orders them: a higher rank is preferred.

Invariants: `ISA_TABLE`'s names are exactly contract/cpu_ops.py's `ISAS`; a level's required flags
include the lower levels' (a CPU that runs avx512 runs avx2), so `runnable()` is ordered by rank.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from tidepool.contract.cpu_ops import AUTO_ISA, ISAS

_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True, slots=True)
class Isa:
    name: str
    machine: str  # platform.machine() of the CPUs that run it
    march: tuple[str, ...]  # the compiler flags selecting it
    requires: frozenset[str]  # CPU feature flags it needs
    rank: int


ISA_TABLE: dict[str, Isa] = {
    isa.name: isa
    for isa in (
        Isa("sse4", "x86_64", ("-march=x86-64-v2", "-mtune=generic"), _V2, 1),
        Isa("avx2", "x86_64", ("-march=x86-64-v3", "-mtune=generic"), _V3, 2),
        Isa("avx512", "x86_64", ("-march=x86-64-v4", "-mtune=generic"), _V4, 3),
        Isa("armv8", "aarch64", ("-march=armv8-a",), frozenset({"asimd"}), 1),
    )
}
assert tuple(ISA_TABLE) == ISAS, "engine/cpu_ops/isa.py and contract/cpu_ops.py list different ISAs"


def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """This CPU's feature flags (the first processor's; `cpuinfo` is /proc/cpuinfo's text, read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def runnable(features: frozenset[str] | None = None, machine: str | None = None) -> list[Isa]:
    """The ISAs this CPU (or the given one) runs, best last."""
    features = cpu_features() if features is None else features
    machine = platform.machine() if machine is None else machine
    found = [isa for isa in ISA_TABLE.values() if isa.machine == machine and isa.requires <= features]
    return sorted(found, key=lambda isa: isa.rank)


def parse_isas(text: str) -> list[Isa]:
    """`--isa`'s value (comma-separated names, or `auto`: the best this CPU runs) as ISAs; ValueError naming
    the flag for an unknown name or, for `auto`, a CPU that runs none of them."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"--isa: give one or more of {', '.join(ISAS)} or {AUTO_ISA}")
    picked: list[Isa] = []
    for name in names:
        if name == AUTO_ISA:
            here = runnable()
            if not here:
                raise ValueError(f"--isa auto: this CPU ({platform.machine()}) runs none of {', '.join(ISAS)}")
            isa = here[-1]
        elif name in ISA_TABLE:
            isa = ISA_TABLE[name]
        else:
            raise ValueError(f"--isa: unknown ISA {name!r}; expected {', '.join(ISAS)} or {AUTO_ISA}")
        if isa not in picked:
            picked.append(isa)
    return picked
