"""Thread count from the cgroup CPU quota and the affinity mask, on fake cgroup trees (v1, v2, hybrid, nested)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tidepool.engine.threads import (
    ENV_NUM_THREADS,
    CpuBudget,
    CpuQuota,
    cgroup_cpu_quota,
    configure_threads,
    decide_threads,
    read_cpu_budget,
)


class FakeHost:
    """A /proc/self (mountinfo + cgroup) and cgroup mount points under one tmp dir."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path
        self.proc = tmp_path / "proc_self"
        self.proc.mkdir()
        self.mount_lines: list[str] = []
        self.cgroup_lines: list[str] = []

    def mount_v2(self, cgroup_path: str, mount_root: str = "/") -> Path:
        point = self.root / "unified"
        point.mkdir(exist_ok=True)
        self.mount_lines.append(f"41 31 0:38 {mount_root} {point} rw,relatime - cgroup2 cgroup2 rw")
        self.cgroup_lines.append(f"0::{cgroup_path}")
        return point

    def mount_v1(self, cgroup_path: str, controllers: str = "cpu,cpuacct", mount_root: str = "/") -> Path:
        point = self.root / controllers
        point.mkdir(exist_ok=True)
        self.mount_lines.append(f"32 31 0:28 {mount_root} {point} rw,relatime - cgroup cgroup rw,{controllers}")
        self.cgroup_lines.append(f"3:{controllers}:{cgroup_path}")
        return point

    def write(self) -> Path:
        unrelated = f"35 31 0:32 / {self.root / 'memory'} rw,relatime - cgroup cgroup rw,memory"
        (self.proc / "mountinfo").write_text("\n".join([unrelated, *self.mount_lines]) + "\n")
        (self.proc / "cgroup").write_text("\n".join(["4:memory:/x", *self.cgroup_lines]) + "\n")
        return self.proc


def put(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text + "\n")


def test_v2_quota_and_unlimited(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    point = host.mount_v2("/kubepods/pod1/ctr")
    put(point / "kubepods" / "pod1" / "ctr", cpu__max="150000 100000")
    quota = cgroup_cpu_quota(host.write())
    assert quota is not None and quota.num_cpus == 1.5
    assert quota.source.endswith("kubepods/pod1/ctr/cpu.max")
    put(point / "kubepods" / "pod1" / "ctr", cpu__max="max 100000")
    assert cgroup_cpu_quota(host.proc) is None


def test_v2_nested_tightest_wins(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    point = host.mount_v2("/kubepods/pod1/ctr")
    put(point / "kubepods", cpu__max="max 100000")
    put(point / "kubepods" / "pod1", cpu__max="100000 100000")  # the pod's limit: 1 CPU
    put(point / "kubepods" / "pod1" / "ctr", cpu__max="300000 100000")  # the container's own: 3
    quota = cgroup_cpu_quota(host.write())
    assert quota is not None and quota.num_cpus == 1.0
    assert "pod1/cpu.max" in quota.source


def test_v1_quota_fractional_and_unlimited(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    point = host.mount_v1("/docker/abc")
    put(point / "docker" / "abc", cpu__cfs_quota_us="50000", cpu__cfs_period_us="100000")
    put(point / "docker", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    quota = cgroup_cpu_quota(host.write())
    assert quota is not None and quota.num_cpus == 0.5
    put(point / "docker" / "abc", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    assert cgroup_cpu_quota(host.proc) is None


def test_v1_cgroup_namespace_mount_point_is_own_cgroup(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: the mount shows the container's own cgroup as its root.
    host = FakeHost(tmp_path)
    point = host.mount_v1("/docker/abc", controllers="cpu", mount_root="/docker/abc")
    put(point, cpu__cfs_quota_us="200000", cpu__cfs_period_us="100000")
    quota = cgroup_cpu_quota(host.write())
    assert quota is not None and quota.num_cpus == 2.0


def test_hybrid_takes_the_tighter_version(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    v2 = host.mount_v2("/a")
    v1 = host.mount_v1("/a")
    put(v2 / "a", cpu__max="400000 100000")
    put(v1 / "a", cpu__cfs_quota_us="250000", cpu__cfs_period_us="100000")
    quota = cgroup_cpu_quota(host.write())
    assert quota is not None and quota.num_cpus == 2.5


def test_missing_or_garbage_files_mean_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path / "nowhere") is None
    host = FakeHost(tmp_path)
    point = host.mount_v2("/a")
    put(point / "a", cpu__max="lots please")
    assert cgroup_cpu_quota(host.write()) is None


def test_budget_is_min_of_affinity_and_floor_of_quota(tmp_path: Path) -> None:
    assert CpuBudget(8, CpuQuota(2.9, "q")).num_threads == 2
    assert CpuBudget(2, CpuQuota(16.0, "q")).num_threads == 2
    assert CpuBudget(4, CpuQuota(0.25, "q")).num_threads == 1  # below one CPU: still one thread
    assert CpuBudget(3, None).num_threads == 3
    host = FakeHost(tmp_path)
    point = host.mount_v2("/a")
    put(point / "a", cpu__max="100000 100000")
    assert read_cpu_budget(host.write(), num_affinity_cpus=6).num_threads == 1


def test_decide_order_request_env_omp_auto() -> None:
    budget = CpuBudget(8, CpuQuota(3.0, "/sys/fs/cgroup/cpu.max"))
    assert decide_threads(5, budget, {ENV_NUM_THREADS: "2"}).num_threads == 5
    assert decide_threads(None, budget, {ENV_NUM_THREADS: "2", "OMP_NUM_THREADS": "7"}).num_threads == 2
    assert decide_threads(None, budget, {"OMP_NUM_THREADS": "7,2"}).num_threads == 7
    auto = decide_threads(None, budget, {})
    assert auto.num_threads == 3
    assert "CFS quota 3 CPUs" in auto.reason and "8 CPUs in the affinity mask" in auto.reason
    assert "no CFS quota" in decide_threads(None, CpuBudget(4, None), {}).reason
    # A program that lowered torch's count keeps it; a higher default is narrowed to the budget.
    kept = decide_threads(None, budget, {}, current_threads=1)
    assert kept.num_threads == 1 and "already set to 1" in kept.reason
    assert decide_threads(None, budget, {}, current_threads=64).num_threads == 3


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5", " "])
def test_bad_env_override_names_the_variable(raw: str) -> None:
    if not raw.strip():
        assert decide_threads(None, CpuBudget(2, None), {ENV_NUM_THREADS: raw}).num_threads >= 1
        return
    with pytest.raises(ValueError, match=ENV_NUM_THREADS):
        decide_threads(None, CpuBudget(2, None), {ENV_NUM_THREADS: raw})


def test_configure_applies_and_logs(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv(ENV_NUM_THREADS, "1")
    try:
        with caplog.at_level(logging.INFO, logger="tidepool.engine.threads"):
            decision = configure_threads()
        assert decision.num_threads == 1 and torch.get_num_threads() == 1
        assert f"using 1 CPU threads: {ENV_NUM_THREADS}=1" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_openmp_defaults_keep_a_users_choice_and_say_when_too_late(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidepool.engine import threads

    monkeypatch.setattr(threads, "_openmp_defaults_in_time", threads._openmp_defaults_in_time)  # restored after
    env: dict[str, str] = {}
    in_time = threads.set_openmp_defaults(env)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert in_time is False  # this test process imported torch first
    assert "runtime's default" in threads.wait_policy_note(env)
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    threads.set_openmp_defaults(chosen)
    assert chosen["OMP_WAIT_POLICY"] == "ACTIVE" and threads.wait_policy_note(chosen) == "OpenMP wait policy ACTIVE"


def test_importing_the_engine_first_makes_waits_passive() -> None:
    import os
    import subprocess
    import sys

    code = (
        "import os, tidepool.engine, torch; from tidepool.engine.threads import wait_policy_note; "
        "print(os.environ['OMP_WAIT_POLICY'], wait_policy_note())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "PASSIVE OpenMP wait policy PASSIVE"


def test_processes_that_are_not_engines_keep_openmp_and_torch_out() -> None:
    """The engine's one import side effect (engine/__init__.py) stays out of the operator and the router: neither
    they, the `tidepool` console script nor the contract they share with the engine import tidepool.engine."""
    import os
    import subprocess
    import sys

    code = (
        "import importlib, os, pkgutil, sys, tidepool.contract as c; "
        "[importlib.import_module(f'tidepool.contract.{m.name}') for m in pkgutil.iter_modules(c.__path__)]; "
        "import tidepool.cli, tidepool.operator.main, tidepool.router.cli; "
        "print(sorted(m for m in sys.modules if m.startswith('tidepool.engine') or m == 'torch'), "
        "os.environ.get('OMP_WAIT_POLICY'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/", check=True)
    assert out.stdout.strip() == "[] None"
