"""What an InferenceService's pods and workloads show, counted against the builders' pool layouts. Pure.

`observe_pool()` counts one pool's replicas from its live pods (a multi-node replica is ready when
all its pods are) and checks its workloads carry the current template (`PoolLayout.spec_hash`) and
that their controllers have seen it; `observe()` does so for every pool and the router of a
`Desired`; `old_pools()` gives the layouts of pools a mode switch replaces (read from the old
workloads still in the cluster), so they can be counted while they serve. `pod_problems()` and
`downloads_in_progress()` say why pods do not progress.

Invariants: no client, no clock; reads only the cached objects it is given.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tidepool.operator.builders import LABEL_POOL, LABEL_SPEC_HASH, WORKLOAD_KINDS, ChildKey, Desired, PoolLayout
from tidepool.operator.cache import PodInfo
from tidepool.operator.pod_problems import CAPACITY_REASONS


@dataclass(frozen=True, slots=True)
class PoolObservation:
    """What one pool's pods and workloads show."""

    name: str
    desired: int
    floor: int = 1
    replicas: int = 0  # replicas with at least one live pod (any template)
    ready: int = 0  # replicas whose every pod is ready (any template)
    updated: int = 0  # replicas whose pods all run the current template
    updated_ready: int = 0  # ... and are ready
    applied: bool = True  # every workload carries the current template and its controller has seen it
    failure: str | None = None  # the workload controller's own failure (ReplicaFailure, deadline)

    @property
    def is_serving_current(self) -> bool:
        return self.applied and self.updated_ready >= self.floor

    @property
    def is_serving(self) -> bool:
        return self.ready >= self.floor

    @property
    def is_complete(self) -> bool:
        return self.applied and self.updated_ready == self.desired and self.replicas == self.desired

    @property
    def is_rolling(self) -> bool:
        return not self.applied or self.updated < self.replicas


@dataclass(frozen=True, slots=True)
class PodProblem:
    """A pod that cannot make progress: unschedulable (capacity) or failing (image, crash, admission)."""

    pool: str
    pod: str
    reason: str  # InsufficientCapacity | NoMatchingNode | UnboundClaim | Evicted | ImagePullBackOff | ...
    message: str

    @property
    def is_capacity(self) -> bool:
        """Limits how many replicas run (ScalingLimited) rather than breaks the service (Degraded)."""
        return self.reason in CAPACITY_REASONS


def template_hash(workload: Mapping[str, Any]) -> str | None:
    spec = workload.get("spec") or {}
    lws = spec.get("leaderWorkerTemplate")
    template = lws["workerTemplate"] if lws else spec.get("template")
    return (((template or {}).get("metadata") or {}).get("labels") or {}).get(LABEL_SPEC_HASH)


def pods_per_replica(workload: Mapping[str, Any]) -> int:
    spec = workload.get("spec") or {}
    if workload["kind"] == "StatefulSet":
        return int(spec.get("replicas", 1))
    if workload["kind"] == "LeaderWorkerSet":
        return int(spec["leaderWorkerTemplate"].get("size", 1))
    return 1


def _failure(obj: Mapping[str, Any]) -> str | None:
    for cond in (obj.get("status") or {}).get("conditions", []):
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return f"{obj['kind']} {obj['metadata']['name']}: {cond.get('message', cond.get('reason', ''))}"
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return f"{obj['kind']} {obj['metadata']['name']}: {cond.get('message', 'progress deadline exceeded')}"
    return None


def _applied(layout: PoolLayout, workloads: Mapping[ChildKey, Mapping[str, Any]]) -> bool:
    for key in layout.workloads:
        obj = workloads.get(key)
        if obj is None or template_hash(obj) != layout.spec_hash:
            return False
        seen = int((obj.get("status") or {}).get("observedGeneration", 0))
        if obj["kind"] != "LeaderWorkerSet" and seen < int(obj["metadata"].get("generation", 1)):
            return False
    return True


def observe_pool(
    layout: PoolLayout, workloads: Mapping[ChildKey, Mapping[str, Any]], pods: Sequence[PodInfo]
) -> PoolObservation:
    """Counts of one pool from its live pods; `workloads` maps (kind, name) -> observed workload."""
    groups: dict[str, list[PodInfo]] = defaultdict(list)
    for pod in pods:
        if pod.pool == layout.name and pod.is_live:  # a Failed (evicted) or Succeeded pod never counts
            groups[pod.group if pod.group is not None else f"pod/{pod.name}"].append(pod)
    replicas = ready = updated = updated_ready = 0
    for members in groups.values():
        is_ready = all(p.is_ready for p in members) and (
            len(members) >= layout.pods_per_replica if members[0].group is not None else True
        )
        is_updated = all(p.spec_hash == layout.spec_hash for p in members)
        replicas += 1
        ready += is_ready
        updated += is_updated
        updated_ready += is_ready and is_updated
    failure = next((f for k in layout.workloads if (obj := workloads.get(k)) and (f := _failure(obj))), None)
    return PoolObservation(
        name=layout.name,
        desired=layout.desired,
        floor=layout.floor,
        replicas=replicas,
        ready=ready,
        updated=updated,
        updated_ready=updated_ready,
        applied=_applied(layout, workloads),
        failure=failure,
    )


def _replaced(pod: PodInfo, pods: Sequence[PodInfo]) -> bool:
    """A finished pod whose pool has had a ready pod created since it stopped: its eviction is history
    (finished pods stay in the API until deleted), not why the pool is short now."""
    stopped = pod.finished_at or pod.created
    return pod.is_finished and any(
        p.pool == pod.pool and p.is_live and p.is_ready and p.created >= stopped for p in pods
    )


def pod_problems(pods: Sequence[PodInfo]) -> list[PodProblem]:
    """Problems of the pods of one InferenceService that are not ready (an evicted pod's until replaced)."""
    out = [
        PodProblem(pod.pool, pod.name, reason, message)
        for pod in pods
        if not pod.is_ready and not pod.is_terminating and not _replaced(pod, pods)
        for reason, message in pod.problems
    ]
    return sorted(out, key=lambda p: (p.pool, p.pod, p.reason))


def downloads_in_progress(pods: Sequence[PodInfo]) -> list[str]:
    """The pods whose model download runs, as "pod P (since T)", for the Progressing message."""
    return sorted(f"pod {p.name} (since {p.downloading_since})" for p in pods if p.downloading_since)


def observe(
    desired: Desired, workloads: Mapping[ChildKey, Mapping[str, Any]], pods: Sequence[PodInfo]
) -> tuple[list[PoolObservation], PoolObservation | None]:
    pools = [observe_pool(layout, workloads, pods) for layout in desired.pools]
    router = observe_pool(desired.router, workloads, pods) if desired.router else None
    return pools, router


def old_pools(deferred: Sequence[Mapping[str, Any]], desired: Desired) -> list[PoolLayout]:
    """Layouts of the pools a mode switch replaces (their workloads are among the deferred prunes), so
    their pods can be counted while they still serve."""
    current = {layout.name for layout in desired.pools}
    by_pool: dict[str, list[Mapping[str, Any]]] = {}
    for obj in deferred:
        pool = (obj["metadata"].get("labels") or {}).get(LABEL_POOL, "")
        if obj["kind"] in WORKLOAD_KINDS and pool not in current:
            by_pool.setdefault(pool, []).append(obj)
    layouts = []
    for pool, workloads in sorted(by_pool.items()):
        first = workloads[0]
        groups = first["kind"] == "StatefulSet"  # one StatefulSet per replica
        replicas = len(workloads) if groups else int(first["spec"].get("replicas", 1))
        layouts.append(
            PoolLayout(
                name=pool,
                desired=replicas,
                floor=min(replicas, 1),
                spec_hash=template_hash(first) or "",
                workloads=tuple((w["kind"], w["metadata"]["name"]) for w in workloads),
                pods_per_replica=pods_per_replica(first),
            )
        )
    return layouts
