"""Status of an InferenceService, computed from its workloads and pods as the caches hold them. Pure.

`PoolLayout` is what the builders planned for a pool (or the router): its workloads, replicas, the
minimum that must serve, the current template hash. `observe_pool()` counts replicas from the pods
(a multi-node replica is ready when all its pods are) and checks the workloads carry the current
template; `build_status()` turns the observations into `InferenceServiceStatus` with the four
Deployment-shaped conditions. `now` is passed in (no clock here).

Conditions (what `kubectl wait` and Argo CD read):
- Ready=True (observedGeneration G) exactly when every pool and the router have at least their
  minimum replicas ready on generation G's template (pod spec-hash label) and every workload's
  controller has seen that template. During a rollout or scale-up that keeps serving, a Ready=True
  of an older generation is kept as it was (still true of that generation), so
  `kubectl wait --for=condition=Ready` (which skips conditions of older generations) returns only
  when the new template serves, and dashboards never see the service flap while it serves.
- Progressing=True while replicas are being replaced (RollingOut) or added/removed (Scaling); its message
  names the pods whose model download runs and since when.
- Degraded=True when the API refused a child, a workload controller failed, or pods cannot run
  (a failed model download: reason ModelDownloadFailed, also Ready's reason, with the download's own
  one-line cause, e.g. "pod P: model download failed: 401 ... Secret hf-token key HF_TOKEN ...").
- ScalingLimited=True when pods cannot be scheduled or the autoscaler hit a bound.
`status.observedGeneration` moves to G only once G's children are applied. A condition's
lastTransitionTime moves only when its status does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.operator.api import InferenceServiceStatus, PoolStatus
from tidepool.operator.builders import LABEL_SPEC_HASH
from tidepool.operator.cache import PodInfo
from tidepool.operator.pod_problems import DOWNLOAD_FAILED


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """The plan for one pool (or the router), read from the desired manifests."""

    name: str
    desired: int  # replicas the operator drives towards
    floor: int  # replicas that must be ready on the current template for the pool to serve
    spec_hash: str  # the pod template hash of the current spec ("" when no workload is planned)
    workloads: tuple[tuple[str, str], ...]  # (kind, name) of its workload objects
    pods_per_replica: int = 1


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
    reason: str  # Unschedulable | ImagePullBackOff | CrashLoopBackOff | ...
    message: str

    @property
    def is_capacity(self) -> bool:
        return self.reason == "Unschedulable"


@dataclass(slots=True)
class Outcome:
    """Inputs of one status computation beyond the observations."""

    spec_error: str | None = None  # the spec can never work
    apply_error: str | None = None  # the API server refused a child
    applied: bool = True  # this generation's children are all applied
    scaling_limit: tuple[str, str] | None = None  # (reason, message) from the autoscaler
    pod_problems: list[PodProblem] = field(default_factory=list)
    downloading: list[str] = field(default_factory=list)  # "pod P (since T)" of model downloads under way


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


def _applied(layout: PoolLayout, workloads: Mapping[tuple[str, str], Mapping[str, Any]]) -> bool:
    for key in layout.workloads:
        obj = workloads.get(key)
        if obj is None or template_hash(obj) != layout.spec_hash:
            return False
        seen = int((obj.get("status") or {}).get("observedGeneration", 0))
        if obj["kind"] != "LeaderWorkerSet" and seen < int(obj["metadata"].get("generation", 1)):
            return False
    return True


def observe_pool(
    layout: PoolLayout, workloads: Mapping[tuple[str, str], Mapping[str, Any]], pods: Sequence[PodInfo]
) -> PoolObservation:
    """Counts of one pool from its live pods; `workloads` maps (kind, name) -> observed workload."""
    groups: dict[str, list[PodInfo]] = defaultdict(list)
    for pod in pods:
        if pod.pool == layout.name and not pod.is_terminating:
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


def pod_problems(pods: Sequence[PodInfo]) -> list[PodProblem]:
    """Problems of the pods of one InferenceService that are not ready."""
    out = [
        PodProblem(pod.pool, pod.name, reason, message)
        for pod in pods
        if not pod.is_ready and not pod.is_terminating
        for reason, message in pod.problems
    ]
    return sorted(out, key=lambda p: (p.pool, p.pod, p.reason))


def downloads_in_progress(pods: Sequence[PodInfo]) -> list[str]:
    """The pods whose model download runs, as "pod P (since T)", for the Progressing message."""
    return sorted(f"pod {p.name} (since {p.downloading_since})" for p in pods if p.downloading_since)


def _describe(obs: PoolObservation) -> str:
    text = f"{obs.name}: {obs.ready}/{obs.desired} ready"
    if obs.updated_ready != obs.ready or obs.updated != obs.replicas:
        text += f" ({obs.updated_ready} on the current spec)"
    if obs.replicas != obs.desired:
        text += f", {obs.replicas} exist"
    if not obs.applied:
        text += ", new spec not yet seen by its workload controller"
    return text


def _counts(members: Sequence[PoolObservation]) -> str:
    return ", ".join(f"{m.name} {m.updated_ready}/{m.desired} (min {m.floor})" for m in members)


def _still_serving(
    members: Sequence[PoolObservation], router: PoolObservation | None, replaced: Sequence[PoolObservation]
) -> bool:
    """Serving on any template: every pool (or, in a mode switch, every old pool) and the router."""
    if replaced:
        return all(m.is_serving for m in replaced) and (router is None or router.is_serving)
    return all(m.is_serving for m in members)


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
    replaced: Sequence[PoolObservation] = (),
) -> InferenceServiceStatus:
    """The new status; conditions keep their lastTransitionTime when their status is unchanged.

    `replaced`: pools a mode switch is replacing, still running until the new pools serve; while they
    and the router serve, the service is serving on its earlier spec."""
    status = previous.model_copy(deep=True)
    if outcome.applied and not outcome.spec_error:
        status.observed_generation = generation
    status.pools = {
        p.name: PoolStatus(
            replicas=p.replicas, ready_replicas=p.ready, updated_replicas=p.updated, desired_replicas=p.desired
        )
        for p in pools
    }
    scaled = next((p for p in pools if p.name == scaled_pool), None)
    status.replicas = scaled.replicas if scaled else None
    status.selector = selector
    status.url = url

    def cond(type_: str, value: bool, reason: str, message: str, observed: int = generation) -> None:
        status.set_condition(type_, "True" if value else "False", reason, message, observed, now)

    if outcome.spec_error:
        cond("Ready", False, "InvalidSpec", outcome.spec_error)
        cond("Progressing", False, "InvalidSpec", "nothing will change until the spec is fixed")
        cond("Degraded", True, "InvalidSpec", outcome.spec_error)
        cond("ScalingLimited", False, "InvalidSpec", "")
        return status

    members = [*pools, *([router] if router else [])]
    failures = [m.failure for m in members if m.failure]
    capacity = [p for p in outcome.pod_problems if p.is_capacity]
    broken = [p for p in outcome.pod_problems if not p.is_capacity]
    was_ready = previous.condition("Ready")

    if outcome.applied and all(m.is_serving_current for m in members):
        cond("Ready", True, "MinimumReplicasReady", f"serving at {url} on the current spec: {_counts(members)}")
    elif _still_serving(members, router, replaced) and was_ready is not None and was_ready.status == "True":
        # Still true of the generation it was computed for: keep it (and its generation) while the
        # new template rolls out, so nothing reads the service as down while it serves.
        lagging = "; ".join(_describe(m) for m in members if not m.is_serving_current)
        message = f"serving at {url} on an earlier spec while generation {generation} rolls out: {lagging}"
        cond("Ready", True, "ServingPreviousSpec", message, was_ready.observed_generation or generation)
    else:
        not_serving = [m for m in members if not m.is_serving_current]
        message = "; ".join(_describe(m) for m in not_serving) or "children not applied yet"
        downloads = [p for p in broken if p.reason == DOWNLOAD_FAILED]
        if outcome.apply_error:
            reason = "ApplyFailed"
        elif downloads:  # the first thing an admin must fix: say what, before the counts
            reason = DOWNLOAD_FAILED
            message = f"pod {downloads[0].pod}: {downloads[0].message}; {message}"
        elif capacity:
            reason = "Unschedulable"
        else:
            reason = "RollingOut" if any(m.is_rolling for m in not_serving) else "ReplicasNotReady"
        cond("Ready", False, reason, message[:4000])

    degraded_msgs = [*failures, *(f"pod {p.pod} ({p.pool}): {p.reason}: {p.message}" for p in broken)]
    first_download = next((p for p in broken if p.reason == DOWNLOAD_FAILED), None)
    if outcome.apply_error:
        cond("Degraded", True, "ApplyFailed", outcome.apply_error)
    elif degraded_msgs:
        reason = "WorkloadFailure" if failures else (first_download or broken[0]).reason
        cond("Degraded", True, reason, "; ".join(degraded_msgs)[:4000])
    else:
        cond("Degraded", False, "AsExpected", "")

    unfinished = [m for m in members if not m.is_complete]
    if outcome.applied and not unfinished:
        cond("Progressing", False, "Complete", f"every pool runs the current spec: {_counts(members)}")
    elif outcome.apply_error or degraded_msgs:
        cond("Progressing", False, "Stalled", "see the Degraded condition")
    else:
        reason = "RollingOut" if not outcome.applied or any(m.is_rolling for m in unfinished) else "Scaling"
        message = "; ".join(_describe(m) for m in unfinished) or "applying the spec"
        if outcome.downloading:
            message += "; downloading the model: " + ", ".join(outcome.downloading)
        cond("Progressing", True, reason, message[:4000])

    if capacity:
        pods = ", ".join(sorted({f"{p.pool}/{p.pod}" for p in capacity}))
        message = f"pods cannot be scheduled ({pods}): {capacity[0].message}"
        cond("ScalingLimited", True, "InsufficientCapacity", message[:4000])
    elif outcome.scaling_limit:
        cond("ScalingLimited", True, *outcome.scaling_limit)
    else:
        cond("ScalingLimited", False, "AsExpected", "")
    return status
