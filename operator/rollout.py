"""Rollouts under control: the pause annotation, the operator-wide rollout budget, held plans. Pure.

A *rollout* is a change that replaces running pods: an existing workload's pod template changes
(its `tidepool.dev/spec-hash`), or a pool is replaced (mode switch, Deployment <-> multi-node groups:
make-before-break, the old pool runs until the new one serves). Creating a service (no workloads
yet) and scaling are not rollouts and never wait.

- Pause: `tidepool.dev/paused: "true"` on an InferenceService: nothing is applied to or pruned from
  its children; status is still observed and written, with Progressing=Unknown, reason `Paused`
  (what a paused Deployment reports: Progressing=Unknown, reason DeploymentPaused). Removing it
  resumes (the next reconcile is a full one). A rollout the workload controllers already run
  continues: pausing stops the operator, not the Deployment controller.
- Budget (`RolloutBudget`, `--max-concurrent-rollouts`, 0 = unlimited): at most `limit` services
  roll out at once. A service whose plan is a rollout asks for a slot (`admit`); without one it waits
  in a FIFO queue (Progressing=True, reason `RolloutQueued`) and its plan is held (`hold`): changed
  workloads keep their running template (their replicas still follow the spec and the autoscaler),
  replacement pools are not created, nothing of the old pools is pruned. A slot is held until the
  service's workload controllers report every workload settled on its current template with all
  replicas ready and no pod of an older template is left (`observe`, `finished`), or until it stalls
  (Degraded: the slot goes to the next service; the stalled rollout is not counted again for the same
  target). A freed slot wakes the first waiting services. After a restart the budget learns which
  services are mid-rollout from the cluster: it grants nothing until every service known at start
  has been observed once (`start`), and a service seen mid-rollout takes a slot even over the limit.
- Operator defaults (`OperatorDefaults` in status): the operator's default images a service was last
  rolled out with. A service waiting for a slot is built with its recorded defaults, so an operator
  upgrade that changes them rolls the fleet through the budget, not all at once.

Invariants: no client, no clock (`now` is an argument), no I/O; `RolloutBudget` is the only state
(in memory, rebuilt from the cluster after a restart, see above).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.operator.api.status import Condition, ConditionStatus, InferenceServiceStatus, OperatorDefaults
from tidepool.operator.builders import LABEL_POOL, LABEL_SPEC_HASH, WORKLOAD_KINDS, ChildKey, ClusterFeatures, Desired
from tidepool.operator.cache import Key, PodInfo
from tidepool.operator.observe import template_hash
from tidepool.operator.reconcile import Plan, contains

PAUSED_ANNOTATION = "tidepool.dev/paused"
PAUSED = "Paused"
QUEUED = "RolloutQueued"
MAX_NAMED = 3  # services named in a queued message
NOT_STALLED = frozenset({"AdapterLoadFailed"})  # Degraded reasons that leave the rollout itself going


def is_paused(meta: Mapping[str, Any]) -> bool:
    """The pause annotation says exactly "true" (as Kubernetes' boolean annotations do)."""
    return (meta.get("annotations") or {}).get(PAUSED_ANNOTATION) == "true"


# ---- operator defaults -------------------------------------------------------------------------------
def defaults_of(features: ClusterFeatures) -> OperatorDefaults:
    """The operator's image defaults as configured now (what a service is built with when it may roll)."""
    return OperatorDefaults(
        engine_image=features.engine_image,
        router_image=features.router_image,
        hf_download_image=features.hf_download_image,
        s3_download_image=features.s3_download_image,
    )


def with_defaults(features: ClusterFeatures, recorded: OperatorDefaults) -> ClusterFeatures:
    """`features` with the image defaults a service was last rolled out with."""
    return dataclasses.replace(
        features,
        engine_image=recorded.engine_image or features.engine_image,
        router_image=recorded.router_image,
        hf_download_image=recorded.hf_download_image,
        s3_download_image=recorded.s3_download_image or features.s3_download_image,
    )


# ---- what a plan changes -------------------------------------------------------------------------------
def _template_path(kind: str) -> tuple[str, ...]:
    return ("spec", "leaderWorkerTemplate") if kind == "LeaderWorkerSet" else ("spec", "template")


def _get(obj: Mapping[str, Any], path: Sequence[str]) -> Any:
    for part in path:
        obj = (obj or {}).get(part) or {}
    return obj


def _hash(obj: Mapping[str, Any]) -> str | None:
    """The pod template's spec hash (what its pods carry; the router's workload itself has no such label)."""
    return template_hash(obj)


def _pool(obj: Mapping[str, Any]) -> str:
    return (obj["metadata"].get("labels") or {}).get(LABEL_POOL, "")


def _is_workload(obj: Mapping[str, Any]) -> bool:
    return obj["kind"] in WORKLOAD_KINDS


def changed_templates(todo: Plan, observed: Mapping[ChildKey, Mapping[str, Any]]) -> list[ChildKey]:
    """Existing workloads whose pod template the plan changes (their spec-hash label differs)."""
    out = []
    for obj in todo.apply:
        key = (obj["kind"], obj["metadata"]["name"])
        old = observed.get(key)
        if _is_workload(obj) and old is not None and _hash(old) != _hash(obj):
            out.append(key)
    return out


def is_rollout(todo: Plan, observed: Mapping[ChildKey, Mapping[str, Any]]) -> bool:
    """Does carrying out `todo` replace running pods? Never for a service with no workloads yet."""
    if not any(_is_workload(o) for o in observed.values()):
        return False
    return bool(changed_templates(todo, observed)) or any(_is_workload(o) for o in todo.deferred)


def hold(todo: Plan, observed: Mapping[ChildKey, Mapping[str, Any]]) -> Plan:
    """`todo` without its rollout: a changed workload keeps its running template (and its other fields
    follow the spec: replicas scale), a pool with a held workload gets no new workloads (StatefulSet
    groups), a replacement pool is not created and nothing waiting for it is pruned."""
    held_pools = set()
    apply: list[dict[str, Any]] = []
    for obj in todo.apply:
        key = (obj["kind"], obj["metadata"]["name"])
        old = observed.get(key)
        if not _is_workload(obj) or old is None or _hash(old) == _hash(obj):
            apply.append(obj)
            continue
        held_pools.add(_pool(obj))
        pinned = copy.deepcopy(obj)
        path = _template_path(obj["kind"])
        _get(pinned, path[:-1])[path[-1]] = copy.deepcopy(_get(old, path))
        if obj["kind"] == "StatefulSet":  # a group's size is its pods per replica: part of the template
            pinned["spec"]["replicas"] = old["spec"].get("replicas", pinned["spec"]["replicas"])
        labels = pinned["metadata"].get("labels") or {}
        if LABEL_SPEC_HASH in labels:
            labels[LABEL_SPEC_HASH] = (old["metadata"].get("labels") or {}).get(LABEL_SPEC_HASH, _hash(old))
        if not contains(old, pinned):
            apply.append(pinned)
    replacing = any(_is_workload(o) for o in todo.deferred)
    kept = [
        o
        for o in apply
        if not (_is_workload(o) and (o["kind"], o["metadata"]["name"]) not in observed and (
            replacing or _pool(o) in held_pools
        ))
    ]  # fmt: skip
    keys = [(o["kind"], o["metadata"]["name"]) for o in kept]
    dropped = [(o["kind"], o["metadata"]["name"]) for o in todo.apply if (o["kind"], o["metadata"]["name"]) not in keys]
    events = [
        e
        for e in todo.events
        if e[1] not in ("RollingOut", "Created") and not any(e[2].startswith(f"{k} {n}:") for k, n in dropped)
    ]
    created = [f"{k}/{n}" for k, n in keys if (k, n) not in observed]
    if created:  # as plan() tells it, less what waits
        events.insert(0, ("Normal", "Created", f"created {len(created)} children: {', '.join(created)}"))
    return dataclasses.replace(todo, apply=kept, deferred=[], events=events, held_router=False)


# ---- what the cluster shows ---------------------------------------------------------------------------
def target(desired: Desired) -> tuple[tuple[str, str, tuple[ChildKey, ...]], ...]:
    """What a rollout converges to: each pool's (and the router's) template hash and workloads."""
    layouts = [*desired.pools, *([desired.router] if desired.router else [])]
    return tuple((p.name, p.spec_hash, p.workloads) for p in layouts)


def is_mid_rollout(workloads: Mapping[ChildKey, Mapping[str, Any]], pods: Sequence[PodInfo]) -> bool:
    """Pods of a template none of their pool's workloads carries are still running (or a workload's template
    changed and its controller has not replaced them yet)."""
    hashes: dict[str, set[str | None]] = {}
    for obj in workloads.values():
        hashes.setdefault(_pool(obj), set()).add(_hash(obj))
    return any(p.pool in hashes and p.spec_hash not in hashes[p.pool] for p in pods if not p.is_terminating)


def is_settled(obj: Mapping[str, Any]) -> bool:
    """The workload's controller reports its current spec done: seen, every replica updated and ready."""
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    seen, generation = int(status.get("observedGeneration", 0)), int(obj["metadata"].get("generation", 1))
    if obj["kind"] != "LeaderWorkerSet" and seen < generation:  # LWS has no status.observedGeneration
        return False
    if obj["kind"] == "StatefulSet" and status.get("currentRevision") != status.get("updateRevision"):
        return False
    want = int(spec.get("replicas", 1))
    return all(int(status.get(f, 0) or 0) == want for f in ("replicas", "updatedReplicas", "readyReplicas"))


# ---- the budget ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Admission:
    """May a service start its rollout now? If not, the Progressing condition's reason and message."""

    go: bool
    message: str = ""
    newly_queued: bool = False  # it just joined the queue (worth an Event)


@dataclass(slots=True)
class RolloutBudget:
    """Which services roll out now and which wait (FIFO). `limit` 0: no limit, nothing is tracked."""

    limit: int
    rolling: dict[Key, float] = field(default_factory=dict)  # key -> since (the caller's clock)
    waiting: dict[Key, float] = field(default_factory=dict)  # in arrival order -> since
    spent: dict[Key, Any] = field(default_factory=dict)  # key -> target whose slot it gave up (stalled)
    unobserved: set[Key] | None = None  # None: not started; else services not yet observed since start

    @property
    def is_started(self) -> bool:
        return self.unobserved is not None

    def start(self, keys: Iterable[Key]) -> None:
        """The services the caches hold at start: none is granted a slot until all were observed once."""
        self.unobserved = set(keys)

    def admit(self, key: Key, goal: Any, now: float) -> Admission:
        """A service wants to start a rollout to `goal`: a slot now, or its place in the queue."""
        if self.limit <= 0 or key in self.rolling or self.spent.get(key) == goal:
            return Admission(True)
        is_new = key not in self.waiting
        self.waiting.setdefault(key, now)
        position = list(self.waiting).index(key)
        if not self.unobserved and position < self.limit - len(self.rolling):
            del self.waiting[key]
            self.spent.pop(key, None)
            self.rolling[key] = now
            return Admission(True)
        if self.unobserved:
            reason = f"the operator has not yet seen whether {len(self.unobserved)} services are mid-rollout"
        else:
            names = ", ".join(f"{ns}/{name}" for ns, name in list(self.rolling)[:MAX_NAMED])
            more = f" and {len(self.rolling) - MAX_NAMED} more" if len(self.rolling) > MAX_NAMED else ""
            reason = f"rolling out now: {names}{more}; {position} queued ahead of this one"
        message = (
            f"waiting for a rollout slot (at most {self.limit} services roll out at once: the operator's "
            f"--max-concurrent-rollouts); {reason}"
        )
        return Admission(False, message, is_new)

    def withdraw(self, key: Key) -> list[Key]:
        """The service no longer wants a rollout (spec reverted, paused): it leaves the queue."""
        self.waiting.pop(key, None)
        return self.wakeable()

    def observe(self, key: Key, goal: Any, in_flight: bool, finished: bool, stalled: bool, now: float) -> list[Key]:
        """What a sync of `key` saw; returns the waiting services a freed slot lets start (to wake)."""
        if self.unobserved is not None:
            self.unobserved.discard(key)
        if self.limit <= 0:
            return []
        if key in self.rolling:
            if finished or stalled:
                del self.rolling[key]
                if stalled and not finished:
                    self.spent[key] = goal
        elif in_flight and self.spent.get(key) != goal:
            self.rolling[key] = now  # rolling already (found after a restart): counted, even over the limit
            self.waiting.pop(key, None)
        return self.wakeable()

    def forget(self, key: Key) -> list[Key]:
        """The service is gone."""
        self.rolling.pop(key, None)
        self.waiting.pop(key, None)
        self.spent.pop(key, None)
        if self.unobserved is not None:
            self.unobserved.discard(key)
        return self.wakeable()

    def wakeable(self) -> list[Key]:
        """The waiting services the free slots let start, first come first."""
        if self.limit <= 0 or self.unobserved or self.unobserved is None:
            return []
        free = self.limit - len(self.rolling)
        return list(self.waiting)[: max(free, 0)]


# ---- one reconcile's steering (sync.py calls these around its plan) -----------------------------------------
Planner = Callable[[ClusterFeatures], tuple[Desired, Plan]]  # the builders and plan() for some features
Held = tuple[ConditionStatus, str, str]  # Progressing's (status, reason, message) while held


@dataclass(slots=True)
class Steering:
    """What one full reconcile carries out, after pause and the budget had their say."""

    desired: Desired
    plan: Plan
    defaults: OperatorDefaults | None  # to record in status.operatorDefaults (None: keep what is recorded)
    held: Held | None = None  # paused or queued: Progressing (and a True Reconciling) say so
    is_paused: bool = False  # nothing is carried out at all
    is_applied: bool = True  # every change of this generation is carried out (observedGeneration may move)
    wake: list[Key] = field(default_factory=list)  # waiting services a freed queue place lets start


def _pending(todo: Plan) -> list[str]:
    changed = [*todo.apply, *todo.prune, *todo.deferred]
    return sorted({f"{o['kind']}/{o['metadata']['name']}" for o in changed})


def steer(
    key: Key,
    meta: Mapping[str, Any],
    recorded: OperatorDefaults | None,
    features: ClusterFeatures,
    observed: Mapping[ChildKey, Mapping[str, Any]],
    planned: Planner,
    budget: RolloutBudget,
    now: float,
) -> Steering:
    """Plan with the operator's current defaults; then hold everything (paused), or hold the rollout part when
    the budget has no slot for it (queued: planned again with the service's recorded defaults first)."""
    current = defaults_of(features)
    desired, todo = planned(features)
    if is_paused(meta):
        pending = _pending(todo)
        waiting = f"{len(pending)} changes wait: {', '.join(pending[:5])}" if pending else "nothing to change"
        message = f"paused by the {PAUSED_ANNOTATION} annotation ({waiting}); remove it to resume"
        held: Held = ("Unknown", PAUSED, message)
        return Steering(desired, Plan(), recorded, held, True, not pending, budget.withdraw(key))
    if not is_rollout(todo, observed):
        return Steering(desired, todo, current, wake=budget.withdraw(key))
    admission = budget.admit(key, target(desired), now)
    if admission.go:
        return Steering(desired, todo, current)
    if recorded is not None and recorded != current:  # an operator upgrade reaches this service only with a slot
        desired, todo = planned(with_defaults(features, recorded))
    spec_rolls = is_rollout(todo, observed)  # False: only the operator's defaults wait; the spec itself is applied
    if spec_rolls:
        todo = hold(todo, observed)
    if admission.newly_queued:
        todo.events.insert(0, ("Normal", QUEUED, admission.message))
    return Steering(desired, todo, recorded, ("True", QUEUED, admission.message), is_applied=not spec_rolls)


def observed_rollout(
    budget: RolloutBudget,
    key: Key,
    desired: Desired,
    workloads: Mapping[ChildKey, Mapping[str, Any]],
    pods: Sequence[PodInfo],
    is_replacing: bool,
    status: InferenceServiceStatus,
    now: float,
) -> list[Key]:
    """Tell the budget what a sync saw (`is_replacing`: make-before-break leftovers still wait); returns the
    waiting services to wake."""
    in_flight = is_replacing or is_mid_rollout(workloads, pods)
    finished = not in_flight and all(is_settled(w) for w in workloads.values())
    degraded = status.condition("Degraded")
    stalled = degraded is not None and degraded.status == "True" and degraded.reason not in NOT_STALLED
    return budget.observe(key, target(desired), in_flight, finished, stalled, now)


def show_held(
    status: InferenceServiceStatus, held: Held, before: Condition | None, now: str
) -> list[tuple[str, str, str]]:
    """Progressing says the service is paused or queued (and so does Reconciling where it is True: kstatus reads
    work still to do); the Paused Event when it just became so (RolloutQueued's is the plan's, told once)."""
    value, reason, message = held
    progressing = status.condition("Progressing")  # computed for the current generation by build_status
    generation = progressing.observed_generation if progressing else status.observed_generation
    status.set_condition("Progressing", value, reason, message, generation, now)
    reconciling = status.condition("Reconciling")
    if reconciling is not None and reconciling.status == "True":
        status.set_condition("Reconciling", "True", reason, message, reconciling.observed_generation, now)
    if reason == PAUSED and (before is None or before.reason != PAUSED):
        return [("Normal", PAUSED, message)]
    return []
