"""Stopping a cluster with a real node leaves nothing on the host, and the next start works.

Checked after `stop()` (in-process) and after `e2e/dev-cluster down` (the CLI, as a user runs it):
no process of the cluster or of its pods (shims included), no mount of the node (the node's own
mount namespace is gone), no network namespace (no process holds it), no veth or route of its slot,
no iptables rule on the host naming its networks (kube-proxy's rules lived in the node's netns),
no cgroup under the slot's root, no slot record; and the same slot and state folder serve a second
start. These clusters run beside the session's `real_cluster`, so two real nodes share the host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rp_support import wait_until

from controlplane_fixture import load_devcluster

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def run_a_pod(cluster, image: str) -> None:
    """A pod Running on the real node (the pause image is the one image every node has)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sleeper", "namespace": "default"},
        "spec": {"containers": [{"name": "main", "image": image}], "nodeSelector": {"tidepool.dev/node": "real"}},
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pod))

    def running() -> dict | None:
        got = json.loads(cluster.kubectl("get", "pod", "sleeper", "-o", "json").stdout)
        return got if got["status"].get("phase") == "Running" else None

    got = wait_until(running, 300, "the pod Running on the real node", interval_s=1)
    assert got["spec"]["nodeName"] == "tidepool-real-0"


def leftovers(node: dict, pids: dict[str, int], state_dir: Path) -> list[str]:
    """Everything of this node still present on the host (empty when clean)."""
    procs = load_devcluster().procs
    found = [f"process {name} ({pid})" for name, pid in pids.items() if procs.pid_alive(pid)]
    inode = node["netns_inode"]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.stat(entry / "ns" / "net").st_ino == inode:
                    found.append(f"process {entry.name} in the node's netns")
            except OSError:
                continue
    mounts = Path("/proc/self/mountinfo").read_text()
    found += [f"mount {line.split()[4]}" for line in mounts.splitlines() if str(state_dir) in line]
    slot = node["slot"]
    if Path(f"/sys/class/net/tpn{slot}").exists():
        found.append(f"link tpn{slot}")
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    found += [f"route {r}" for r in routes.splitlines() if node["pod_cidr"] in r or node["service_cidr"] in r]
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    prefix = node["pod_cidr"].rsplit(".", 2)[0]
    found += [f"iptables {r}" for r in rules.splitlines() if prefix in r or "KUBE-" in r]
    for mount in Path("/sys/fs/cgroup").iterdir():
        if (mount / node["cgroup_root"].lstrip("/")).exists():
            found.append(f"cgroup {mount.name}{node['cgroup_root']}")
    if Path(f"/run/tidepool-dev-nodes/{slot}.json").exists():
        found.append(f"slot record {slot}")
    return found


def assert_sees_a_live_node(found: list[str]) -> None:
    """`leftovers()` on a running node must find it: otherwise an empty answer after stop proves nothing."""
    kinds = {item.split()[0] for item in found}
    assert {"process", "link", "route", "cgroup", "slot"} <= kinds, found


def test_stop_leaves_nothing_and_a_second_start_works(real_cluster, tmp_path):
    devcluster = load_devcluster()
    for attempt in range(2):  # the second start reuses the folder and finds a clean slate
        cluster = devcluster.DevCluster(
            num_nodes=1, state_dir=tmp_path / "second", bin_dir=real_cluster.bin_dir, real_node=True
        )
        with cluster:
            node, pids = dict(cluster.node), dict(cluster.pids)
            assert node["slot"] != real_cluster.node["slot"]
            run_a_pod(cluster, cluster._images[0].ref)
            assert_sees_a_live_node(leftovers(node, pids, tmp_path / "second"))
        assert leftovers(node, pids, tmp_path / "second") == [], f"start {attempt + 1}"


def test_cli_up_down_leaves_nothing_and_up_works_again(real_cluster, tmp_path):
    state_dir = tmp_path / "cli"
    env = {**os.environ, "TIDEPOOL_K8S_BIN_DIR": str(real_cluster.bin_dir), "TIDEPOOL_PYTHON": sys.executable}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(REPO / "e2e" / "dev-cluster"), *args, "--state-dir", str(state_dir)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    for attempt in range(2):
        up = cli("up", "--nodes", "1")
        assert up.returncode == 0, up.stderr
        state = json.loads((state_dir / "state.json").read_text())
        try:
            kubectl = [str(real_cluster.bin_dir / "kubectl"), f"--kubeconfig={state['kubeconfig']}"]
            nodes = subprocess.run([*kubectl, "get", "nodes", "--no-headers"], capture_output=True, text=True)
            lines = sorted(nodes.stdout.splitlines())
            assert [line.split()[:2] for line in lines] == [["kwok-gpu-0", "Ready"], ["tidepool-real-0", "Ready"]]
            assert cli("status").returncode == 0
            assert_sees_a_live_node(leftovers(state["node"], state["pids"], state_dir))
        finally:
            down = cli("down")
        assert down.returncode == 0, down.stderr
        assert leftovers(state["node"], state["pids"], state_dir) == [], f"up {attempt + 1}"
