"""Host resources of a dev cluster's real node: an address slot, its cgroups, and sweeping them away.

Several dev clusters may run on one machine at once (helpers' tests, CI, a developer's cluster), so
every host-visible name a real node uses comes from a *slot* k in 0..249, held with an exclusive
flock on `/run/tidepool-dev-nodes/<k>.lock` by the node's namespace holder process for as long as
the node lives:

    host side of the veth   tpn<k>, 10.251.k.1/30      (the apiserver, CoreDNS, webhooks listen here)
    node side (eth0)        10.251.k.2/30              (the kubelet's node IP)
    pod network             10.252.k.0/24 via the node  (CNI bridge inside the node's netns)
    Service network         10.253.k.0/24 via the node  (kube-proxy's rules inside the node's netns)
    cgroup root             /tidepool-node-<k>          (in every cgroup hierarchy)

Invariants: a slot whose lock is free belongs to no live node; `sweep()` then removes whatever a
killed node left (processes in its cgroups or network namespace, the cgroups, the host veth), found
through `<k>.json`, so a SIGKILLed test run never poisons the next one. Nothing here touches
anything not named by a slot record.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REGISTRY = Path("/run/tidepool-dev-nodes")
NUM_SLOTS = 250


@dataclass(frozen=True, slots=True)
class NodeAddresses:
    """Every host-visible name of the real node in slot `slot`."""

    slot: int
    host_link: str
    host_ip: str
    node_ip: str
    pod_cidr: str
    pod_gateway: str
    service_cidr: str
    service_ip: str  # the `kubernetes` Service: first address of the Service network
    cgroup_root: str

    @classmethod
    def for_slot(cls, k: int) -> NodeAddresses:
        return cls(
            slot=k,
            host_link=f"tpn{k}",
            host_ip=f"10.251.{k}.1",
            node_ip=f"10.251.{k}.2",
            pod_cidr=f"10.252.{k}.0/24",
            pod_gateway=f"10.252.{k}.1",
            service_cidr=f"10.253.{k}.0/24",
            service_ip=f"10.253.{k}.1",
            cgroup_root=f"/tidepool-node-{k}",
        )

    def networks(self) -> list[ipaddress.IPv4Network]:
        return [
            ipaddress.ip_network(f"{self.host_ip}/30", strict=False),
            ipaddress.ip_network(self.pod_cidr),
            ipaddress.ip_network(self.service_cidr),
        ]


def _host_routes() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True, text=True)
    routes = []
    for route in json.loads(out.stdout or "[]"):
        dst = route.get("dst", "")
        if dst in ("", "default") or route.get("type") in ("local", "broadcast"):
            continue
        with contextlib.suppress(ValueError):
            routes.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return routes


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def acquire_slot() -> tuple[NodeAddresses, int]:
    """The first free slot whose networks collide with no host route: (addresses, locked fd).

    The caller passes the fd to the namespace holder (which keeps the lock for the node's life) and
    closes its own copy once the holder runs. Leftovers of a dead node in a free slot are swept first.
    """
    REGISTRY.mkdir(mode=0o755, exist_ok=True)
    routes = _host_routes()
    for k in range(NUM_SLOTS):
        addrs = NodeAddresses.for_slot(k)
        fd = os.open(REGISTRY / f"{k}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        sweep(k)
        if _link_exists(addrs.host_link) or any(n.overlaps(r) for n in addrs.networks() for r in routes):
            os.close(fd)  # taken by something that is not ours: leave it alone
            continue
        return addrs, fd
    raise RuntimeError(f"no free dev-node slot in {REGISTRY} (all {NUM_SLOTS} in use or colliding with routes)")


def record(addrs: NodeAddresses, holder_pid: int, netns_inode: int, state_dir: Path) -> None:
    """What `sweep()` needs to clean this slot after its node dies."""
    info = {**asdict(addrs), "holder_pid": holder_pid, "netns_inode": netns_inode, "state_dir": str(state_dir)}
    (REGISTRY / f"{addrs.slot}.json").write_text(json.dumps(info, indent=2))


def sweep(k: int) -> None:
    """Remove what the dead node of slot k left: processes, cgroups, the host veth, the record.

    Call only while holding the slot's lock (so no live node owns it).
    """
    path = REGISTRY / f"{k}.json"
    try:
        info = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return
    kill_node_processes(info["cgroup_root"], info["netns_inode"], info["node_ip"])
    remove_cgroups(info["cgroup_root"])
    if _link_exists(info["host_link"]):
        subprocess.run(["ip", "link", "del", info["host_link"]], capture_output=True)
    path.unlink(missing_ok=True)


# ---- cgroups -----------------------------------------------------------------------------------
def cgroup_mounts() -> list[Path]:
    """Every cgroup hierarchy mounted on this host (v1 controllers, named hierarchies, cgroup2)."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype = post.split()[0] if post else ""
        if fstype in ("cgroup", "cgroup2"):
            mounts.append(Path(pre.split()[4]))
    return mounts


def create_cgroup_root(root: str) -> None:
    """The kubelet's --cgroup-root must exist in every hierarchy; v1 cpuset needs cpus/mems copied down."""
    for mount in cgroup_mounts():
        path = mount / root.lstrip("/")
        path.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):  # v1 cpuset: empty means no task may join
            parent, child = mount / name, path / name
            if parent.exists() and child.exists() and not child.read_text().strip():
                child.write_text(parent.read_text())


def _cgroup_pids(root: str) -> set[int]:
    pids: set[int] = set()
    for mount in cgroup_mounts():
        base = mount / root.lstrip("/")
        if not base.is_dir():
            continue
        # The tree changes while it is walked (pods' cgroups come and go): os.walk skips a directory that
        # vanished mid-walk (it holds no process any more) and goes on with the rest.
        for folder, _dirs, files in os.walk(base):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(p) for p in Path(folder, "cgroup.procs").read_text().split())
    return pids


def _netns_pids(inode: int) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns" / "net").st_ino == inode:
                    pids.add(int(entry.name))
    return pids


def _is_node_netns(pids: set[int], node_ip: str) -> bool | None:
    """Does the netns these pids share hold the node's address (so it is the node's, not another
    namespace given the same inode number after the node's was freed)? None: every pid was gone."""
    for pid in sorted(pids):
        out = subprocess.run(
            ["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-4", "-o", "addr"], capture_output=True, text=True
        )
        if out.returncode == 0:
            return f" {node_ip}/" in out.stdout
    return None


def kill_node_processes(cgroup_root: str, netns_inode: int | None, node_ip: str = "", timeout_s: float = 30.0) -> None:
    """SIGKILL every process in the node's cgroups (pods) or network namespace (containerd, shims,
    kubelet, the holder) until none is left. A network namespace counts only if it is not the host's
    and carries `node_ip`, so this never matches a host process or a stranger's namespace."""
    host_netns = os.stat("/proc/self/ns/net").st_ino  # this process runs in the host netns
    deadline = time.monotonic() + timeout_s
    checked_netns = False
    while True:
        pids = _cgroup_pids(cgroup_root)
        if netns_inode and netns_inode != host_netns:
            in_netns = _netns_pids(netns_inode)
            if in_netns and not checked_netns:
                verdict = _is_node_netns(in_netns, node_ip)
                checked_netns = verdict is not None
                if verdict is not True:  # a stranger's namespace, or nobody left to ask: kill nothing there
                    netns_inode = None if verdict is False else netns_inode
                    in_netns = set()
            pids |= in_netns
        pids.discard(os.getpid())
        if not pids:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"dev node processes survive SIGKILL: {sorted(pids)}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def remove_cgroups(root: str, timeout_s: float = 30.0) -> None:
    """rmdir the node's cgroup trees, deepest first (a cgroup goes once its last task has exited)."""
    deadline = time.monotonic() + timeout_s
    for mount in cgroup_mounts():
        base = mount / root.lstrip("/")
        if not base.is_dir():
            continue
        dirs = sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, base]:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while a killed task is still exiting
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
