"""Why pods cannot run, told apart on the real control plane (real kube-scheduler, KWOK GPU nodes), and a
Failed pod never counted as a replica, with the operator as the chart's ServiceAccount.

- The scheduler's own messages: a model-cache claim of a StorageClass that does not exist stays unbound
  (UnboundClaim, naming the claim), a gpuProduct no node carries (NoMatchingNode, naming the selector),
  a node's every GPU per replica and more replicas than nodes (InsufficientCapacity, naming the request;
  more GPUs per replica than a node has is refused as an invalid spec): ScalingLimited's reason each.
- An eviction: the kubelet's write (phase Failed, reason Evicted, its message) put through the pods/status
  subresource of a KWOK pod (KWOK's stages leave a Failed pod alone); a namespace ResourceQuota of zero
  GPUs, set once the pod runs, keeps its ReplicaSet from replacing it, so the eviction stays the cause:
  ScalingLimited Evicted with the kubelet's message, and the pod no replica.
- The count: an evicted pod whose replacement runs does not count in status.replicas nor in GET .../scale
  (it did: one replica too many for as long as the Failed pod stayed). The replacement then reports a
  crash loop, which the operator names in Degraded: pods arrive on one ordered watch, so a status naming it
  was computed after the eviction was seen, and its counts are the ones to check.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_kit import GROUP, PLURAL, VERSION, condition, custom_api, get_isvc, pod_is_ready, pods, wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]
EMPTYDIR = 'Usage of EmptyDir volume "model-cache" exceeds the limit "20Gi". '
MISSING_CLASS = "tidepool-no-such-class"
TYPO = "NVIDIA-H100-80GB-HMB3"  # the node label is NVIDIA-H100-80GB-HBM3


def isvc(name: str, gpus: int = 1, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "hf://org/model"},
            "resources": {"gpusPerReplica": gpus, "cpu": "1", "memory": "1Gi"},
            "parallelism": {"tensor": gpus, "pipeline": 1},
            "mode": "unified",
            "pools": {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}},
            "router": {"replicas": 1},
            "autoscaling": {"enabled": False},
            **spec,
        },
    }


def apply(cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def engine_pods(cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return pods(cluster, namespace, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified")


def limited_by(cluster, namespace: str, name: str, reason: str) -> dict[str, Any]:
    """The InferenceService once its ScalingLimited condition is True with `reason`."""

    seen: list[Any] = []

    def check() -> dict[str, Any] | None:
        obj = get_isvc(cluster, namespace, name)
        cond = condition(obj, "ScalingLimited")
        seen[:] = [((obj or {}).get("status") or {}).get("conditions")]
        return obj if cond and cond["status"] == "True" and cond["reason"] == reason else None

    try:
        return wait_until(check, 120, f"ScalingLimited {reason}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; conditions: {seen[0]!r}") from None


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_status(cluster, namespace: str, name: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """What a kubelet writes, through the pods/status subresource: `change(pod)` gives the new status fields
    of the pod as just read; read again and retried when KWOK wrote in between (409)."""
    core = client.CoreV1Api(cluster.api_client())
    for _ in range(10):
        (pod,) = [p for p in pods(cluster, namespace, "tidepool.dev/pool=unified") if p["metadata"]["name"] == name]
        pod["status"].update(change(pod))
        try:
            core.replace_namespaced_pod_status(name, namespace, pod)
            return
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    raise AssertionError(f"pod {name}: the status write kept conflicting")


def evicted(pod: dict[str, Any]) -> dict[str, Any]:
    """The kubelet's eviction for the emptyDir limit: phase Failed, reason Evicted, containers stopped."""
    at = now()
    conditions = [
        {**c, "status": "False", "lastTransitionTime": at} if c["type"] in ("Ready", "ContainersReady") else c
        for c in pod["status"]["conditions"]
    ]
    conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                       "message": EMPTYDIR.strip(), "lastTransitionTime": at})  # fmt: skip
    stopped = [
        {**cs, "ready": False, "started": False,
         "state": {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": at, "finishedAt": at}}}
        for cs in pod["status"].get("containerStatuses") or []
    ]  # fmt: skip
    return {"phase": "Failed", "reason": "Evicted", "message": EMPTYDIR, "conditions": conditions,
            "containerStatuses": stopped}  # fmt: skip


def crash_looping(pod: dict[str, Any]) -> dict[str, Any]:
    """Its engine container restarts in a loop: not ready, waiting in CrashLoopBackOff (phase stays Running)."""
    crashing = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}}
    return {
        "conditions": [
            {**c, "status": "False"} if c["type"] in ("Ready", "ContainersReady") else c
            for c in pod["status"]["conditions"]
        ],
        "containerStatuses": [{**cs, "ready": False, "state": crashing} for cs in pod["status"]["containerStatuses"]],
    }


def running_pod(cluster, namespace: str, name: str, other_than: str = "") -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        live = [p for p in engine_pods(cluster, namespace, name) if p["metadata"]["name"] != other_than]
        return next((p for p in live if pod_is_ready(p)), None)

    return wait_until(find, 120, f"a running {name} pod" + (f" other than {other_than}" if other_than else ""))


@pytest.mark.parametrize(
    ("case", "reason", "named"),
    [
        ("claim", "UnboundClaim", ["claim weights is not bound", "pod has unbound immediate PersistentVolumeClaims"]),
        ("product", "NoMatchingNode", [f"nvidia.com/gpu.product={TYPO}", "didn't match Pod's node affinity/selector"]),
        ("gpus", "InsufficientCapacity", ["the pod requests nvidia.com/gpu 8", "Insufficient nvidia.com/gpu"]),
    ],
)
def test_the_scheduler_reason_is_told_apart(control_plane, cp_namespace, operator, case, reason, named):
    ns, name = cp_namespace, f"why-{case}"
    if case == "claim":  # the operator creates it; no such StorageClass: it never binds
        cache = {"persistentVolumeClaim": {"claimName": "weights", "size": "1Gi", "storageClassName": MISSING_CLASS}}
        obj = isvc(name, modelCache=cache)
    elif case == "product":
        obj = isvc(name)
        obj["spec"]["resources"]["gpuProduct"] = TYPO
    else:  # a whole node's 8 GPUs per replica, one replica more than there are nodes: one at least waits
        replicas = len(client.CoreV1Api(control_plane.api_client()).list_node(label_selector="type=kwok").items) + 1
        obj = isvc(name, gpus=8)
        obj["spec"]["pools"]["unified"].update(replicas=replicas, maxReplicas=replicas)
    apply(control_plane, ns, obj)
    got = limited_by(control_plane, ns, name, reason)
    limited, ready = condition(got, "ScalingLimited"), condition(got, "Ready")
    for text in named:
        assert text in limited["message"], limited["message"]
    waiting = [p for p in engine_pods(control_plane, ns, name) if p["status"].get("phase") == "Pending"]
    assert waiting and all(f"unified/{p['metadata']['name']}" in limited["message"] for p in waiting)
    for pod in waiting:  # what the scheduler said
        scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
        assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    assert condition(got, "Degraded")["status"] == "False"  # it waits; nothing is broken
    desired = obj["spec"]["pools"]["unified"]["replicas"]
    assert got["status"]["replicas"] == desired  # a pending pod is a replica its workload made
    if desired == 1:  # nothing serves: Ready says why
        assert (ready["status"], ready["reason"]) == ("False", reason)


def test_an_eviction_nothing_replaces_limits_scaling_and_is_no_replica(control_plane, cp_namespace, operator):
    ns, name = cp_namespace, "evicted"
    apply(control_plane, ns, isvc(name))
    pod = running_pod(control_plane, ns, name)
    core = client.CoreV1Api(control_plane.api_client())
    quota = {"metadata": {"name": "no-gpus"}, "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}}
    core.create_namespaced_resource_quota(ns, quota)  # no replacement can be created from now on
    wait_until(lambda: core.read_namespaced_resource_quota("no-gpus", ns).status.hard or None, 60, "quota status")
    write_status(control_plane, ns, pod["metadata"]["name"], evicted)
    got = limited_by(control_plane, ns, name, "Evicted")
    limited = condition(got, "ScalingLimited")
    assert f"unified/{pod['metadata']['name']}" in limited["message"]
    assert f"evicted by the kubelet: {EMPTYDIR.strip()}" in limited["message"]
    assert got["status"]["pools"]["unified"]["replicas"] == 0 and got["status"]["replicas"] == 0
    assert condition(got, "Ready")["reason"] == "Evicted"


def test_a_failed_pod_counts_neither_in_status_nor_in_scale(control_plane, cp_namespace, operator):
    ns, name = cp_namespace, "counted"
    apply(control_plane, ns, isvc(name, replicas=1))  # spec.replicas: the scale subresource's
    first = running_pod(control_plane, ns, name)
    write_status(control_plane, ns, first["metadata"]["name"], evicted)
    second = running_pod(control_plane, ns, name, other_than=first["metadata"]["name"])  # the ReplicaSet's
    write_status(control_plane, ns, second["metadata"]["name"], crash_looping)

    def crash_seen() -> dict[str, Any] | None:
        obj = get_isvc(control_plane, ns, name)
        degraded = condition(obj, "Degraded")
        seen = degraded and degraded["status"] == "True" and second["metadata"]["name"] in degraded["message"]
        return obj if seen else None

    got = wait_until(crash_seen, 120, "Degraded naming the replacement's crash loop")
    assert got["status"]["pools"]["unified"]["replicas"] == 1  # the replacement; not the Failed pod
    assert got["status"]["replicas"] == 1
    scale = custom_api(control_plane).get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, name)
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (1, 1)
    assert len(engine_pods(control_plane, ns, name)) == 2  # both pods are still there: the Failed one stays
