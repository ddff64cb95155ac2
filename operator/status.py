"""Status of an InferenceService, from the observations of its pools (observe.py). Pure.

`build_status()` turns the observations into `InferenceServiceStatus` with the four Deployment-shaped
conditions, each decided by its own function below. `now` is passed in (no clock here).

Conditions (what `kubectl wait` and Argo CD read):
- Ready=True (observedGeneration G) exactly when every pool and the router have at least their
  minimum replicas ready on generation G's template (pod spec-hash label) and every workload's
  controller has seen that template. During a rollout or scale-up that keeps serving, a Ready=True
  of an older generation is kept as it was (still true of that generation), so
  `kubectl wait --for=condition=Ready` (which skips conditions of older generations) returns only
  when the new template serves, and dashboards never see the service flap while it serves. Without a
  router (router.enabled false) its message says so (NO_ROUTER_NOTE): status.url is the pool's Service.
- Progressing=True while replicas are being replaced (RollingOut) or added/removed (Scaling); its message
  names the pods whose model download runs and since when.
- Degraded=True when the API refused a child, a workload controller failed, spec.auth's Secret or key is
  missing (reason ApiKeySecretMissing, also Ready's reason while pods wait for it), or pods cannot run
  (a failed model download: reason ModelDownloadFailed, also Ready's reason, with the download's own
  one-line cause, e.g. "pod P: model download failed: 401 ... Secret hf-token key HF_TOKEN ..."), or a
  declared LoRA adapter failed to load (reason AdapterLoadFailed, with the engine's reason; it does not
  touch Ready or Progressing: the service serves the base model and its other adapters).
- ScalingLimited=True when pods cannot run or the autoscaler hit a bound; its reason tells why (the most
  actionable first, with the pod counts of each): UnboundClaim, NoMatchingNode, Evicted (until a ready pod
  replaces it), InsufficientCapacity, Unschedulable; Ready's reason while not serving, too.
- Reconciling and Stalled (kstatus' abnormal-true pair, what Flux `wait` and kstatus read; never both True):
  Stalled=True when the spec is invalid, or when generation G does not serve yet (or still rolls out) and
  something blocks it: Degraded's signals (a refused apply, a workload failure such as a Deployment's
  progress deadline, a failed model download, a crash loop, an image that cannot be pulled), with
  Degraded's reason and message. Otherwise Reconciling=True until G is done: its children applied, its
  template serving at the pools' minimum and no replica of an older template left. Pods that merely wait
  for room (Unschedulable) are Reconciling, not Stalled: capacity often arrives (cluster autoscaler), and
  the Deployment's progress deadline turns a wait that never ends into a workload failure. Scaling within
  a generation (the autoscaler, extra replicas starting) is not reconciling: G serves.
`status.observedGeneration` moves to G once G's children are applied, or once G is found invalid or its
apply refused (Stalled=True then says so: kstatus reads an unobserved generation as InProgress, never
Failed). So kstatus calls the service Current exactly when G is done. A condition's lastTransitionTime
moves only when its status does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tidepool.operator.api import Condition, InferenceServiceStatus, PoolStatus
from tidepool.operator.observe import PodProblem, PoolObservation
from tidepool.operator.pod_problems import CAPACITY_REASONS, DOWNLOAD_FAILED

API_KEY_MISSING = "ApiKeySecretMissing"  # spec.auth's Secret or key is missing (api_keys.py)

# A condition as decided: (status, reason, message, observedGeneration or None for the current one).
Verdict = tuple[bool, str, str, int | None]
SERVING_CURRENT = "MinimumReplicasReady"  # Ready's reason when this generation's template serves


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
    auth_problem: str | None = None  # spec.auth's Secret or key is missing (api_keys.py): new pods cannot start

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


# Ready's message says it when a service runs without a router (router.enabled: false): status.url is then the
# pool's Service, which balances connections only (no prefix-aware routing, no request holding).
NO_ROUTER_NOTE = "no router: the pool's Service selects the serving pods; route with an InferencePool/gateway"


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
        return True, SERVING_CURRENT, f"serving at {url} on the current spec: {_counts(members)}", None
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
    elif outcome.auth_problem:  # new pods wait for the Secret (FailedMount): name it first
        reason = API_KEY_MISSING
        message = f"{outcome.auth_problem}; {message}"
    elif downloads:  # the first thing an admin must fix: say what, before the counts
        reason = DOWNLOAD_FAILED
        message = f"pod {downloads[0].pod}: {downloads[0].message}; {message}"
    elif outcome.capacity:  # the most actionable of what keeps replicas from running (ScalingLimited's)
        reason, first = _limits(outcome.capacity)[0]
        message = f"pod {first[0].pod}: {first[0].message}; {message}"
    else:
        reason = "RollingOut" if any(m.is_rolling for m in not_serving) else "ReplicasNotReady"
    return False, reason, message[:4000], None


def _degraded_messages(members: Sequence[PoolObservation], outcome: Outcome) -> list[str]:
    failures = [m.failure for m in members if m.failure]
    auth = [outcome.auth_problem] if outcome.auth_problem else []
    return [*auth, *failures, *(f"pod {p.pod} ({p.pool}): {p.reason}: {p.message}" for p in outcome.broken)]


def _degraded(members: Sequence[PoolObservation], outcome: Outcome) -> Verdict:
    broken = outcome.broken
    messages = _degraded_messages(members, outcome)
    if outcome.apply_error:
        return True, "ApplyFailed", outcome.apply_error, None
    if messages:
        first_download = next((p for p in broken if p.reason == DOWNLOAD_FAILED), None)
        failed = any(m.failure for m in members)
        if outcome.auth_problem:  # the cause of the new pods' FailedMount
            reason = API_KEY_MISSING
        else:
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


def _limits(capacity: Sequence[PodProblem]) -> list[tuple[str, list[PodProblem]]]:
    """The pods that cannot run, by reason, the most actionable reason first (CAPACITY_REASONS' order)."""
    by_reason: dict[str, list[PodProblem]] = {}
    for problem in capacity:
        by_reason.setdefault(problem.reason, []).append(problem)
    rank = {reason: i for i, reason in enumerate(CAPACITY_REASONS)}
    return sorted(by_reason.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0]))


def _pods(problems: Sequence[PodProblem], most: int = 5) -> str:
    names = sorted({f"{p.pool}/{p.pod}" for p in problems})
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _scaling_limited(outcome: Outcome) -> Verdict:
    limits = _limits(outcome.capacity)
    if limits:  # "2 pod(s) cannot run (unified/a, unified/b): no node matches ...; also 1 pod(s) Evicted (...): ..."
        (reason, first), others = limits[0], limits[1:]
        message = f"{len(first)} pod(s) cannot run ({_pods(first)}): {first[0].message}"
        if others:
            message += "; also " + "; ".join(f"{len(ps)} pod(s) {r} ({_pods(ps)}): {ps[0].message}" for r, ps in others)
        return True, reason, message[:4000], None
    if outcome.scaling_limit:
        return True, *outcome.scaling_limit, None
    return False, "AsExpected", "", None


# Degraded reasons that leave the service serving all it can: never Stalled.
NOT_BLOCKING = frozenset({"AsExpected", "AdapterLoadFailed"})


def _done(
    members: Sequence[PoolObservation], replaced: Sequence[PoolObservation], outcome: Outcome, ready: Verdict
) -> bool:
    """Generation G is done: applied, its template serving at the minimum (not an earlier generation's Ready
    kept meanwhile), no replica of an older template left and no pool of an earlier mode still running."""
    serving = ready[0] and ready[1] == SERVING_CURRENT
    return outcome.applied and serving and not replaced and not any(m.is_rolling for m in members)


def _stalled(done: bool, degraded: Verdict) -> Verdict:
    value, reason, message, _ = degraded
    if value and reason not in NOT_BLOCKING and not done:
        return True, reason, message, None
    return False, "AsExpected", "", None


def _reconciling(
    members: Sequence[PoolObservation],
    replaced: Sequence[PoolObservation],
    outcome: Outcome,
    verdicts: tuple[bool, Verdict, Verdict],  # (done, Ready, Stalled)
    generation: int,
) -> Verdict:
    done, ready, stalled = verdicts
    if stalled[0]:
        return False, "Stalled", "blocked: see the Stalled condition", None
    if done:
        return False, "Current", f"generation {generation} serves: {_counts(members)}", None
    if not ready[0]:  # not serving on this generation's template yet: Ready says why
        reason, message = ready[1], ready[2]
    else:  # serving (on this template or an earlier one) while replicas are still replaced
        reason = "RollingOut"
        parts = [_describe(m) for m in members if m.is_rolling or not m.is_serving_current]
        parts += [f"{m.name} of the earlier mode: still running until the new pools serve" for m in replaced]
        message = "; ".join(parts) or "applying the spec"
    if outcome.downloading:
        message += "; downloading the model: " + ", ".join(outcome.downloading)
    return True, reason, message[:4000], None


def _invalid(message: str) -> dict[str, Verdict]:
    return {
        "Ready": (False, "InvalidSpec", message, None),
        "Progressing": (False, "InvalidSpec", "nothing will change until the spec is fixed", None),
        "Degraded": (True, "InvalidSpec", message, None),
        "ScalingLimited": (False, "InvalidSpec", "", None),
        "Reconciling": (False, "Stalled", "blocked: see the Stalled condition", None),
        "Stalled": (True, "InvalidSpec", message, None),
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
    if outcome.applied or outcome.spec_error or outcome.apply_error:
        status.observed_generation = generation  # G observed: done, or a verdict (Stalled) about G
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
        where = url if router or url is None else f"{url} ({NO_ROUTER_NOTE})"
        ready = _ready(members, serving, outcome, where, generation, previous.condition("Ready"))
        degraded = _degraded(members, outcome)
        done = _done(members, replaced, outcome, ready)
        stalled = _stalled(done, degraded)
        verdicts = {
            "Ready": ready,
            "Degraded": degraded,
            "Progressing": _progressing(members, outcome),
            "ScalingLimited": _scaling_limited(outcome),
            "Reconciling": _reconciling(members, replaced, outcome, (done, ready, stalled), generation),
            "Stalled": stalled,
        }
    for type_, (value, reason, message, observed) in verdicts.items():
        status.set_condition(type_, "True" if value else "False", reason, message, observed or generation, now)
    return status
