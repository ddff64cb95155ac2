"""pytest plugin: the session-scoped `control_plane` fixture (a real local Kubernetes).

One control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok
with fake GPU nodes; see e2e/controlplane/devcluster.py) is shared by the whole test run
and torn down at its end. It yields a `DevCluster`: `.kubeconfig` (path), `.api_client()`
(a fresh kubernetes ApiClient), `.kubectl(*args)`, `.bin_dir`, `.server`.

Binaries come from $TIDEPOOL_K8S_BIN_DIR, else `bash e2e/controlplane/build.sh
--print-bin-dir`. When they are missing the fixture FAILS (never skips) and names the
build command. Component logs stay in pytest's tmp dir (`control-plane*/<component>.log`).
Env: TIDEPOOL_KWOK_NODES (default 2) fake GPU nodes with 8 `nvidia.com/gpu` each.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

_CONTROLPLANE_DIR = Path(__file__).resolve().parent.parent / "e2e" / "controlplane"


def load_devcluster() -> ModuleType:
    """Import e2e/controlplane/devcluster.py whether or not it is on sys.path."""
    try:
        import devcluster
    except ImportError:
        sys.path.insert(0, str(_CONTROLPLANE_DIR))
        import devcluster
    return devcluster


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    devcluster = load_devcluster()
    try:
        bin_dir = devcluster.find_bin_dir()
    except devcluster.BinariesMissingError as exc:
        pytest.fail(str(exc), pytrace=False)
    cluster = devcluster.DevCluster(
        num_nodes=int(os.environ.get("TIDEPOOL_KWOK_NODES", "2")),
        state_dir=tmp_path_factory.mktemp("control-plane"),
        bin_dir=bin_dir,
    )
    cluster.start()  # on failure it cleans up and raises with the failing log's tail
    try:
        yield cluster
    finally:
        cluster.stop()


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.25, what: str = ""):
    """Poll predicate() until it returns something truthy; return that, or fail the test."""
    import time

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what or predicate} (last: {last!r})")


@pytest.fixture
def cp_namespace(control_plane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace on the shared control plane, deleted (not awaited) afterwards."""
    import re
    import uuid

    stem = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)
