"""Tearing a control plane down leaves no process, listening port or tmpfs data behind.

The session fixture cannot check its own teardown, so these start SEPARATE instances
(in-process, and through the dev-cluster CLI as a user would) and check them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane_fixture import load_devcluster

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
PROCS = load_devcluster().procs  # pid/port helpers: e2e/controlplane/devcluster_procs.py


def _assert_gone(pids: dict[str, int], ports: dict[str, int], etcd_dir: str) -> None:
    alive = {name: pid for name, pid in pids.items() if PROCS.pid_alive(pid)}
    assert not alive, f"processes left behind: {alive}"
    listening = PROCS.listening_ports() & set(ports.values())
    assert not listening, f"ports still listening: {listening} of {ports}"
    assert not Path(etcd_dir).exists(), f"etcd data left on tmpfs: {etcd_dir}"


def test_second_cluster_stops_without_leftovers(control_plane, tmp_path):
    devcluster = load_devcluster()
    cluster = devcluster.DevCluster(num_nodes=1, state_dir=tmp_path / "second", bin_dir=control_plane.bin_dir)
    with cluster:
        pids, ports, etcd_dir = dict(cluster.pids), dict(cluster.ports), str(cluster.etcd_dir)
        assert set(pids) == {
            "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "lws-controller"
        }  # fmt: skip
        assert all(PROCS.pid_alive(p) for p in pids.values())
        assert set(ports.values()) <= PROCS.listening_ports()
        assert cluster.server != control_plane.server
        nodes = cluster.kubectl("get", "nodes", "-o", "name").stdout.split()
        assert nodes == ["node/kwok-gpu-0"]
    _assert_gone(pids, ports, etcd_dir)


def test_cli_up_env_down_leaves_nothing(control_plane, tmp_path):
    state_dir = tmp_path / "cli"
    env = {**os.environ, "TIDEPOOL_K8S_BIN_DIR": str(control_plane.bin_dir), "TIDEPOOL_PYTHON": sys.executable}
    cli = [str(REPO / "e2e" / "dev-cluster")]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*cli, *args, "--state-dir", str(state_dir)], env=env, capture_output=True, text=True, timeout=400
        )  # a second control plane starting beside the shared one on a busy 2-core machine: minutes, not seconds

    try:  # `down` runs whatever `up` got to, so a failed or timed-out start leaves nothing either
        up = run("up", "--nodes", "1", "--no-real-node")  # the real node's CLI run is in tests/realpods
        assert up.returncode == 0, up.stderr
        state = json.loads((state_dir / "state.json").read_text())
        assert f"export KUBECONFIG={state['kubeconfig']}" in run("env").stdout
        assert run("status").returncode == 0
        nodes = subprocess.run(
            [
                str(control_plane.bin_dir / "kubectl"),
                f"--kubeconfig={state['kubeconfig']}",
                "get",
                "nodes",
                "-o",
                "jsonpath={.items[*].metadata.name}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert nodes.stdout == "kwok-gpu-0", nodes.stderr
    finally:
        down = run("down")
    assert down.returncode == 0, down.stderr
    assert not (state_dir / "state.json").exists()
    _assert_gone(state["pids"], state["ports"], state["etcd_dir"])


def test_missing_binaries_fail_the_fixture_naming_the_build_command(tmp_path):
    """With no binaries the fixture must FAIL (not skip) and name the build script."""
    (tmp_path / "test_needs_cluster.py").write_text("def test_x(control_plane):\n    pass\n")
    env = {
        **os.environ,
        "TIDEPOOL_K8S_BIN_DIR": str(tmp_path / "empty-bin"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO / "e2e" / "controlplane")]),
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "controlplane_fixture",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            "--rootdir",
            str(tmp_path),
            "-rA",
            "test_needs_cluster.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 error" in out.stdout and "skipped" not in out.stdout, out.stdout
    assert "bash e2e/controlplane/build.sh" in out.stdout, out.stdout
