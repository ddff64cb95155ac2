"""How many CPU threads the engine's torch ops may use: the CPUs this process can actually run on.

`os.cpu_count()` counts the machine, not the pod. A Kubernetes CPU limit is a CFS quota on the
container's cgroup (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), and a
cpuset or ``taskset`` narrows the affinity mask. An OpenMP team larger than either stalls in
every parallel region: each region ends at a barrier, so the step waits for the thread the
kernel (or the quota) is not running. bench/README.md ("Threads that fit the pod") has the
measurements behind the rules below.

Rules (`decide_threads`), first match wins:
1. an explicit request (``LLM(num_threads=N)``);
2. the environment override ``TIDEPOOL_NUM_THREADS``;
3. ``OMP_NUM_THREADS``, when the user set it (torch read it already; we keep it);
4. automatic: min(affinity CPUs, floor(tightest CFS quota on the cgroup path)), at least 1.
   Floor, not ceil: with a 1.5-CPU quota a second thread is throttled in every period while
   the first waits for it at the next barrier. The automatic rule only narrows: a program that
   already lowered torch's count (torch.set_num_threads before building the engine) keeps it.

Waiting threads sleep: importing `tidepool.engine` sets ``OMP_WAIT_POLICY=PASSIVE`` unless the
user chose a policy (`set_openmp_defaults`), because OpenMP's default (spin, then sleep) burns
the CPUs a busy neighbour needs and, when a spinning thread is descheduled, stalls every barrier:
measured on the 2-core development machine beside other processes, bs=1 decode with 2 threads
took 300-620 ms per step spinning and 41-43 ms passive (bench/README.md). libgomp reads the
variable once, when torch loads it, so it only takes effect if tidepool.engine is imported before
torch; `configure_threads` logs which policy is in force.

Invariants: reading the cgroup tree never raises (a missing or unreadable file means "no limit
known here"); the decision carries a human-readable reason, logged once at engine start.
Paths are parameters so the tests run on fake cgroup trees (v1, v2, nested, hybrid).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_NUM_THREADS = "TIDEPOOL_NUM_THREADS"
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
_openmp_defaults_in_time: bool | None = None  # None: set_openmp_defaults never ran


def set_openmp_defaults(env: MutableMapping[str, str] = os.environ) -> bool:
    """Default OpenMP to sleeping waits (keeps a user's choice); True when torch had not loaded OpenMP yet."""
    global _openmp_defaults_in_time
    for name, value in OPENMP_DEFAULTS.items():
        env.setdefault(name, value)
    _openmp_defaults_in_time = "torch" not in sys.modules
    return _openmp_defaults_in_time


def wait_policy_note(env: Mapping[str, str] = os.environ) -> str:
    """How OpenMP threads wait in this process, for the start-up log line."""
    policy = env.get("OMP_WAIT_POLICY", "")
    if _openmp_defaults_in_time is False and policy == OPENMP_DEFAULTS["OMP_WAIT_POLICY"]:
        return "OpenMP wait policy: the runtime's default (torch loaded before tidepool.engine set PASSIVE)"
    return f"OpenMP wait policy {policy or 'default'}"


@dataclass(frozen=True, slots=True)
class CpuQuota:
    """The tightest CFS quota found on this process's cgroup path, in CPUs (e.g. 1.5)."""

    num_cpus: float
    source: str  # the file that set it, for the log line


@dataclass(frozen=True, slots=True)
class CpuBudget:
    num_affinity_cpus: int  # CPUs in the scheduler affinity mask
    quota: CpuQuota | None  # None: no CFS quota anywhere on the path (or no cgroup fs)

    @property
    def num_threads(self) -> int:
        if self.quota is None:
            return max(1, self.num_affinity_cpus)
        return max(1, min(self.num_affinity_cpus, math.floor(self.quota.num_cpus)))


@dataclass(frozen=True, slots=True)
class ThreadDecision:
    num_threads: int
    reason: str


@dataclass(frozen=True, slots=True)
class _Mount:
    root: str  # the cgroup path that the mount point shows (mountinfo field 4)
    mount_point: Path
    is_v2: bool


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_mounts(mountinfo: str) -> list[_Mount]:
    """cgroup2 mounts and v1 mounts carrying the `cpu` controller, from /proc/self/mountinfo."""
    mounts = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fs_type, super_options = tail[0], tail[2].split(",")
        if fs_type == "cgroup2":
            mounts.append(_Mount(fields[3], Path(_unescape(fields[4])), is_v2=True))
        elif fs_type == "cgroup" and "cpu" in super_options:
            mounts.append(_Mount(fields[3], Path(_unescape(fields[4])), is_v2=False))
    return mounts


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _process_cgroups(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 `cpu` controller path) from /proc/self/cgroup."""
    v2 = v1 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _quota_in(directory: Path, is_v2: bool) -> float | None:
    """CPUs allowed by the quota files in one cgroup directory; None when unlimited or absent."""
    if is_v2:
        raw = _read(directory / "cpu.max")
        if raw is None:
            return None
        parts = raw.split()
        if not parts or parts[0] == "max":
            return None
        quota, period = parts[0], parts[1] if len(parts) > 1 else "100000"
    else:
        quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
        if quota is None or period is None:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:  # v1 writes -1 for "no limit"
        return None
    return quota_us / period_us


def _tightest_on_path(mount: _Mount, cgroup_path: str) -> CpuQuota | None:
    """Walk from the process's cgroup directory up to the mount point; the smallest quota wins."""
    relative = os.path.relpath(cgroup_path, mount.root) if cgroup_path.startswith(mount.root) else None
    if relative is None or relative.startswith(".."):
        relative = "."  # a cgroup namespace hides the path: the mount point is our own cgroup
    directory = Path(os.path.normpath(mount.mount_point / relative))
    best: CpuQuota | None = None
    while True:
        cpus = _quota_in(directory, mount.is_v2)
        if cpus is not None and (best is None or cpus < best.num_cpus):
            best = CpuQuota(cpus, str(directory / ("cpu.max" if mount.is_v2 else "cpu.cfs_quota_us")))
        if directory == mount.mount_point or mount.mount_point not in directory.parents:
            return best
        directory = directory.parent


def cgroup_cpu_quota(proc_self: Path = Path("/proc/self")) -> CpuQuota | None:
    """The tightest CFS quota over both cgroup versions (hybrid hosts mount both)."""
    mountinfo, proc_cgroup = _read(proc_self / "mountinfo"), _read(proc_self / "cgroup")
    if mountinfo is None or proc_cgroup is None:
        return None
    v2_path, v1_path = _process_cgroups(proc_cgroup)
    best: CpuQuota | None = None
    for mount in _cgroup_mounts(mountinfo):
        path = v2_path if mount.is_v2 else v1_path
        if path is None:
            continue
        found = _tightest_on_path(mount, path)
        if found is not None and (best is None or found.num_cpus < best.num_cpus):
            best = found
    return best


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def read_cpu_budget(proc_self: Path = Path("/proc/self"), num_affinity_cpus: int | None = None) -> CpuBudget:
    return CpuBudget(affinity_cpus() if num_affinity_cpus is None else num_affinity_cpus, cgroup_cpu_quota(proc_self))


def _positive_int(raw: str, name: str) -> int:
    if not raw.strip().isdigit() or int(raw) < 1:  # isdigit also rejects "-1" and "1.5"
        raise ValueError(f"{name}={raw!r} must be a positive integer (number of CPU threads)")
    return int(raw)


def decide_threads(
    requested: int | None, budget: CpuBudget, env: Mapping[str, str], current_threads: int | None = None
) -> ThreadDecision:
    """Pick the thread count (rules in the module docstring); raises ValueError for a bad override.

    `current_threads` is torch's count before the engine starts: a program that lowered it
    (torch.set_num_threads) keeps its choice, since the automatic rule only ever narrows.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"num_threads must be a positive integer, got {requested}")
        return ThreadDecision(requested, f"num_threads={requested} was asked for")
    if env.get(ENV_NUM_THREADS, "").strip():  # blank means unset, as for OpenMP
        n = _positive_int(env[ENV_NUM_THREADS], ENV_NUM_THREADS)
        return ThreadDecision(n, f"{ENV_NUM_THREADS}={n}")
    if env.get("OMP_NUM_THREADS", "").strip():
        raw = env["OMP_NUM_THREADS"].split(",")[0]  # OpenMP allows a per-level list
        n = _positive_int(raw, "OMP_NUM_THREADS")
        return ThreadDecision(n, f"OMP_NUM_THREADS={n}")
    n = budget.num_threads
    if budget.quota is None:
        reason = f"{budget.num_affinity_cpus} CPUs in the affinity mask, no CFS quota"
    else:
        reason = (
            f"CFS quota {budget.quota.num_cpus:g} CPUs ({budget.quota.source}), "
            f"{budget.num_affinity_cpus} CPUs in the affinity mask"
        )
    if current_threads is not None and 1 <= current_threads < n:
        return ThreadDecision(current_threads, f"torch was already set to {current_threads} threads (budget: {reason})")
    return ThreadDecision(n, reason)


def configure_threads(requested: int | None = None, *, is_cpu: bool = True) -> ThreadDecision:
    """Decide and apply (torch.set_num_threads) at engine start; logs the decision and its reason.

    On an accelerator the host threads only feed the device, so the count is still applied (it
    bounds the CPU the process takes from its neighbours) but logged at debug level.
    """
    import torch

    budget = read_cpu_budget()
    decision = decide_threads(requested, budget, os.environ, torch.get_num_threads())
    torch.set_num_threads(decision.num_threads)
    if decision.num_threads > budget.num_threads:
        logger.warning(
            "using %d CPU threads (%s), more than the %d this process may run at once: "
            "every parallel region will wait for the threads that are not running",
            decision.num_threads, decision.reason, budget.num_threads,
        )  # fmt: skip
    else:
        logger.log(
            logging.INFO if is_cpu else logging.DEBUG,
            "using %d CPU threads: %s; %s",
            decision.num_threads,
            decision.reason,
            wait_policy_note(),
        )
    return decision
