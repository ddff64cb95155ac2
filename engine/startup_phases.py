"""Where an engine's start-up goes: seconds per phase, recorded by `engine_builder.build_engine`.

Role: a tiny, torch-free clock that the builder marks at the end of each start phase, so the log
and the server's ``tidepool:startup_phase_seconds{phase}`` metric can say where start-up went.
Phases, in order (`PHASES`):

- ``import``: process start to the engine modules imported (the interpreter, torch, Tidepool);
  Linux only (read from ``/proc/self/stat``), and the same value for every engine of one process.
- ``resolve``: model name -> file or folder, quantized copy prepared, config read, threads set.
- ``tokenizer``: the tokenizer built (for GGUF: the vocabulary read from the file's metadata).
- ``weights``: weights read into the model (or the tensor/pipeline-parallel workers started).
- ``weight_layout``: the runner's CPU layout of the weights (compiled-op layouts, huge-page arena).
- ``kv_cache``: KV cache sized and reserved (CPU: mapped, not touched; see `hugepages.zeros`).
- ``warmup``: the runner's first prefill and decode step (compiled ops built or loaded).
- ``features``: speculative decoding / KV hand-off hooks built (0 when none is configured).

Invariants: every phase is a non-negative number of seconds; phases the builder marks more than
once add up; the dict keeps `PHASES` order for the phases present.
"""

from __future__ import annotations

import os
import sys
import time

PHASES = ("import", "resolve", "tokenizer", "weights", "weight_layout", "kv_cache", "warmup", "features")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat``, 10 ms resolution), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115 (one short read)
        start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot, in clock ticks
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupClock:
    """Marks the end of each phase; `phases` holds seconds per phase, in `PHASES` order."""

    def __init__(self, import_s: float | None = None) -> None:
        self._seconds: dict[str, float] = {} if import_s is None else {"import": import_s}
        self._last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous mark or lap; the clock restarts now."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds

    def add(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; phases: {', '.join(PHASES)}")
        self._seconds[phase] = self._seconds.get(phase, 0.0) + max(0.0, seconds)

    def mark(self, phase: str) -> None:
        """End `phase` now: it gets the time since the previous mark or lap."""
        self.add(phase, self.lap())

    @property
    def phases(self) -> dict[str, float]:
        return {phase: self._seconds[phase] for phase in PHASES if phase in self._seconds}

    def summary(self) -> str:
        phases = self.phases
        parts = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in phases.items())
        return f"{parts}; total {sum(phases.values()):.2f} s"
