"""reconcile/plan/status against an in-memory API server: idempotence, drift, pruning, conditions."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from tidepool.operator.api import InferenceServiceStatus
from tidepool.operator.builders import ClusterFeatures
from tidepool.operator.reconcile import contains, plan, reconcile
from tidepool.operator.status import Outcome, PodProblem, PoolObservation, build_status, observe_pool

UID = "uid-1"
SPEC = {
    "model": {"uri": "hf://org/model"},
    "resources": {"gpusPerReplica": 1},
    "mode": "unified",
    "pools": {"unified": {"replicas": 2, "maxReplicas": 4}},
}


class FakeApi:
    """Stores applied objects; `ready` decides whether workloads report all replicas ready."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.num_applies = 0
        self.status_patches: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] = []
        self.ready = True

    def _with_status(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Deployment":
            n = obj["spec"]["replicas"]
            ready = n if self.ready else 0
            obj["metadata"]["generation"] = obj["metadata"].get("generation", 1)
            obj["status"] = {
                "observedGeneration": obj["metadata"]["generation"],
                "replicas": n,
                "updatedReplicas": n,
                "readyReplicas": ready,
                "availableReplicas": ready,
            }
        return obj

    async def list(self, kind: str, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        if kind == "Pod":
            return copy.deepcopy(self.pods)
        return [copy.deepcopy(self._with_status(o)) for (k, _), o in self.objects.items() if k == kind]

    async def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        self.num_applies += 1
        key = (obj["kind"], obj["metadata"]["name"])
        old = self.objects.get(key)
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = f"child-{key[1]}"
        stored["metadata"]["generation"] = (old["metadata"]["generation"] + 1) if old else 1
        self.objects[key] = stored
        return copy.deepcopy(self._with_status(stored))

    async def delete(self, obj: dict[str, Any]) -> None:
        self.objects.pop((obj["kind"], obj["metadata"]["name"]), None)

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.status_patches.append(status)
        return {}


def body(spec: dict[str, Any] = SPEC, generation: int = 1, status: dict | None = None) -> dict[str, Any]:
    meta = {"name": "svc", "namespace": "ns", "uid": UID, "generation": generation}
    return {"metadata": meta, "spec": spec, "status": status or {}}


def run(api: FakeApi, b: dict[str, Any], **kw: Any):
    return asyncio.run(reconcile(api, b, ClusterFeatures(), "2026-01-01T00:00:00Z", **kw))


def test_reconcile_is_idempotent_and_reports_ready():
    api = FakeApi()
    first = run(api, body())
    assert first.ready and first.events[0][1] == "Created"
    applied = api.num_applies
    assert applied == len(api.objects) > 0
    status = api.status_patches[-1]
    assert status["pools"] == {"unified": {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2}}
    assert status["replicas"] == 2 and status["url"] == "http://svc-router.ns.svc"
    second = run(api, body(status=status))
    assert second.ready and second.applied == [] and second.events == []
    assert api.num_applies == applied  # nothing re-applied
    assert len(api.status_patches) == 1  # unchanged status is not written again


def test_hand_edit_is_reverted_and_stray_child_pruned():
    api = FakeApi()
    run(api, body())
    api.objects[("Deployment", "svc-unified")]["spec"]["replicas"] = 7
    stray = copy.deepcopy(api.objects[("Service", "svc-unified")])
    stray["metadata"]["name"] = "svc-prefill"
    api.objects[("Service", "svc-prefill")] = stray
    result = run(api, body(status=api.status_patches[-1]))
    assert result.applied == ["Deployment/svc-unified"]
    assert result.pruned == ["Service/svc-prefill"]
    assert api.objects[("Deployment", "svc-unified")]["spec"]["replicas"] == 2
    assert [e[1] for e in result.events] == ["Scaled", "Pruned"]


def test_children_of_another_owner_are_left_alone():
    api = FakeApi()
    run(api, body())
    foreign = copy.deepcopy(api.objects[("ConfigMap", "svc-engine-config")])
    foreign["metadata"]["name"] = "svc-other"
    foreign["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    api.objects[("ConfigMap", "svc-other")] = foreign
    assert run(api, body(status=api.status_patches[-1])).pruned == []


def test_not_ready_and_unschedulable_pods_set_conditions():
    api = FakeApi()
    api.ready = False
    api.pods = [
        {
            "metadata": {"name": "svc-unified-abc", "labels": {"tidepool.dev/pool": "unified"}},
            "status": {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
                    }
                ]
            },
        }
    ]
    result = run(api, body())
    assert not result.ready
    conds = {c.type: c for c in result.status.conditions}
    assert conds["Ready"].status == "False" and conds["Ready"].reason == "Unschedulable"
    assert conds["ScalingLimited"].status == "True" and "Insufficient nvidia.com/gpu" in conds["ScalingLimited"].message
    assert "unified: 0/2 ready" in conds["Ready"].message


def test_invalid_spec_is_permanent_and_explained():
    api = FakeApi()
    bad = {**SPEC, "model": {"uri": "file:///host/models"}}
    result = run(api, body(bad))
    assert result.permanent_error and "pvc://" in result.permanent_error
    assert api.objects == {}
    degraded = next(c for c in api.status_patches[-1]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"


def test_replicas_override_is_the_autoscaler_seam():
    api = FakeApi()
    result = run(api, body(), replicas_override={"unified": 3}, scaling_limit=("AtMaxReplicas", "capped at 3"))
    assert api.objects[("Deployment", "svc-unified")]["spec"]["replicas"] == 3
    assert result.status.pools["unified"].desired_replicas == 3
    limited = result.status.condition("ScalingLimited")
    assert limited is not None and limited.status == "True" and limited.reason == "AtMaxReplicas"


@pytest.mark.parametrize(
    ("observed", "desired", "expected"),
    [
        ({"a": 1, "b": {"c": "x", "d": 2}}, {"b": {"c": "x"}}, True),  # server defaults ignored
        ({"a": 1}, {"a": 2}, False),
        ({"a": "1"}, {"a": 1}, True),  # IntOrString
        ({"a": [1, 2]}, {"a": [1]}, False),  # list length is ours
        ({"a": [{"x": 1, "y": 2}]}, {"a": [{"x": 1}]}, True),
        ({"a": True}, {"a": "True"}, False),
        ({}, {"a": None}, False),
    ],
)
def test_contains(observed, desired, expected):
    assert contains(observed, desired) is expected


def test_plan_events():
    dep = {
        "kind": "Deployment",
        "metadata": {"name": "d", "labels": {"tidepool.dev/spec-hash": "a"}},
        "spec": {"replicas": 1},
    }
    changed = copy.deepcopy(dep)
    changed["metadata"]["labels"]["tidepool.dev/spec-hash"] = "b"
    changed["spec"]["replicas"] = 2
    todo = plan([changed], [dep])
    assert [e[1] for e in todo.events] == ["Scaled", "RollingOut"]
    assert plan([dep], [dep]).apply == []


def test_last_transition_time_moves_only_on_change():
    pools = [PoolObservation("unified", 1, 1, 1)]
    router = PoolObservation("router", 1, 1, 1)
    args = ("http://u", "sel", "unified")
    s1 = build_status(InferenceServiceStatus(), 1, pools, router, Outcome(), *args, now="T1")
    s2 = build_status(s1, 2, pools, router, Outcome(), *args, now="T2")
    assert s2.condition("Ready").last_transition_time == "T1"
    assert s2.condition("Ready").observed_generation == 2
    s3 = build_status(s2, 2, [PoolObservation("unified", 2, 1, 1)], router, Outcome(), *args, now="T3")
    assert s3.condition("Ready").status == "False" and s3.condition("Ready").last_transition_time == "T3"
    assert s3.condition("Progressing").status == "True"
    failing = Outcome(pod_problems=[PodProblem("unified", "p", "ImagePullBackOff", "no such image")])
    s4 = build_status(s3, 2, [PoolObservation("unified", 2, 1, 1)], router, failing, *args, now="T4")
    assert s4.condition("Degraded").status == "True" and "no such image" in s4.condition("Degraded").message
    assert s4.condition("Progressing").status == "False"


def test_observe_pool_rollout_and_failure():
    dep = {
        "kind": "Deployment",
        "metadata": {"name": "d", "generation": 3},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2},
    }
    assert not observe_pool("unified", 2, [dep]).rolled_out  # the controller has not seen generation 3
    dep["status"] |= {
        "observedGeneration": 3,
        "availableReplicas": 2,
        "conditions": [{"type": "ReplicaFailure", "status": "True", "message": "pods forbidden: violates PodSecurity"}],
    }
    obs = observe_pool("unified", 2, [dep])
    assert obs.rolled_out and "violates PodSecurity" in obs.failure and not obs.is_ready
