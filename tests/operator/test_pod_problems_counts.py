"""Finished pods (Failed: evicted, node shutdown; Succeeded) never count as replicas, and the reasons pods
cannot run reach ScalingLimited (and Ready) told apart, through the real Controller on the fake API.

Before this, a Failed pod counted as a live replica (only deletionTimestamp was checked): an evicted pod
and its replacement made status.replicas (the scale subresource's) one too many, forever.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from fake_api import NAME, FakeApi, with_controller

from tidepool.operator.cache import pod_info
from tidepool.operator.controller import Controller
from tidepool.operator.observe import PodProblem, observe_pool, pod_problems
from tidepool.operator.pod_problems import EVICTED, INSUFFICIENT_CAPACITY, NO_MATCHING_NODE, UNSCHEDULABLE
from tidepool.operator.status import Outcome, build_status

KEY = ("ns", NAME)
WORKLOAD = f"{NAME}-unified"
EMPTYDIR = 'Usage of EmptyDir volume "model-cache" exceeds the limit "20Gi".'
AFFINITY = "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."
GPUS = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."


class Clock:
    """The controller's clock: each sync runs an hour later, so no status write waits for its pacing."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def with_service() -> tuple[FakeApi, Controller, Clock]:
    clock = Clock()
    api, ctrl = with_controller(clock=clock)
    sync(ctrl, clock)
    for i in range(2):  # the router serves: the unified pool alone decides
        api.add_pod(f"{NAME}-router-{i}", "router", api.hash_of(f"{NAME}-router"))
    return api, ctrl, clock


def sync(ctrl: Controller, clock: Clock) -> None:
    clock.now += 3600
    asyncio.run(ctrl.services.sync(KEY, False))


def put_pod(api: FakeApi, name: str, created: str, ready: bool = True, **status: Any) -> None:
    pod = api.add_pod(name, "unified", api.hash_of(WORKLOAD), ready=ready, **status)
    pod["metadata"]["creationTimestamp"] = created
    api._bump(pod)
    api.store.put(copy.deepcopy(pod))


def evict(api: FakeApi, name: str, created: str, at: str) -> None:
    """What the kubelet writes when it evicts a pod: phase Failed, reason Evicted, its message."""
    stopped = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet", "lastTransitionTime": at}
    put_pod(api, name, created, ready=False, phase="Failed", reason="Evicted", message=EMPTYDIR, conditions=[stopped])


def unschedulable(message: str) -> dict[str, Any]:
    return {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}


def scale_status(api: FakeApi) -> tuple[int, int, int]:
    """status.replicas (what GET .../scale reports: the CRD's statusReplicasPath) and the pool's counts."""
    status = api.service()["status"]
    pool = status["pools"]["unified"]
    return status["replicas"], pool["replicas"], pool["readyReplicas"]


def test_a_failed_pod_never_counts_in_replicas_nor_in_scale():
    api, ctrl, clock = with_service()
    put_pod(api, f"{WORKLOAD}-a", "2026-12-05T10:00:00Z")
    put_pod(api, f"{WORKLOAD}-b", "2026-12-05T10:00:00Z")
    sync(ctrl, clock)
    assert scale_status(api) == (2, 2, 2)
    evict(api, f"{WORKLOAD}-a", "2026-12-05T10:00:00Z", at="2026-12-05T11:00:00Z")
    put_pod(api, f"{WORKLOAD}-c", "2026-12-05T11:00:01Z")  # the ReplicaSet's replacement, ready
    done = {"phase": "Succeeded", "reason": None}
    put_pod(api, f"{WORKLOAD}-d", "2026-12-05T09:00:00Z", ready=False, **done)  # a pod that completed
    sync(ctrl, clock)
    assert scale_status(api) == (2, 2, 2)  # not 4: the Failed and the Succeeded pod are not replicas
    assert api.condition("ScalingLimited")["status"] == "False"  # replaced: the eviction is history
    assert api.condition("Ready")["status"] == "True"


def test_an_eviction_limits_scaling_until_a_ready_pod_replaces_it():
    api, ctrl, clock = with_service()
    put_pod(api, f"{WORKLOAD}-a", "2026-12-05T10:00:00Z")
    evict(api, f"{WORKLOAD}-b", "2026-12-05T10:00:00Z", at="2026-12-05T11:00:00Z")
    put_pod(api, f"{WORKLOAD}-c", "2026-12-05T11:00:01Z", ready=False)  # downloading again
    sync(ctrl, clock)
    limited = api.condition("ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", EVICTED)
    assert f"unified/{WORKLOAD}-b" in limited["message"] and EMPTYDIR in limited["message"]
    assert scale_status(api) == (2, 2, 1)
    assert api.condition("Degraded")["status"] == "False"  # it limits the replicas; nothing is broken

    put_pod(api, f"{WORKLOAD}-c", "2026-12-05T11:00:01Z")  # the replacement serves
    sync(ctrl, clock)
    assert api.condition("ScalingLimited")["status"] == "False"
    put_pod(api, f"{WORKLOAD}-e", "2026-12-05T12:00:00Z", ready=False)  # later, a scale-up starts
    sync(ctrl, clock)
    assert api.condition("ScalingLimited")["status"] == "False"  # the old eviction is not its cause


def test_the_most_actionable_reason_wins_and_every_reason_is_counted():
    api, ctrl, clock = with_service()
    put_pod(api, f"{WORKLOAD}-a", "2026-12-05T10:00:00Z", ready=False, **unschedulable(GPUS))
    put_pod(api, f"{WORKLOAD}-b", "2026-12-05T10:00:00Z", ready=False, **unschedulable(AFFINITY))
    sync(ctrl, clock)
    limited, ready = api.condition("ScalingLimited"), api.condition("Ready")
    assert (limited["status"], limited["reason"]) == ("True", NO_MATCHING_NODE)
    assert limited["message"].startswith(f"1 pod(s) cannot run (unified/{WORKLOAD}-b): no node matches")
    assert f"also 1 pod(s) {INSUFFICIENT_CAPACITY} (unified/{WORKLOAD}-a)" in limited["message"]
    assert (ready["status"], ready["reason"]) == ("False", NO_MATCHING_NODE)
    assert ready["message"].startswith(f"pod {WORKLOAD}-b: no node matches")


def test_pod_info_of_an_evicted_pod():
    pod = {
        "metadata": {"name": "p", "labels": {"tidepool.dev/pool": "unified"}, "creationTimestamp": "2026-12-05T10:00Z"},
        "status": {
            "phase": "Failed",
            "reason": "Evicted",
            "message": EMPTYDIR,
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2026-12-05T11:00:00Z"}],
            "initContainerStatuses": [{"name": "fetch-model", "state": {"running": {"startedAt": "x"}}}],
        },
    }
    info = pod_info(pod)
    assert (info.is_finished, info.is_live, info.is_ready, info.is_terminating) == (True, False, False, False)
    assert info.problems == ((EVICTED, f"evicted by the kubelet: {EMPTYDIR}"),)
    assert (info.finished_at, info.downloading_since) == ("2026-12-05T11:00:00Z", None)
    assert pod_info({**pod, "status": {"phase": "Running"}}).is_live


def test_pods_waiting_for_the_scheduler_count_as_replicas_and_their_problems_as_capacity():
    pending = pod_info({"metadata": {"name": "p", "labels": {"tidepool.dev/pool": "unified"}},
                        "status": {"phase": "Pending", **unschedulable(AFFINITY)}})  # fmt: skip
    from tidepool.operator.builders import PoolLayout

    layout = PoolLayout(name="unified", desired=1, floor=1, spec_hash="", workloads=(), pods_per_replica=1)
    assert observe_pool(layout, {}, [pending]).replicas == 1  # it exists: the workload made it
    (problem,) = pod_problems([pending])
    assert problem.is_capacity and problem.reason == NO_MATCHING_NODE


def test_an_unrecognised_scheduler_message_still_limits_scaling():
    from tidepool.operator.api import InferenceServiceStatus

    outcome = Outcome(pod_problems=[PodProblem("unified", "p", UNSCHEDULABLE, "0/2 nodes: gpu")])
    status = build_status(InferenceServiceStatus(), 1, [], None, outcome, None, None, None, "now")
    limited = status.condition("ScalingLimited")
    assert (limited.status, limited.reason) == ("True", UNSCHEDULABLE) and "0/2 nodes: gpu" in limited.message
