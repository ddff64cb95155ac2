"""A multi-node pool's worker ranks pass the probes the operator renders, exactly while they are healthy.

The operator renders one pod template for every rank of a `tensor 2 x pipeline 2` replica (two pods,
two ranks each). Here both "pods" run on this machine as real `tidepool serve` processes started
from the rendered container args and the control channel's key env; only what the kubelet and the
pod's volumes would provide is substituted ($(VAR)s, the model path, the key file the pool's Secret
volume holds) plus a distinct local port per pod, since both share this host. The rendered probes
then run as the kubelet runs them (HTTP GET on the container port the probe names; 200-399 passes,
any other status or no answer fails) against the worker pod, whose process serves no API: before its
group forms, while it serves, and after the leader is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tidepool.contract.wire import CONTROL_KEY_FILE_ENV
from tidepool.engine.distributed.health import NodeHealth, serve_health
from tidepool.engine.distributed.launch import free_port
from tidepool.operator.builders import ClusterFeatures, ServiceView, desired_state

START_TIMEOUT_S = 600.0  # four torch processes loading on a busy 2-core machine
STOP_TIMEOUT_S = 120.0
ENGINE_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


def get(port: int, path: str, timeout: float = 5.0) -> tuple[int | None, Any]:
    """(status, JSON body); status None when nothing answered (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")
    except OSError:  # URLError, refused, reset, timeout
        return None, None


def status(port: int, path: str) -> int | None:
    return get(port, path)[0]


# --- the endpoint alone (no torch): what each state of a node answers ---------------------------------


def test_health_endpoint_answers_from_the_nodes_state() -> None:
    flags = [threading.Event(), threading.Event()]
    alive = {"value": True}
    health = NodeHealth(flags, lambda: alive["value"])
    port = free_port()
    server = serve_health("127.0.0.1", port, health)
    try:
        assert (status(port, "/health"), status(port, "/ready")) == (200, 503)  # loading
        flags[0].set()
        assert get(port, "/ready") == (503, {"ready": False, "reason": "loading: 1/2 ranks ready"})
        flags[1].set()
        assert (status(port, "/health"), status(port, "/ready")) == (200, 200)
        assert status(port, "/v1/models") == 404  # a worker node serves no API
        alive["value"] = False  # a spawned rank died
        assert (status(port, "/health"), status(port, "/ready")) == (503, 503)
        alive["value"] = True
        health.stop("the group shut down")
        assert get(port, "/health") == (503, {"status": "dead", "detail": "the group shut down"})
        assert status(port, "/ready") == 503
    finally:
        server.shutdown()
        server.server_close()


def test_a_taken_port_fails_the_worker_node_before_any_rank_starts(tiny_model_dir: Path) -> None:
    from tidepool.engine.distributed.launch import run_worker_node
    from tidepool.engine.distributed.parallel_state import ParallelConfig
    from tidepool.engine.engine_config import EngineConfig

    port = free_port()
    blocker = serve_health("127.0.0.1", port, NodeHealth([], lambda: True))
    try:
        config = EngineConfig(model=str(tiny_model_dir), device="cpu", pipeline_parallel_size=2, nnodes=2)
        parallel = ParallelConfig(1, 2, 2, "127.0.0.1", free_port())
        with pytest.raises(ValueError, match=f"health endpoint on 127.0.0.1:{port}"):
            run_worker_node(config, parallel, 1, health_address=("127.0.0.1", port))
    finally:
        blocker.shutdown()
        blocker.server_close()


# --- a real tensor 2 x pipeline 2 group, started from the rendered pod template ------------------------


def rendered_rank_pod() -> dict[str, Any]:
    """The engine container every rank of a tp2 x pp2 replica runs (StatefulSet groups: no LWS installed)."""
    spec = {
        "model": {"uri": "pvc://models/tiny"},
        "parallelism": {"tensor": 2, "pipeline": 2},
        "resources": {"gpusPerReplica": 4},
        # CPU-only machine: the engine flags a user may add to run this group on CPUs.
        "engine": {"maxModelLen": 256, "extraArgs": ["--device=cpu", "--num-kv-blocks=64"]},
    }
    children = desired_state("svc", "ns", ServiceView.from_spec(spec), ClusterFeatures()).children
    workloads = [c for c in children if c["kind"] in ENGINE_KINDS]
    groups = [w for w in workloads if w["kind"] == "StatefulSet" and w["spec"]["replicas"] == 2]
    assert groups, "a tp2 x pp2 replica is a group of two pods"
    return groups[0]["spec"]["template"]["spec"]["containers"][0]


def pod_argv(container: dict[str, Any], rank: int, model: Path, port: int, master_port: int) -> list[str]:
    """The container's command line on "node" `rank`: what the kubelet expands, the volume provides, and this
    host needs (a port per pod; a free rendezvous port, since other tests may hold 29500)."""
    env = {"TIDEPOOL_NODE_RANK": str(rank), "TIDEPOOL_MASTER_ADDR": "127.0.0.1"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    for flag, value in (("--model", str(model)), ("--host", "127.0.0.1"), ("--port", str(port))):
        args[args.index(flag) + 1] = value
    args[args.index("--master-port") + 1] = str(master_port)
    tidepool = Path(sys.executable).with_name("tidepool")
    return [str(tidepool), *container["command"][1:], *args]


def pod_env(container: dict[str, Any], volumes: Path) -> dict[str, str]:
    """What the ranks need from the rendered env: the control channel's key file, placed under
    `volumes`/<volume name> where the pod's Secret volume would hold it (a fresh key stands in for the one the
    operator draws when it creates the Secret)."""
    rendered = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    key_file = rendered[CONTROL_KEY_FILE_ENV]
    (mount,) = [m for m in container["volumeMounts"] if key_file.startswith(m["mountPath"] + "/")]
    local = volumes / mount["name"] / posixpath.relpath(key_file, mount["mountPath"])
    local.parent.mkdir(parents=True)
    local.write_text(secrets.token_urlsafe(32))
    return {CONTROL_KEY_FILE_ENV: str(local)}


def kubelet_probe(container: dict[str, Any], name: str, local_port: int) -> bool:
    probe = container[name]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe["port"] in ports, f"{name} names a port the container does not declare"
    code, _ = get(local_port, probe["path"], container[name]["timeoutSeconds"])
    return code is not None and 200 <= code < 400


def wait_for(condition: Callable[[], bool], timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}" for log in logs)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")


@pytest.fixture()
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.slow
def test_worker_rank_passes_the_rendered_probes_exactly_while_healthy(
    tiny_model_dir: Path, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    container = rendered_rank_pod()
    leader_port, worker_port, master_port = free_port(), free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **pod_env(container, tmp_path / "volumes")}
    logs = [tmp_path / "leader.log", tmp_path / "worker.log"]

    def start(rank: int, port: int) -> subprocess.Popen[bytes]:
        argv = pod_argv(container, rank, tiny_model_dir, port, master_port)
        with logs[rank].open("wb") as log:
            proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        processes.append(proc)
        return proc

    # The worker pod first: it starts (startup and liveness pass) but cannot be Ready without its leader.
    worker = start(1, worker_port)
    wait_for(lambda: kubelet_probe(container, "startupProbe", worker_port), START_TIMEOUT_S, "worker startup", logs)
    assert kubelet_probe(container, "livenessProbe", worker_port)
    assert not kubelet_probe(container, "readinessProbe", worker_port)
    assert get(worker_port, "/ready")[1]["reason"].startswith("loading")

    leader = start(0, leader_port)
    for port, who in ((worker_port, "worker"), (leader_port, "leader")):
        wait_for(lambda p=port: kubelet_probe(container, "readinessProbe", p), START_TIMEOUT_S, f"{who} Ready", logs)
    assert kubelet_probe(container, "livenessProbe", worker_port)
    assert get(worker_port, "/health")[1]["status"] == "ok"
    # The group serves through the leader (the worker ranks hold stages and shards of every step).
    request = urllib.request.Request(
        f"http://127.0.0.1:{leader_port}/v1/completions",
        data=json.dumps({"model": "svc", "prompt": "hello", "max_tokens": 4, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 4

    leader.send_signal(signal.SIGKILL)
    leader.wait(30)
    # Liveness fails (503 while the node winds down, then no answer once it exited): the kubelet restarts it.
    wait_for(
        lambda: not kubelet_probe(container, "livenessProbe", worker_port), STOP_TIMEOUT_S, "worker unhealthy", logs
    )
    assert not kubelet_probe(container, "readinessProbe", worker_port)
    worker.wait(STOP_TIMEOUT_S)
    assert not kubelet_probe(container, "livenessProbe", worker_port)
