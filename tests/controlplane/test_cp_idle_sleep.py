"""`autoscaling.idle: sleep` on the real control plane: an idle pool keeps its replicas and is put to sleep, and a
request held by the router wakes it.

KWOK pods serve nothing, so two stand-ins play the pods: the synthetic metrics feed (autoscale_feed.py: idle
engines, and a router whose held requests the test sets), and `SleepEngines`, which answers vLLM's sleep API
(`GET /is_sleeping`, `POST /sleep`, `POST /wake_up`, paths from tidepool.contract.sleep) for every pod behind the
operator's TIDEPOOL_POD_URL_TEMPLATE and records each call. Checked: the engine pods run with
`--enable-sleep-mode`; after idleSeconds the pod gets `POST /sleep?level=1`, the Deployment keeps its replica,
status.autoscaling.asleepSince is set and a `Sleeping` Event is posted; held requests bring `POST /wake_up`,
clear asleepSince and post `Woken`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_kit import get_isvc, wait_until

from tidepool.contract.sleep import IS_SLEEPING_KEY, IS_SLEEPING_PATH, SLEEP_MODE_FLAG, SLEEP_PATH, WAKE_UP_PATH

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(420)]


@dataclass
class SleepEngines:
    """Each pod's sleep state (by "namespace/pod") and every call made: (method, pod, path with query)."""

    asleep: dict[str, bool] = field(default_factory=dict)
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, method: str, pod: str, path: str) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.calls.append((method, pod, path))
            route = path.split("?", 1)[0]
            if method == "GET" and route == IS_SLEEPING_PATH:
                return 200, {IS_SLEEPING_KEY: self.asleep.get(pod, False)}
            if method == "POST" and route in (SLEEP_PATH, WAKE_UP_PATH):
                self.asleep[pod] = route == SLEEP_PATH
                return 200, {}
            return 404, {"error": {"message": f"{method} {path}"}}

    def posted(self, route: str) -> list[tuple[str, str]]:
        with self.lock:
            return [(pod, path) for method, pod, path in self.calls if method == "POST" and path.startswith(route)]


@contextmanager
def sleep_engines_server(engines: SleepEngines) -> Iterator[str]:
    """Serve `engines` at `<url>/{namespace}/{pod}/...`; the server and its request threads end on exit."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            _, namespace, pod, rest = self.path.split("/", 3)
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            status, body = engines.handle(self.command, f"{namespace}/{pod}", "/" + rest)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *_args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = False  # server_close() joins the request threads
    thread = threading.Thread(target=server.serve_forever, name="sleep-engines", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)


@pytest.fixture
def sleep_engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[SleepEngines]:
    """The pods' sleep API; requested before `autoscaling_operator`, so the operator starts with the template set."""
    engines = SleepEngines()
    with sleep_engines_server(engines) as url:
        monkeypatch.setenv("TIDEPOOL_POD_URL_TEMPLATE", url + "/{namespace}/{pod}")
        yield engines


def isvc(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "hf://org/model"},
            "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "1Gi"},
            "pools": {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}},
            "router": {"replicas": 1},
            "autoscaling": {
                "enabled": True,
                "idle": "sleep",
                "scaleToZero": {"idleSeconds": 30},
                "stabilization": {"upSeconds": 0, "downSeconds": 0},
            },
        },
    }


def autoscaling_status(cluster, namespace: str, name: str) -> dict[str, Any]:
    return ((get_isvc(cluster, namespace, name) or {}).get("status") or {}).get("autoscaling") or {}


def event_reasons(cluster, namespace: str, name: str) -> list[str]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.kind=InferenceService,involvedObject.name={name}",
    )  # fmt: skip
    return [e["reason"] for e in json.loads(out.stdout)["items"]]


def test_an_idle_pool_sleeps_with_its_replica_and_a_held_request_wakes_it(
    control_plane, cp_namespace, sleep_engines, autoscaling_operator, feed
):
    name = "sleepy"
    feed.set("unified", kv=0.0, requests=0)
    control_plane.kubectl("apply", "-n", cp_namespace, "-f", "-", input=yaml.safe_dump(isvc(name)))
    apps = client.AppsV1Api(control_plane.api_client())
    deployment = wait_until(lambda: _get_deployment(apps, cp_namespace, f"{name}-unified"), 60, "the engine Deployment")
    assert f"--{SLEEP_MODE_FLAG}" in deployment.spec.template.spec.containers[0].args

    wait_until(lambda: sleep_engines.posted(SLEEP_PATH), 150, "POST /sleep after idleSeconds")
    [(pod, path)] = sleep_engines.posted(SLEEP_PATH)
    assert pod.startswith(f"{cp_namespace}/{name}-unified-") and path == f"{SLEEP_PATH}?level=1"
    wait_until(lambda: "asleepSince" in autoscaling_status(control_plane, cp_namespace, name), 30, "asleepSince")
    assert apps.read_namespaced_deployment(f"{name}-unified", cp_namespace).spec.replicas == 1  # kept, not zero
    wait_until(lambda: "Sleeping" in event_reasons(control_plane, cp_namespace, name), 30, "a Sleeping Event")
    assert sleep_engines.posted(WAKE_UP_PATH) == []

    feed.held["unified"] = 2
    wait_until(lambda: sleep_engines.posted(WAKE_UP_PATH), 60, "POST /wake_up on held requests")
    assert [p for p, _ in sleep_engines.posted(WAKE_UP_PATH)] == [pod]
    wait_until(lambda: "asleepSince" not in autoscaling_status(control_plane, cp_namespace, name), 30, "awake")
    assert "router holds requests" in autoscaling_status(control_plane, cp_namespace, name)["lastDecision"]
    wait_until(lambda: "Woken" in event_reasons(control_plane, cp_namespace, name), 30, "a Woken Event")
    feed.held["unified"] = 0
    assert len(sleep_engines.posted(SLEEP_PATH)) == 1  # slept once: not again right after the wake


def _get_deployment(apps: client.AppsV1Api, namespace: str, name: str) -> Any:
    try:
        return apps.read_namespaced_deployment(name, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
