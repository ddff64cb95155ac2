"""The operator-wide rollout budget on a real control plane: 10 services, `--max-concurrent-rollouts 2`.

Two fleet-wide changes, each of which rolled every service at once before the budget:
1. an operator upgrade with a new default engine image (`--engine-image`, the chart's `engineImage`) that
   the services, setting no `spec.engine.image`, take; the operator restarts, so the budget is rebuilt
   from the cluster;
2. a spec change of every service at once (GitOps applying a new image to all of them).

"Rolling" is read from a watch on the namespace's Deployments (every event, in resourceVersion order), not
by sampling: a service rolls while one of its Deployments is not settled (the Deployment controller has not
reported its current generation fully updated and ready, rollout.is_settled). At no event may more than 2
services roll; every service ends on the new template, and the others waited with Progressing reason
RolloutQueued (seen by a watch on the InferenceServices).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, watch
from operator_kit import OperatorProcess, get_isvc, is_ready, restricted_namespace, wait_until

from tidepool.operator.rollout import is_settled

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(900)]

NUM_SERVICES, BUDGET = 10, 2
NAMES = [f"roll-{i}" for i in range(NUM_SERVICES)]
LABEL_SERVICE = "tidepool.dev/inferenceservice"


def spec(image: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": {"uri": "hf://example/model"},
        "resources": {"gpusPerReplica": 0, "cpu": "100m", "memory": "128Mi"},
        "pools": {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}},
        "router": {"replicas": 1},
    }
    if image:
        out["engine"] = {"image": image}
    return out


class Recorder:
    """Every event of one kind in a namespace, from a watch in short rounds (each resumed from the last
    resourceVersion, so nothing is lost between rounds and leaving the `with` joins the thread within one)."""

    ROUND_S = 5

    def __init__(self, cluster, list_call: Callable[..., Any], namespace: str, on_event: Callable[[dict], None]):
        self.api = cluster.api_client()
        self.list_call, self.namespace, self.on_event = list_call, namespace, on_event
        self.errors: list[str] = []
        self._stopping = threading.Event()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, name="rollout-recorder", daemon=True)

    def _run(self) -> None:
        version: str | None = None
        while not self._stopping.is_set():
            self._watch = watch.Watch()
            kwargs: dict[str, Any] = {"timeout_seconds": self.ROUND_S, "_request_timeout": (10, self.ROUND_S + 20)}
            if version:
                kwargs["resource_version"] = version
            try:
                for event in self._watch.stream(self.list_call, self.namespace, **kwargs):
                    obj = event["object"]
                    body = obj if isinstance(obj, dict) else self.api.sanitize_for_serialization(obj)
                    self.on_event({"type": event["type"], "object": body})
                version = self._watch.resource_version
            except Exception as exc:  # a dropped or expired watch: list again (its ADDED events are current states)
                self.errors.append(repr(exc)[:200])
                version = None
                self._stopping.wait(0.5)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopping.set()
        self._watch.stop()
        self._thread.join(60)
        if self._thread.is_alive():
            raise RuntimeError("the recorder's watch thread did not stop within 60 s")


class RollingCounter:
    """Services with an unsettled Deployment, after every Deployment event; the most ever at once."""

    def __init__(self) -> None:
        self.unsettled: dict[str, str] = {}  # Deployment name -> its service, while not settled
        self.seen: set[str] = set()
        self.most, self.at_most = 0, ""
        self.lock = threading.Lock()

    def __call__(self, event: dict) -> None:
        obj = {"kind": "Deployment", **event["object"]}
        name = obj["metadata"]["name"]
        service = (obj["metadata"].get("labels") or {}).get(LABEL_SERVICE, "")
        with self.lock:
            self.seen.add(name)
            if event["type"] == "DELETED" or is_settled(obj):
                self.unsettled.pop(name, None)
            else:
                self.unsettled[name] = service
            rolling = sorted(set(self.unsettled.values()))
            if len(rolling) > self.most:
                self.most = len(rolling)
                self.at_most = f"{rolling} at Deployment {name} rv {obj['metadata']['resourceVersion']}"


class QueuedSeen:
    """The services whose Progressing reason was RolloutQueued at some event."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.seen: set[str] = set()

    def __call__(self, event: dict) -> None:
        self.seen.add(event["object"]["metadata"]["name"])
        for cond in (event["object"].get("status") or {}).get("conditions") or []:
            if cond["type"] == "Progressing" and cond["reason"] == "RolloutQueued":
                self.names.add(event["object"]["metadata"]["name"])


def deployments(cluster, ns: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "deployments", "-n", ns, "-l", LABEL_SERVICE, "-o", "json")
    return [{"kind": "Deployment", **d} for d in json.loads(out.stdout)["items"]]


def images(cluster, ns: str) -> set[str]:
    return {c["image"] for d in deployments(cluster, ns) for c in d["spec"]["template"]["spec"]["containers"]}


def all_settled_on(cluster, ns: str, image: str) -> bool:
    found = deployments(cluster, ns)
    return (
        len(found) == 2 * NUM_SERVICES
        and all(is_settled(d) for d in found)
        and images(cluster, ns) == {image}
        and all(is_ready(get_isvc(cluster, ns, n)) for n in NAMES)
    )


def apply_all(cluster, ns: str, image: str | None) -> None:
    docs = [
        {
            "apiVersion": "tidepool.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": n},
            "spec": spec(image),
        }
        for n in NAMES
    ]
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))


def roll_and_watch(cluster, ns: str, change: Callable[[], None], image: str) -> tuple[RollingCounter, QueuedSeen]:
    counter, queued = RollingCounter(), QueuedSeen()
    apps = client.AppsV1Api(cluster.api_client())
    custom = client.CustomObjectsApi(cluster.api_client())

    def list_services(namespace: str, **kw: Any) -> Any:
        return custom.list_namespaced_custom_object("tidepool.dev", "v1alpha1", namespace, "inferenceservices", **kw)

    with Recorder(cluster, apps.list_namespaced_deployment, ns, counter), Recorder(cluster, list_services, ns, queued):
        wait_until(
            lambda: len(counter.seen) == 2 * NUM_SERVICES and len(queued.seen) == NUM_SERVICES, 60, "the watches"
        )
        assert counter.most == 0, counter.at_most  # every Deployment settled before the change
        change()
        wait_until(lambda: all_settled_on(cluster, ns, image), 600, f"every service rolled to {image}", 2)
    return counter, queued


def test_ten_services_roll_two_at_a_time(control_plane, cp_namespace, identity, tmp_path: Path):
    ns = cp_namespace
    restricted_namespace(control_plane, ns)
    budget = ("--max-concurrent-rollouts", str(BUDGET))
    old, new, pinned = "example.com/tidepool:1", "example.com/tidepool:2", "example.com/tidepool:3"
    op = OperatorProcess(identity.kubeconfig, [ns], tmp_path / "operator.log", ("--engine-image", old, *budget))
    op.start()
    try:
        apply_all(control_plane, ns, None)  # creating is not a rollout: all ten at once
        wait_until(lambda: all_settled_on(control_plane, ns, old), 300, "ten services Ready", 2)
        recorded = get_isvc(control_plane, ns, NAMES[0])["status"]["operatorDefaults"]
        assert recorded["engineImage"] == old

        def upgrade() -> None:  # `helm upgrade` with a new engineImage: the operator restarts with new defaults
            op.stop()
            op.extra_args = ("--engine-image", new, *budget)
            op.start()

        counter, queued = roll_and_watch(control_plane, ns, upgrade, new)
        assert counter.most <= BUDGET, f"{counter.most} services rolled at once: {counter.at_most}"
        assert counter.most == BUDGET  # the budget was used, not bypassed by rolling one at a time
        assert len(queued.names) >= NUM_SERVICES - BUDGET, queued.names

        counter, queued = roll_and_watch(control_plane, ns, lambda: apply_all(control_plane, ns, pinned), pinned)
        assert counter.most <= BUDGET, f"{counter.most} services rolled at once: {counter.at_most}"
        assert len(queued.names) >= NUM_SERVICES - BUDGET, queued.names
        for name in NAMES:
            progressing = next(c for c in get_isvc(control_plane, ns, name)["status"]["conditions"]
                               if c["type"] == "Progressing")  # fmt: skip
            assert progressing["reason"] != "RolloutQueued"
    finally:
        op.stop()
    forbidden = op.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])
