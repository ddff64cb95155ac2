"""An InferenceService on CPU, end to end on real pods: the operator (chart RBAC, production defaults)
renders the pods, the kubelet runs them and their probes, the router finds the engines through
EndpointSlices, completions flow through the router's Service, a frozen engine loses readiness and
is restarted by its liveness probe, and a scale-down drains a streamed request before the pod exits 0.

The tests share one service (two replicas of the tiny model) and run in file order; each first
brings the service back to the state it needs. Nothing here waits on machine speed: engines are
frozen and thawed (cgroup freezer, `ctr tasks pause`) at points the test observes, and every wait
is for an observable state with a generous bound.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kubernetes import client, watch
from rp_support import (
    Operator,
    apply,
    completion,
    container_pid,
    cpu_service,
    describe,
    engine_pods,
    install_crd,
    operator_identity,
    pod_is_ready,
    service_url,
    set_paused,
    sigterm_pending,
    wait_for_events,
    wait_ready,
    wait_until,
)

from controlplane_fixture import dev_namespace

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(900)]

NAME = "chat"
DEV_ENV_CLAIMS = {"tidepool-dev-venv", "tidepool-dev-src", "tidepool-dev-python"}


@dataclass
class Served:
    namespace: str
    operator: Operator


@pytest.fixture(scope="module")
def served(real_cluster, rp_models, tmp_path_factory) -> Iterator[Served]:
    state = tmp_path_factory.mktemp("rp-serve")
    with dev_namespace(real_cluster, f"rp-serve-{uuid.uuid4().hex[:6]}", rp_models) as ns:
        install_crd(real_cluster)
        identity = operator_identity(real_cluster, state)
        op = Operator(identity.kubeconfig, [ns], state / "operator.log")
        try:
            out = apply(real_cluster, ns, cpu_service(NAME, real_cluster.dev_image, replicas=2))
            assert out.returncode == 0, out.stderr
            wait_ready(real_cluster, ns, NAME)
            yield Served(ns, op)
        finally:
            op.stop()
        forbidden = op.forbidden_lines()
        assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


def scale_to(cluster, ns: str, replicas: int) -> list[dict[str, Any]]:
    cluster.kubectl("scale", "-n", ns, f"inferenceservice/{NAME}", f"--replicas={replicas}")

    def settled() -> list[dict[str, Any]] | None:
        found = engine_pods(cluster, ns, NAME)
        live = [p for p in found if not p["metadata"].get("deletionTimestamp")]
        return live if len(found) == replicas and all(pod_is_ready(p) for p in live) else None

    try:
        return wait_until(settled, 600, f"{replicas} Ready engine pods", interval_s=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(cluster, ns)}") from None


def test_engine_pods_run_on_the_real_node_and_serve_through_the_router_service(real_cluster, served):
    ns = served.namespace
    engines = scale_to(real_cluster, ns, 2)
    for pod in engines:
        assert pod["spec"]["nodeName"] == "tidepool-real-0"
        claims = {
            v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v
        }
        assert claims >= DEV_ENV_CLAIMS  # the dev env's policy added them; the namespace enforces "restricted"
        engine = pod["spec"]["containers"][0]
        assert engine["securityContext"]["readOnlyRootFilesystem"] and engine["securityContext"]["runAsNonRoot"]
        status = engine_status(pod)
        assert status["started"] and status["ready"]  # the kubelet's startup and readiness probes passed

    # the router reads the pool Service's EndpointSlices: both engine pods, ready. The EndpointSlice controller
    # writes them after it sees the pods ready (asynchronously; a CI run read them a moment too early): wait.
    selector = f"kubernetes.io/service-name={NAME}-unified"
    pod_ips = {p["status"]["podIP"] for p in engines}

    def ready_ips() -> set[str]:
        out = real_cluster.kubectl("get", "endpointslices", "-n", ns, "-l", selector, "-o", "json")
        slices = json.loads(out.stdout)["items"]
        return {a for s in slices for e in s["endpoints"] if e["conditions"].get("ready") for a in e["addresses"]}

    wait_until(lambda: ready_ips() == pod_ips, 60, f"the EndpointSlices of {selector} list {sorted(pod_ips)} ready")

    router = service_url(real_cluster, ns, f"{NAME}-router")  # a ClusterIP: kube-proxy's rules on the node
    body = completion(router, NAME, max_tokens=8, ignore_eos=True)
    assert body["model"] == NAME and body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"


def engine_status(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["status"]["containerStatuses"] if c["name"] == "engine")


def test_a_frozen_engine_loses_readiness_and_its_liveness_probe_restarts_it(real_cluster, served):
    ns = served.namespace
    target = scale_to(real_cluster, ns, 2)[0]
    pod_name, restarts = target["metadata"]["name"], engine_status(target)["restartCount"]
    cid, _pid = container_pid(real_cluster, target)
    set_paused(real_cluster, cid, True)
    try:
        wait_until(lambda: not pod_is_ready(get_pod(real_cluster, ns, pod_name)), 300, f"{pod_name} to lose readiness")
        # the other replica still serves through the router while this one is out of the Service
        router = service_url(real_cluster, ns, f"{NAME}-router")
        assert completion(router, NAME, max_tokens=4, ignore_eos=True)["usage"]["completion_tokens"] == 4
        wait_for_events(real_cluster, ns, pod_name, "Killing", "liveness", 600)
    finally:
        set_paused(real_cluster, cid, False)

    def restarted_and_ready() -> bool:
        pod = get_pod(real_cluster, ns, pod_name)
        return engine_status(pod)["restartCount"] == restarts + 1 and pod_is_ready(pod)

    wait_until(restarted_and_ready, 600, f"{pod_name} restarted by its liveness probe and Ready again", interval_s=2)


def get_pod(cluster, ns: str, name: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)


class FinalStatus:
    """Watches one pod until it is deleted; keeps the last status the kubelet wrote."""

    def __init__(self, cluster, ns: str, name: str) -> None:
        self.core = client.CoreV1Api(cluster.api_client())
        self.ns, self.name = ns, name
        self.last: Any = None
        self.deleted = threading.Event()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream = self._watch.stream(
            self.core.list_namespaced_pod, self.ns, field_selector=f"metadata.name={self.name}", timeout_seconds=900
        )
        for event in stream:
            self.last = event["object"]
            if event["type"] == "DELETED":
                self.deleted.set()
                return

    def close(self) -> None:
        """Stop watching (at the next event or the watch's timeout: the thread is a daemon) and wait briefly."""
        self._watch.stop()
        self._thread.join(timeout=10)

    def exit_code(self) -> int | None:
        for status in (self.last.status.container_statuses or []) if self.last else []:
            if status.name == "engine" and status.state.terminated is not None:
                return status.state.terminated.exit_code
        return None


class FollowedLog:
    """One container's log, followed (`kubectl logs -f`) from its start until the container exits."""

    def __init__(self, cluster, ns: str, pod: str, container: str) -> None:
        core = client.CoreV1Api(cluster.api_client())
        self._resp = core.read_namespaced_pod_log(pod, ns, container=container, follow=True, _preload_content=False)
        self._parts: list[str] = []
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for chunk in self._resp.stream(4096):
                self._parts.append(chunk.decode(errors="replace"))
        except Exception:  # the connection closed under us (close()): keep what came
            pass
        finally:
            self.ended.set()

    def text(self) -> str:
        return "".join(self._parts)

    def close(self) -> None:
        self._resp.release_conn()
        self._thread.join(timeout=10)


def test_scale_down_drains_a_streamed_request_and_the_pod_exits_0(real_cluster, served, request):
    """The request is in flight when SIGTERM lands: its engine is frozen after the first streamed chunk
    and thawed only once the kubelet's SIGTERM is pending in the frozen process. The engine's own drain
    log line proves it (the freeze lands a process start after the first chunk, and the 900 tokens
    take many times that on any machine: were they done by then, the drain would find none)."""
    ns = served.namespace
    target = scale_to(real_cluster, ns, 2)[0]
    pod_name, ip = target["metadata"]["name"], target["status"]["podIP"]
    # the ReplicaSet removes the pod with the lowest deletion cost first
    real_cluster.kubectl("annotate", "pod", pod_name, "-n", ns, "controller.kubernetes.io/pod-deletion-cost=-1000")
    cid, pid = container_pid(real_cluster, target)
    final = FinalStatus(real_cluster, ns, pod_name)
    request.addfinalizer(final.close)  # a failed assertion below must not leave the watch running
    log = FollowedLog(real_cluster, ns, pod_name, "engine")
    request.addfinalizer(log.close)
    max_tokens = 900  # the served maxModelLen is 1024
    body = {
        "model": NAME, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"http://{ip}:8000/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
                break
        set_paused(real_cluster, cid, True)
        try:
            real_cluster.kubectl("scale", "-n", ns, f"inferenceservice/{NAME}", "--replicas=1")
            wait_until(lambda: sigterm_pending(pid), 300, f"the kubelet's SIGTERM to {pod_name}", interval_s=0.5)
        finally:
            set_paused(real_cluster, cid, False)
        done = False
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert done, f"the stream ended without [DONE] after {len(chunks)} chunks"
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == max_tokens, usage
    reasons = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    assert reasons == ["length"]
    assert final.deleted.wait(300), f"{pod_name} was never deleted"
    assert final.exit_code() == 0, final.last.status if final.last else None
    assert log.ended.wait(60), "the engine's log stream did not end with its container"
    drained = [int(m) for m in re.findall(r"draining: (\d+) in-flight request", log.text())]
    assert drained and drained[-1] >= 1, f"the drain found no request in flight: {drained}\n{log.text()[-3000:]}"
    assert [p["metadata"]["name"] for p in engine_pods(real_cluster, ns, NAME)] != [pod_name]
