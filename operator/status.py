"""Status of an InferenceService, computed from what the cluster reports about its children. Pure.

`observe_pool()` reads one pool's workload objects (Deployment, StatefulSet groups or a
LeaderWorkerSet) into counts; `build_status()` turns pool and router observations, pod problems and
errors into an `InferenceServiceStatus` with the four conditions. `now` is passed in (no clock here).

Invariants: a condition's lastTransitionTime moves only when its status does (the API model's
`set_condition`); Ready is True only when every pool and the router run the current spec with all
desired replicas ready (a rollout in progress is Progressing, not Ready); messages name the pool
and what is missing, so `kubectl describe` tells the user what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.operator.api import InferenceServiceStatus, PoolStatus


@dataclass(frozen=True, slots=True)
class PoolObservation:
    """What the workloads of one pool (or the router) report."""

    name: str
    desired: int  # replicas the operator drives towards
    replicas: int = 0  # replicas that exist (a multi-node replica counts once)
    ready: int = 0  # replicas whose every pod is ready
    rolled_out: bool = True  # every replica runs the current template and the controller saw it
    failure: str | None = None  # the workload controller's own failure (ReplicaFailure, deadline)

    @property
    def is_ready(self) -> bool:
        return self.ready >= self.desired and self.replicas == self.desired and self.rolled_out and not self.failure


@dataclass(frozen=True, slots=True)
class PodProblem:
    """A pod that cannot make progress: unschedulable (capacity) or failing (image, crash, admission)."""

    pool: str
    pod: str
    reason: str  # Unschedulable | ImagePullBackOff | CrashLoopBackOff | FailedCreate | ...
    message: str

    @property
    def is_capacity(self) -> bool:
        return self.reason == "Unschedulable"


@dataclass(slots=True)
class Outcome:
    """Inputs of one status computation beyond the observations."""

    spec_error: str | None = None  # the spec can never work (PermanentError)
    apply_error: str | None = None  # the API server refused a child
    scaling_limit: tuple[str, str] | None = None  # (reason, message) from the autoscaler seam
    pod_problems: list[PodProblem] = field(default_factory=list)


def _generation_seen(obj: Mapping[str, Any]) -> bool:
    status = obj.get("status") or {}
    return int(status.get("observedGeneration", 0)) >= int(obj["metadata"].get("generation", 1))


def _failure(obj: Mapping[str, Any]) -> str | None:
    for cond in (obj.get("status") or {}).get("conditions", []):
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return f"{obj['kind']} {obj['metadata']['name']}: {cond.get('message', cond.get('reason', ''))}"
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return f"{obj['kind']} {obj['metadata']['name']}: {cond.get('message', 'progress deadline exceeded')}"
    return None


def observe_pool(name: str, desired: int, workloads: Sequence[Mapping[str, Any]]) -> PoolObservation:
    """Counts of one pool from its workload objects (as returned by the API server)."""
    if not workloads:
        return PoolObservation(name, desired, rolled_out=desired == 0)
    kind = workloads[0]["kind"]
    if kind == "StatefulSet":  # one StatefulSet per multi-node replica
        ready = rolled = 0
        for sts in workloads:
            st, size = sts.get("status") or {}, int(sts["spec"].get("replicas", 1))
            current = _generation_seen(sts) and st.get("updateRevision") in (None, st.get("currentRevision"))
            rolled += bool(current and int(st.get("updatedReplicas", 0)) == size)
            ready += int(st.get("readyReplicas", 0)) == size
        failure = next((f for f in map(_failure, workloads) if f), None)
        return PoolObservation(name, desired, len(workloads), ready, rolled == len(workloads), failure)
    obj = workloads[0]  # Deployment or LeaderWorkerSet: one object per pool
    st, want = obj.get("status") or {}, int(obj["spec"].get("replicas", 0))
    replicas = int(st.get("replicas", 0))
    rolled = (_generation_seen(obj) if kind == "Deployment" else True) and int(
        st.get("updatedReplicas", 0)
    ) == want == replicas
    if kind == "Deployment":
        rolled = rolled and int(st.get("availableReplicas", 0)) >= want
    return PoolObservation(name, desired, replicas, int(st.get("readyReplicas", 0)), rolled, _failure(obj))


def _describe(obs: PoolObservation) -> str:
    text = f"{obs.name}: {obs.ready}/{obs.desired} ready"
    if obs.replicas != obs.desired:
        text += f", {obs.replicas} exist"
    if not obs.rolled_out:
        text += ", rollout in progress"
    return text


def build_status(
    previous: InferenceServiceStatus,
    generation: int,
    pools: Sequence[PoolObservation],
    router: PoolObservation | None,
    outcome: Outcome,
    url: str | None,
    selector: str | None,
    scaled_pool: str | None,
    now: str,
) -> InferenceServiceStatus:
    """The new status; conditions keep their lastTransitionTime when their status is unchanged."""
    status = previous.model_copy(deep=True)
    status.observed_generation = generation
    status.pools = {
        p.name: PoolStatus(replicas=p.replicas, ready_replicas=p.ready, desired_replicas=p.desired) for p in pools
    }
    scaled = next((p for p in pools if p.name == scaled_pool), None)
    status.replicas = scaled.replicas if scaled else None
    status.selector = selector
    status.url = url

    def cond(type_: str, value: bool, reason: str, message: str) -> None:
        status.set_condition(type_, "True" if value else "False", reason, message, generation, now)

    if outcome.spec_error:
        cond("Ready", False, "InvalidSpec", outcome.spec_error)
        cond("Progressing", False, "InvalidSpec", "nothing will change until the spec is fixed")
        cond("Degraded", True, "InvalidSpec", outcome.spec_error)
        cond("ScalingLimited", False, "InvalidSpec", "")
        return status

    members = [*pools, *([router] if router else [])]
    not_ready = [m for m in members if not m.is_ready]
    failures = [m.failure for m in members if m.failure]
    capacity = [p for p in outcome.pod_problems if p.is_capacity]
    broken = [p for p in outcome.pod_problems if not p.is_capacity]

    if not not_ready:
        counts = ", ".join(f"{m.name} {m.ready}/{m.desired}" for m in members)
        cond("Ready", True, "AllReplicasReady", f"all replicas ready ({counts}); serving at {url}")
    else:
        reason = (
            "Unschedulable"
            if capacity
            else ("RollingOut" if any(not m.rolled_out for m in not_ready) else "ReplicasNotReady")
        )
        cond("Ready", False, reason, "; ".join(_describe(m) for m in not_ready))

    degraded_msgs = [*failures, *(f"pod {p.pod} ({p.pool}): {p.reason}: {p.message}" for p in broken)]
    if outcome.apply_error:
        cond("Degraded", True, "ApplyFailed", outcome.apply_error)
    elif degraded_msgs:
        reason = "WorkloadFailure" if failures else broken[0].reason
        cond("Degraded", True, reason, "; ".join(degraded_msgs)[:4000])
    else:
        cond("Degraded", False, "AsExpected", "")

    if not not_ready:
        cond("Progressing", False, "Complete", "every pool runs the current spec")
    elif outcome.apply_error or degraded_msgs:
        cond("Progressing", False, "Stalled", "see the Degraded condition")
    else:
        scaling = [m for m in not_ready if m.rolled_out]
        reason = "RollingOut" if len(scaling) < len(not_ready) else "Scaling"
        cond("Progressing", True, reason, "; ".join(_describe(m) for m in not_ready))

    if capacity:
        pods = ", ".join(sorted({f"{p.pool}/{p.pod}" for p in capacity}))
        cond(
            "ScalingLimited", True, "InsufficientCapacity", f"pods cannot be scheduled ({pods}): {capacity[0].message}"
        )
    elif outcome.scaling_limit:
        cond("ScalingLimited", True, *outcome.scaling_limit)
    else:
        cond("ScalingLimited", False, "AsExpected", "")
    return status


def pod_problems(pool_of: Mapping[str, str], pods: Sequence[Mapping[str, Any]]) -> list[PodProblem]:
    """Problems of pods (already filtered to one InferenceService); `pool_of` maps pod name -> pool."""
    out: list[PodProblem] = []
    for pod in pods:
        name = pod["metadata"]["name"]
        pool = pool_of.get(name, "?")
        status = pod.get("status") or {}
        for cond in status.get("conditions", []):
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                out.append(PodProblem(pool, name, cond.get("reason") or "Unschedulable", cond.get("message", "")))
        for cs in [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in (
                "ImagePullBackOff",
                "ErrImagePull",
                "CrashLoopBackOff",
                "CreateContainerConfigError",
            ):
                out.append(PodProblem(pool, name, waiting["reason"], waiting.get("message", "")))
    return sorted(out, key=lambda p: (p.pool, p.pod, p.reason))
