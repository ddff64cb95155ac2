"""pytest plugin: the session-scoped `control_plane` and `real_cluster` fixtures (a real local Kubernetes).

`control_plane`: one control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kwok with fake GPU nodes, the LeaderWorkerSet controller; see e2e/controlplane/devcluster.py),
shared by the whole test run and torn down at its end. It yields a `DevCluster`: `.kubeconfig`
(path), `.api_client()` (a fresh kubernetes ApiClient), `.kubectl(*args)`, `.bin_dir`, `.server`.

`real_cluster` (the `realpods` tier): the same plus a real node (containerd + kubelet +
kube-proxy + CoreDNS) running the dev engine image with this checkout's environment mounted
(DEV ONLY, e2e/README.md); `.dev_image` is the image to put in `spec.engine.image`, and
`rp_namespace` is a fresh namespace where Tidepool's pods get that environment.

Both fail at teardown when a thread a test started is still running (see `threads_left`).

Binaries come from $TIDEPOOL_K8S_BIN_DIR, else `bash e2e/controlplane/build.sh
--print-bin-dir`. When they (or, for a real node, root and the Debian packages of
e2e/node/install-deps.sh) are missing the fixture FAILS (never skips) and names the command
that fixes it. Component logs stay in pytest's tmp dir (`control-plane*/<component>.log`,
`real-cluster*/`). Env: TIDEPOOL_KWOK_NODES (default 2) fake GPU nodes with 8 `nvidia.com/gpu` each.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
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


def _bin_dir(devcluster: ModuleType) -> Path:
    try:
        return devcluster.find_bin_dir()
    except devcluster.BinariesMissingError as exc:
        pytest.fail(str(exc), pytrace=False)


def threads_left(before: set[int | None], grace_s: float = 10.0) -> str:
    """The threads started since `before` (idents) still alive after `grace_s`, with their stacks; "" if none.

    A test's thread must be stopped and joined by the test. One left running keeps calling the API
    server (which stops next) into interpreter shutdown, where CPython 3.11 ends a daemon thread that
    wants the GIL back with pthread_exit; inside a kubernetes client call (pydantic-core's Rust
    frames cannot be unwound) that aborts pytest with SIGABRT and no message after every test passed.
    """
    _stop_library_threads()
    deadline = time.monotonic() + grace_s
    left = [
        t
        for t in threading.enumerate()
        if t.ident not in before
        and t is not threading.current_thread()
        and not isinstance(t, threading._DummyThread)  # a foreign (C-created) thread: not ours to join
    ]
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t for t in left if t.is_alive()]
    frames = sys._current_frames()
    return "\n".join(
        f"thread {t.name!r} (daemon={t.daemon}):\n" + "".join(traceback.format_stack(frames[t.ident])[-6:])
        for t in left
        if t.ident in frames
    )


def _stop_library_threads() -> None:
    """Stop the background threads libraries start on their own and never need stopping: tqdm's monitor
    (started by the first progress bar, e.g. an image build's; it only waits on an Event)."""
    tqdm_module = sys.modules.get("tqdm")
    monitor = getattr(getattr(tqdm_module, "tqdm", None), "monitor", None)
    if monitor is not None:
        monitor.exit()  # sets its stop event and joins it


@contextlib.contextmanager
def _cluster_session(cluster) -> Iterator:
    """Yield the started `cluster`, stop it afterwards; then fail if a test left a thread running."""
    before = {t.ident for t in threading.enumerate()}
    try:
        yield cluster
        left = threads_left(before)
    finally:
        cluster.stop()
    if left:
        pytest.fail(f"threads still running at the end of the session (stop and join them in the test):\n{left}")


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    devcluster = load_devcluster()
    cluster = devcluster.DevCluster(
        num_nodes=int(os.environ.get("TIDEPOOL_KWOK_NODES", "2")),
        state_dir=tmp_path_factory.mktemp("control-plane"),
        bin_dir=_bin_dir(devcluster),
    )
    cluster.start()  # on failure it cleans up and raises with the failing log's tail
    with _cluster_session(cluster):
        yield cluster


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    devcluster = load_devcluster()
    import devcluster_addons
    import devcluster_node

    bin_dir = _bin_dir(devcluster)
    problem = devcluster_node.real_node_problem()
    if problem:
        pytest.fail(f"the real-pod tier cannot run here: {problem}", pytrace=False)
    cluster = devcluster.DevCluster(
        num_nodes=1,
        state_dir=tmp_path_factory.mktemp("real-cluster"),
        bin_dir=bin_dir,
        real_node=True,
        dev_env=devcluster_addons.DevEnv.for_venv(Path(sys.prefix)),
    )
    cluster.start()
    with _cluster_session(cluster):
        yield cluster


@contextlib.contextmanager
def dev_namespace(cluster, name: str, models: Path) -> Iterator[str]:
    """A namespace on the real cluster, enforcing Pod Security "restricted", where Tidepool's pods run
    this checkout (the dev env), with `pvc://tidepool-dev-models/<folder>` -> `models/<folder>`;
    deleted (not awaited) afterwards, with its PersistentVolumes."""
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    cluster.enable_dev_env(name, models)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
        cluster.kubectl("delete", "pv", "-l", f"tidepool.dev/dev-env={name[:63]}", "--wait=false", check=False)


@pytest.fixture
def rp_namespace(real_cluster, rp_models: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh `dev_namespace` per test."""
    with dev_namespace(real_cluster, _namespace_name(request), rp_models) as name:
        yield name


@pytest.fixture(scope="session")
def rp_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Models the real-pod tests serve, readable by the pods' non-root uid: `tiny-llama` (random weights)."""
    from tidepool.engine.make_model import make_model

    root = tmp_path_factory.mktemp("rp-models")
    make_model("llama", "tiny", root / "tiny-llama", seed=0)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


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


def _namespace_name(request: pytest.FixtureRequest) -> str:
    import re
    import uuid

    stem = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    return f"{stem}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def cp_namespace(control_plane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace on the shared control plane, deleted (not awaited) afterwards."""
    name = _namespace_name(request)
    control_plane.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)
