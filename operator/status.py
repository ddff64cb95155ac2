"""Status of an InferenceService, from the observations of its pools (observe.py). Pure.

`build_status()` turns the observations into `InferenceServiceStatus` with the four Deployment-shaped
conditions, each decided by its own function below. `now` is passed in (no clock here).

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
  one-line cause, e.g. "pod P: model download failed: 401 ... Secret hf-token key HF_TOKEN ..."), or a
  declared LoRA adapter failed to load (reason AdapterLoadFailed, with the engine's reason; it does not
  touch Ready or Progressing: the service serves the base model and its other adapters).
- ScalingLimited=True when pods cannot be scheduled or the autoscaler hit a bound.
`status.observedGeneration` moves to G only once G's children are applied. A condition's
lastTransitionTime moves only when its status does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tidepool.operator.api import Condition, InferenceServiceStatus, PoolStatus
from tidepool.operator.observe import PodProblem, PoolObservation
from tidepool.operator.pod_problems import DOWNLOAD_FAILED

# A condition as decided: (status, reason, message, observedGeneration or None for the current one).
Verdict = tuple[bool, str, str, int | None]


@dataclass(slots=True)
class Outcome:
    """Inputs of one status computation beyond the observations."""

    spec_error: str | None = None  # the spec can never work
    apply_error: str | None = None  # the API server refused a child
    applied: bool = True  # this generation's children are all applied
    scaling_limit: tuple[str, str] | None = None  # (reason, message) from the autoscaler
    pod_problems: list[PodProblem] = field(default_factory=list)
    downloading: list[str] = field(default_factory=list)  # "pod P (since T)" of model downloads under way
    adapter_failures: list[str] = field(default_factory=list)  # declared LoRA adapters that failed to load

    @property
    def capacity(self) -> list[PodProblem]:
        return [p for p in self.pod_problems if p.is_capacity]

    @property
    def broken(self) -> list[PodProblem]:
        return [p for p in self.pod_problems if not p.is_capacity]


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


def _ready(
    members: Sequence[PoolObservation],
    still_serving: bool,
    outcome: Outcome,
    url: str | None,
    generation: int,
    was_ready: Condition | None,
) -> Verdict:
    if outcome.applied and all(m.is_serving_current for m in members):
        return True, "MinimumReplicasReady", f"serving at {url} on the current spec: {_counts(members)}", None
    if still_serving and was_ready is not None and was_ready.status == "True":
        # Still true of the generation it was computed for: keep it (and its generation) while the
        # new template rolls out, so nothing reads the service as down while it serves.
        lagging = "; ".join(_describe(m) for m in members if not m.is_serving_current)
        message = f"serving at {url} on an earlier spec while generation {generation} rolls out: {lagging}"
        return True, "ServingPreviousSpec", message, was_ready.observed_generation or generation
    not_serving = [m for m in members if not m.is_serving_current]
    message = "; ".join(_describe(m) for m in not_serving) or "children not applied yet"
    downloads = [p for p in outcome.broken if p.reason == DOWNLOAD_FAILED]
    if outcome.apply_error:
        reason = "ApplyFailed"
    elif downloads:  # the first thing an admin must fix: say what, before the counts
        reason = DOWNLOAD_FAILED
        message = f"pod {downloads[0].pod}: {downloads[0].message}; {message}"
    elif outcome.capacity:
        reason = "Unschedulable"
    else:
        reason = "RollingOut" if any(m.is_rolling for m in not_serving) else "ReplicasNotReady"
    return False, reason, message[:4000], None


def _degraded_messages(members: Sequence[PoolObservation], outcome: Outcome) -> list[str]:
    failures = [m.failure for m in members if m.failure]
    return [*failures, *(f"pod {p.pod} ({p.pool}): {p.reason}: {p.message}" for p in outcome.broken)]


def _degraded(members: Sequence[PoolObservation], outcome: Outcome) -> Verdict:
    broken = outcome.broken
    messages = _degraded_messages(members, outcome)
    if outcome.apply_error:
        return True, "ApplyFailed", outcome.apply_error, None
    if messages:
        first_download = next((p for p in broken if p.reason == DOWNLOAD_FAILED), None)
        failed = any(m.failure for m in members)
        reason = "WorkloadFailure" if failed else (first_download or broken[0]).reason
        return True, reason, "; ".join(messages)[:4000], None
    if outcome.adapter_failures:  # the service serves the base model and the other adapters meanwhile
        return True, "AdapterLoadFailed", "; ".join(outcome.adapter_failures)[:4000], None
    return False, "AsExpected", "", None


def _progressing(members: Sequence[PoolObservation], outcome: Outcome) -> Verdict:
    unfinished = [m for m in members if not m.is_complete]
    if outcome.applied and not unfinished:
        return False, "Complete", f"every pool runs the current spec: {_counts(members)}", None
    if outcome.apply_error or _degraded_messages(members, outcome):
        return False, "Stalled", "see the Degraded condition", None
    reason = "RollingOut" if not outcome.applied or any(m.is_rolling for m in unfinished) else "Scaling"
    message = "; ".join(_describe(m) for m in unfinished) or "applying the spec"
    if outcome.downloading:
        message += "; downloading the model: " + ", ".join(outcome.downloading)
    return True, reason, message[:4000], None


def _scaling_limited(outcome: Outcome) -> Verdict:
    capacity = outcome.capacity
    if capacity:
        pods = ", ".join(sorted({f"{p.pool}/{p.pod}" for p in capacity}))
        message = f"pods cannot be scheduled ({pods}): {capacity[0].message}"
        return True, "InsufficientCapacity", message[:4000], None
    if outcome.scaling_limit:
        return True, *outcome.scaling_limit, None
    return False, "AsExpected", "", None


def _invalid(message: str) -> dict[str, Verdict]:
    return {
        "Ready": (False, "InvalidSpec", message, None),
        "Progressing": (False, "InvalidSpec", "nothing will change until the spec is fixed", None),
        "Degraded": (True, "InvalidSpec", message, None),
        "ScalingLimited": (False, "InvalidSpec", "", None),
    }


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
    members = [*pools, *([router] if router else [])]
    if outcome.spec_error:
        verdicts = _invalid(outcome.spec_error)
    else:
        serving = _still_serving(members, router, replaced)
        verdicts = {
            "Ready": _ready(members, serving, outcome, url, generation, previous.condition("Ready")),
            "Degraded": _degraded(members, outcome),
            "Progressing": _progressing(members, outcome),
            "ScalingLimited": _scaling_limited(outcome),
        }
    for type_, (value, reason, message, observed) in verdicts.items():
        status.set_condition(type_, "True" if value else "False", reason, message, observed or generation, now)
    return status
