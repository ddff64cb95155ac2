"""Process and port bookkeeping for the local control plane: start, find and stop.

Components run in their own process groups; `stop_processes` stops them in dependency
order (API consumers, kube-apiserver, etcd) with SIGTERM then SIGKILL, and waits until
each is gone (reaped, or at least a zombie), so no process or listening port survives.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

ETCD_DIR_PREFIX = "tidepool-etcd-"
OWNER_FILE = "etcd.pid"  # in each etcd dir: the pid of the etcd that uses it
# Stop order: the real node first (devcluster_node.teardown stops it in its own order), then the
# other consumers of the API, etcd last.
COMPONENTS = (
    "kube-proxy", "kubelet", "containerd", "node-holder", "coredns", "lws-controller",
    "kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd",
)  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """True if something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def listening_ports() -> set[int]:
    """Every TCP port in LISTEN state on this host (from /proc/net/tcp{,6})."""
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop_processes(
    pids: dict[str, int],
    procs: dict[str, subprocess.Popen] | None = None,
    binaries: dict[str, str] | None = None,
    grace_s: float = 5.0,
) -> None:
    """Stop components one by one (API consumers, apiserver, etcd), and wait for each.

    Each gets SIGTERM to its process group, then SIGKILL after grace_s. Order matters:
    an apiserver whose etcd is already gone hangs in graceful shutdown. `procs` (our own
    children) are reaped with wait(); pids read back from a state file come with
    `binaries` (name -> executable) so that a recycled pid is never signalled.
    """
    procs = procs or {}
    order = sorted(pids, key=lambda n: COMPONENTS.index(n) if n in COMPONENTS else -1)
    survivors = {}
    for name in order:
        pid = pids[name]
        if name not in procs and binaries is not None and not is_binary(pid, binaries.get(name)):
            continue  # already gone, or the pid now belongs to something else
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            if _wait_gone(pid, procs.get(name), time.monotonic() + grace_s):
                break
        else:
            survivors[name] = pid
    if survivors:
        raise RuntimeError(f"processes survived SIGKILL: {survivors}")


def _wait_gone(pid: int, proc: subprocess.Popen | None, deadline: float) -> bool:
    if proc is not None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            return False
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# Resolved in the parent: between fork and exec the child must not import anything.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child (preexec_fn): SIGKILL it when the parent dies, so a killed pytest leaks nothing."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def is_binary(pid: int, binary: str | None) -> bool:
    """True if pid runs `binary` (so a recycled pid is never mistaken for a component)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        return False
    return binary is None or exe == os.path.realpath(binary)


def remove_stale_etcd_dirs(parent: Path, min_age_s: float = 120.0) -> None:
    """Delete etcd data dirs left on tmpfs by clusters whose owner was SIGKILLed.

    A dir is stale when its etcd pid is no longer an etcd process, or when it has no pid
    file and is older than min_age_s (a cluster still starting writes it within seconds).
    """
    for d in parent.glob(ETCD_DIR_PREFIX + "*"):
        try:
            owner = int((d / OWNER_FILE).read_text())
        except FileNotFoundError:
            stale = time.time() - d.stat().st_mtime > min_age_s
        except (OSError, ValueError):
            stale = True
        else:
            stale = not _runs_etcd(owner)
        if stale:
            shutil.rmtree(d, ignore_errors=True)


def _runs_etcd(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)").endswith("/etcd")
    except OSError:
        return False
