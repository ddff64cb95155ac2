"""Multi-node pools on the real LeaderWorkerSet controller (built from sigs.k8s.io/lws, run by the dev
cluster with its webhooks served on the cluster's own CA): the operator renders a LeaderWorkerSet, the
controller creates each group's leader and worker pods, its pod webhook injects the rank and leader
address, and groups follow the scale subresource and come back when a pod is deleted. KWOK runs the
pods (GPU nodes); the real-pod tier runs a CPU group for real."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from operator_kit import (
    get_isvc,
    is_ready,
    pod_is_ready,
    pods,
    wait_until,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

NAME = "pp"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"


def multi_node_service() -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "hf://example/model"},
            "parallelism": {"tensor": 1, "pipeline": 2},
            "resources": {"gpusPerReplica": 2},
            "pools": {"unified": {"replicas": 1}},
        },
    }


def group_pods(cluster, ns: str) -> list[dict[str, Any]]:
    return pods(cluster, ns, f"tidepool.dev/inferenceservice={NAME},tidepool.dev/pool=unified")


def wait_groups(cluster, ns: str, groups: int) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        found = [p for p in group_pods(cluster, ns) if not p["metadata"].get("deletionTimestamp")]
        isvc = get_isvc(cluster, ns, NAME)
        ok = len(found) == 2 * groups and all(pod_is_ready(p) for p in found) and is_ready(isvc)
        return found if ok else None

    return wait_until(ready, 180, f"{groups} LeaderWorkerSet group(s) of 2 Ready pods", interval_s=1)


def test_multi_node_pool_runs_on_the_real_leaderworkerset_controller(control_plane, cp_namespace, operator):
    ns = cp_namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(multi_node_service()))
    found = wait_groups(control_plane, ns, 1)
    lws = json.loads(control_plane.kubectl("get", "leaderworkersets", "-n", ns, "-o", "json").stdout)["items"]
    assert [x["metadata"]["name"] for x in lws] == [f"{NAME}-unified"]
    assert lws[0]["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert sorted(p["metadata"]["labels"][WORKER_INDEX] for p in found) == ["0", "1"]
    leader = next(p for p in found if p["metadata"]["labels"][WORKER_INDEX] == "0")
    for pod in found:
        env = {e["name"]: e.get("value") for c in pod["spec"]["containers"] for e in c.get("env", [])}
        # injected by the LWS pod webhook; the operator's --master-addr / --node-rank expand them. The
        # subdomain is the group's own headless Service (UniquePerReplica: `<lws>-<group>`), never the pool's
        # ClusterIP Service `<lws>`, whose name LWS's shared headless Service would need.
        assert env["LWS_LEADER_ADDRESS"].startswith(f"{leader['metadata']['name']}.{NAME}-unified-0.{ns}")
        assert env["LWS_WORKER_INDEX"] == pod["metadata"]["labels"][WORKER_INDEX]
        assert pod["spec"]["nodeName"].startswith("kwok-gpu-")
    sts = json.loads(control_plane.kubectl("get", "statefulsets", "-n", ns, "-o", "json").stdout)["items"]
    assert [s["metadata"]["ownerReferences"][0]["kind"] for s in sts] == ["LeaderWorkerSet", "Pod"]  # LWS's own

    control_plane.kubectl("scale", "-n", ns, f"inferenceservice/{NAME}", "--replicas=2")
    found = wait_groups(control_plane, ns, 2)
    assert sorted({p["metadata"]["labels"][GROUP_INDEX] for p in found}) == ["0", "1"]

    worker = next(p for p in found if p["metadata"]["labels"][WORKER_INDEX] == "1")
    control_plane.kubectl("delete", "pod", "-n", ns, worker["metadata"]["name"], "--wait=false")

    def replaced() -> bool:
        now = {p["metadata"]["name"]: p for p in group_pods(control_plane, ns)}
        new = now.get(worker["metadata"]["name"])
        return bool(new and new["metadata"]["uid"] != worker["metadata"]["uid"] and pod_is_ready(new))

    wait_until(replaced, 180, "the LWS controller to bring the deleted worker back", interval_s=1)
    wait_groups(control_plane, ns, 2)
