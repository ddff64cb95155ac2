"""The autoscaler on the real control plane, fed synthetic engine metrics (KWOK pods serve nothing).

A feed server in the test process plays the pods' `/metrics` (autoscale_feed.py); the operator
reads it through TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE. Checked: pools scale up and down; with KWOK's 2 x 8 GPUs
the pool hits ScalingLimited instead of running away; scale to zero after idleSeconds and back
on held requests; advisory mode changes nothing but status and Events.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_kit import (
    condition,
    get_isvc,
    pod_is_ready,
    wait_until,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(420)]


def isvc(name: str, autoscaling: dict[str, Any], pool: dict[str, int], gpus: int = 4) -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "hf://org/model"},
            "resources": {"gpusPerReplica": gpus, "cpu": "1", "memory": "1Gi"},
            "parallelism": {"tensor": gpus, "pipeline": 1},
            "mode": "unified",
            "pools": {"unified": pool},
            "router": {"replicas": 1},
            "autoscaling": {"enabled": True, "stabilization": {"upSeconds": 0, "downSeconds": 0}, **autoscaling},
        },
    }


def deployment_replicas(cluster, namespace: str, name: str, pool: str = "unified") -> int | None:
    apps = client.AppsV1Api(cluster.api_client())
    try:
        return apps.read_namespaced_deployment(f"{name}-{pool}", namespace).spec.replicas
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def autoscaling_status(cluster, namespace: str, name: str) -> dict[str, Any]:
    return ((get_isvc(cluster, namespace, name) or {}).get("status") or {}).get("autoscaling") or {}


def events_of(cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.kind=InferenceService,involvedObject.name={name}",
    )  # fmt: skip
    return json.loads(out.stdout)["items"]


def apply(cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def test_scales_up_hits_scaling_limited_and_scales_down(control_plane, cp_namespace, autoscaling_operator, feed):
    name = "grow"
    feed.set("unified", kv=0.9, requests=5)
    apply(
        control_plane,
        cp_namespace,
        isvc(name, {"kvCacheTarget": 0.5}, {"replicas": 1, "minReplicas": 1, "maxReplicas": 12}),
    )
    # 2 KWOK nodes x 8 GPUs at 4 GPUs per replica: 4 replicas fit, the rest stays Pending.
    limited = wait_until(
        lambda: (
            (c := condition(get_isvc(control_plane, cp_namespace, name), "ScalingLimited"))
            and c["status"] == "True"
            and c
        ),
        180,
        "ScalingLimited=True",
    )
    assert "nvidia.com/gpu" in limited["message"] or "unschedulable" in limited["message"], limited
    # Reconcile may report the Pending pods before the autoscaler's next tick sees them: wait for that tick.
    status = wait_until(
        lambda: (
            (s := autoscaling_status(control_plane, cp_namespace, name)) and "unschedulable" in s["lastDecision"] and s
        ),
        30,
        "a decision that sees the unschedulable pods",
    )
    assert status["mode"] == "active" and status["lastScaleTime"] and "kv_cache 0.90" in status["lastDecision"]
    ceiling = deployment_replicas(control_plane, cp_namespace, name)
    assert 4 < ceiling < 12
    # No runaway while pods cannot be scheduled: the next several decisions (1 s apart) hold the replicas.
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        assert deployment_replicas(control_plane, cp_namespace, name) == ceiling
        time.sleep(0.5)
    assert "limited" in autoscaling_status(control_plane, cp_namespace, name)["lastDecision"]

    feed.set("unified", kv=0.05, requests=5)
    wait_until(lambda: deployment_replicas(control_plane, cp_namespace, name) == 1, 120, "scale down to minReplicas 1")
    wait_until(
        lambda: (
            (c := condition(get_isvc(control_plane, cp_namespace, name), "ScalingLimited")) and c["status"] == "False"
        ),
        120,
        "ScalingLimited=False",
    )
    reasons = [e["reason"] for e in events_of(control_plane, cp_namespace, name)]
    assert "Scaled" in reasons


def test_scale_to_zero_and_back_on_held_requests(control_plane, cp_namespace, autoscaling_operator, feed):
    name = "idle"
    feed.set("unified", kv=0.0, requests=0)
    spec = isvc(
        name,
        {"scaleToZero": {"enabled": True, "idleSeconds": 30}},
        {"replicas": 1, "minReplicas": 0, "maxReplicas": 3},
        gpus=1,
    )
    apply(control_plane, cp_namespace, spec)
    wait_until(
        lambda: deployment_replicas(control_plane, cp_namespace, name) == 0, 150, "scale to zero after idleSeconds"
    )
    assert "idleSeconds 30" in autoscaling_status(control_plane, cp_namespace, name)["lastDecision"]
    feed.held["unified"] = 2
    wait_until(lambda: (deployment_replicas(control_plane, cp_namespace, name) or 0) >= 1, 60, "scale up from zero")
    assert "router holds requests" in autoscaling_status(control_plane, cp_namespace, name)["lastDecision"]
    core = client.CoreV1Api(control_plane.api_client())
    selector = f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified"
    wait_until(
        lambda: any(pod_is_ready(p.to_dict() | {"status": {"phase": p.status.phase, "conditions": [
            {"type": c.type, "status": c.status} for c in p.status.conditions or []]}})
            for p in core.list_namespaced_pod(cp_namespace, label_selector=selector).items),
        90,
        "a Ready pod after waking",
    )  # fmt: skip


def test_advisory_changes_only_status(control_plane, cp_namespace, autoscaling_operator, feed):
    name = "advice"
    feed.set("unified", kv=0.95, requests=5)
    apply(
        control_plane,
        cp_namespace,
        isvc(
            name,
            {"mode": "advisory", "kvCacheTarget": 0.5},
            {"replicas": 1, "minReplicas": 1, "maxReplicas": 6},
            gpus=1,
        ),
    )
    status = wait_until(
        lambda: (
            (s := autoscaling_status(control_plane, cp_namespace, name))
            and s.get("pools", {}).get("unified", {}).get("desiredReplicas", 0) >= 2
            and s
        ),
        120,
        "an advisory decision to scale up",
    )
    assert status["mode"] == "advisory" and status["lastDecision"].startswith("advisory (not applied)")
    assert not status.get("lastScaleTime")
    wait_until(
        lambda: any(e["reason"] == "AdvisoryScale" for e in events_of(control_plane, cp_namespace, name)),
        30,
        "an AdvisoryScale Event",
    )
    assert deployment_replicas(control_plane, cp_namespace, name) == 1
    assert get_isvc(control_plane, cp_namespace, name)["spec"]["pools"]["unified"]["replicas"] == 1


def test_disaggregated_pools_scale_separately(control_plane, cp_namespace, autoscaling_operator, feed):
    name = "pd"
    feed.set("prefill", ttft=2.5, requests=5)  # TTFT p95 5x the SLO: prefill must grow
    feed.set("decode", kv=0.8, requests=5)  # decode exactly at its KV target: must stay
    obj = isvc(name, {"slo": {"ttftP95Ms": 500, "itlP95Ms": 50}, "kvCacheTarget": 0.8}, {}, gpus=1)
    obj["spec"]["mode"] = "disaggregated"
    obj["spec"]["pools"] = {
        "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4},
    }
    apply(control_plane, cp_namespace, obj)
    wait_until(
        lambda: (deployment_replicas(control_plane, cp_namespace, name, "prefill") or 0) >= 2, 120, "prefill scaled up"
    )
    assert deployment_replicas(control_plane, cp_namespace, name, "decode") == 2
    status = autoscaling_status(control_plane, cp_namespace, name)
    assert "ttft_p95" in status["lastDecision"] and set(status["pools"]) == {"prefill", "decode"}

    # The feed's per-pod gauges do not shrink as pods are added, so the load must go away to scale down.
    feed.set("prefill", ttft=0.05, requests=0)
    wait_until(lambda: deployment_replicas(control_plane, cp_namespace, name, "prefill") == 1, 120, "prefill back to 1")
    assert deployment_replicas(control_plane, cp_namespace, name, "decode") == 2
