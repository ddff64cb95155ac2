"""One InferenceService's reconcile: desire -> plan -> apply -> observe -> prune -> status.

desire: `desire()` validates the spec and runs the pure builders into `Desired` (children and each
        pool's `PoolLayout`); replicas come from the autoscaler's decision in status when it acts.
plan:   `plan()` (pure) compares the desired children with the observed ones from the caches: a
        child is applied when missing or when any field the operator sets differs (hand edits
        included; quantities compared by value, so `500m` == `0.5`). A cache claim is planned as
        claims.py says (what Kubernetes cannot change is kept; a claim several services name is
        shared, and released rather than deleted while others own it). An owned child no longer
        desired is pruned at once, except make-before-break: children of a pool being replaced
        (mode switch, a Deployment becoming StatefulSet groups or back) stay until every new pool
        serves.
apply:  server-side apply with one field manager (`tidepool-operator`, force), config and RBAC
        before Services and workloads; the answers are written through to the cache.
status: `observe()` counts replicas from the cached pods and workloads; `write_status()` merge-patches
        the status subresource with the resourceVersion the status was computed from, only when it
        changed (a 409 means somebody wrote in between: the caller retries from fresh state).

No sleeps, no module-level state; the clock comes in as `now`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tidepool.operator.api import API_VERSION, KIND, POOL_NAMES, InferenceService, InferenceServiceStatus, validate_spec
from tidepool.operator.api.quantity import same_quantity
from tidepool.operator.builders import (
    KIND_ORDER,
    LABEL_POOL,
    LABEL_SPEC_HASH,
    SCALED_POOL,
    ClusterFeatures,
    ServiceView,
    SpecError,
    build_children,
    desired_replicas,
    pod_selector,
    router_url,
)
from tidepool.operator.cache import PodInfo
from tidepool.operator.claims import claim_as_it_can_be, released_claim, shared_claim
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.status import PoolLayout, PoolObservation, observe_pool, pods_per_replica, template_hash

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")
LEGACY_FINALIZER = "tidepool.dev/finalizer"  # kopf's, from operators before the watch-driven controller
LEGACY_ANNOTATIONS = tuple(
    f"tidepool.dev/{k}" for k in ("last-handled-configuration", "create", "update", "resume", "resync", "autoscale")
)
QUANTITY_MAPS = ("requests", "limits")  # container resources, PVC storage: every value is a quantity
ROUTER = "router"
ChildKey = tuple[str, str]  # (kind, name)


@dataclass(slots=True)
class Desired:
    """What the builders want for one generation of one InferenceService."""

    children: list[dict[str, Any]]
    pools: list[PoolLayout]
    router: PoolLayout | None
    url: str
    selector: str
    scaled_pool: str


@dataclass(slots=True)
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    prune: list[dict[str, Any]] = field(default_factory=list)  # delete now
    deferred: list[dict[str, Any]] = field(default_factory=list)  # delete once the new pools serve
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (Normal|Warning, reason, message)


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid, "controller": True}


def desire(body: Mapping[str, Any], features: ClusterFeatures, replicas: Mapping[str, int] | None) -> Desired:
    """The desired children and pool layouts; raises SpecError / ValidationError for a spec that cannot work."""
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    spec, _ = InferenceService.from_body(body)
    problems = validate_spec(spec, name)
    if problems:
        raise SpecError("; ".join(problems))
    view = ServiceView.from_spec(spec.to_wire())
    children = build_children(name, namespace, view, features, replicas, owner_reference(name, uid))
    counts = desired_replicas(view, replicas)
    pools = []
    for pool in view.pool_names:
        workloads = [c for c in children if c["kind"] in WORKLOAD_KINDS and c["metadata"]["labels"][LABEL_POOL] == pool]
        floor = min(counts[pool], max(1, view.pools[pool].min_replicas))
        pools.append(
            PoolLayout(
                name=pool,
                desired=counts[pool],
                floor=floor,
                spec_hash=(template_hash(workloads[0]) or "") if workloads else "",
                workloads=tuple((w["kind"], w["metadata"]["name"]) for w in workloads),
                pods_per_replica=pods_per_replica(workloads[0]) if workloads else 1,
            )
        )
    router_obj = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == f"{name}-router")
    router = PoolLayout(
        name=ROUTER,
        desired=view.router.replicas,
        floor=min(view.router.replicas, 1),
        spec_hash=template_hash(router_obj) or "",
        workloads=(("Deployment", router_obj["metadata"]["name"]),),
    )
    url = (
        router_url(name, namespace)
        if view.router.replicas
        else f"http://{name}-{view.pool_names[-1]}.{namespace}.svc:8000"
    )
    return Desired(children, pools, router, url, pod_selector(name, view), SCALED_POOL[view.mode])


def spec_problem(body: Mapping[str, Any], features: ClusterFeatures, replicas: Mapping[str, int] | None) -> str:
    """The message of a spec `desire()` refuses ("" when it builds)."""
    try:
        desire(body, features, replicas)
    except (ValidationError, SpecError) as exc:
        return str(exc).replace("\n", " ")
    return ""


def contains(observed: Any, desired: Any, quantities: bool = False) -> bool:
    """True when every field of `desired` has the same value in `observed` (server defaults are ignored).

    Under `resources.requests`/`limits` (and `sizeLimit`) values are quantities, compared by amount."""
    if isinstance(desired, dict):
        return isinstance(observed, dict) and all(
            k in observed and contains(observed[k], v, quantities or k == "sizeLimit" or k in QUANTITY_MAPS)
            for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(observed) == len(desired)
            and all(contains(o, d) for o, d in zip(observed, desired, strict=True))
        )
    if isinstance(desired, bool) or isinstance(observed, bool):
        return observed is desired
    if observed == desired or str(observed) == str(desired):
        return True
    return quantities and same_quantity(observed, desired)


def _key(obj: Mapping[str, Any]) -> ChildKey:
    return obj["kind"], obj["metadata"]["name"]


def _replaced(obj: Mapping[str, Any], kind_of_pool: Mapping[str, str]) -> bool:
    """A stale child of a pool whose workloads are being replaced, not merely scaled down."""
    pool = (obj["metadata"].get("labels") or {}).get(LABEL_POOL)
    if pool not in POOL_NAMES:
        return False  # not part of an engine pool (router, config, cache claim, monitor)
    if pool not in kind_of_pool:
        return True  # the mode changed: the whole old pool goes, once the new pools serve
    return not (obj["kind"] == "StatefulSet" == kind_of_pool[pool])  # same-kind groups: a scale-down


def plan(desired: Sequence[dict[str, Any]], observed: Mapping[ChildKey, Mapping[str, Any]], uid: str = "") -> Plan:
    """What to apply and prune, and the Events worth telling the user. Pure. `uid`: the service's own, so that
    a cache claim other services still own is released, not deleted."""
    out = Plan()
    wanted = {_key(d) for d in desired}
    created = []
    for obj in desired:
        old = observed.get(_key(obj))
        if old is not None and obj["kind"] == "PersistentVolumeClaim":
            obj, kept = claim_as_it_can_be(shared_claim(obj, old), old)
            if kept:
                out.events.append(
                    (
                        "Warning",
                        "ClaimKept",
                        f"PersistentVolumeClaim {obj['metadata']['name']} keeps {'; '.join(kept)}; to change it, "
                        "delete the claim (its data goes with it) or use another claimName",
                    )
                )
        if old is not None and contains(old, obj):
            continue
        out.apply.append(obj)
        kind, name = _key(obj)
        if old is None:
            created.append(f"{kind}/{name}")
            continue
        if kind in WORKLOAD_KINDS:
            before, after = old["spec"].get("replicas"), obj["spec"].get("replicas")
            if before != after:
                out.events.append(("Normal", "Scaled", f"{kind} {name}: replicas {before} -> {after}"))
            old_hash = (old["metadata"].get("labels") or {}).get(LABEL_SPEC_HASH)
            new_hash = obj["metadata"]["labels"].get(LABEL_SPEC_HASH)
            if old_hash != new_hash:
                out.events.append(("Normal", "RollingOut", f"{kind} {name}: spec hash {old_hash} -> {new_hash}"))
                continue
        if not any(e[2].startswith(f"{kind} {name}:") for e in out.events):
            out.events.append(("Normal", "DriftCorrected", f"{kind} {name} differed from the spec; re-applied"))
    if created:
        out.events.insert(0, ("Normal", "Created", f"created {len(created)} children: {', '.join(created)}"))
    kind_of_pool = {
        d["metadata"]["labels"].get(LABEL_POOL, ""): d["kind"] for d in desired if d["kind"] in WORKLOAD_KINDS
    }
    for key, obj in sorted(observed.items(), key=lambda kv: (KIND_ORDER.index(kv[0][0]), kv[0][1])):
        if key not in wanted:
            release = released_claim(obj, uid) if key[0] == "PersistentVolumeClaim" else None
            if release is not None:
                out.apply.append(release)
                out.events.append(
                    (
                        "Normal",
                        "ClaimReleased",
                        f"PersistentVolumeClaim {key[1]}: still used by "
                        "other InferenceServices; this one's reference removed, the claim kept",
                    )
                )
            else:
                (out.deferred if _replaced(obj, kind_of_pool) else out.prune).append(dict(obj))
    return out


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
                workloads=tuple(_key(w) for w in workloads),
                pods_per_replica=pods_per_replica(first),
            )
        )
    return layouts


def hold_router(
    todo: Plan, desired: Desired, observed: Mapping[ChildKey, Mapping[str, Any]], new_pools_serve: bool
) -> bool:
    """During a mode switch the router keeps routing to the old pools until the new ones serve: its update
    is taken out of `todo` (returns True when it was). A router that does not exist yet is created."""
    replacing = any(obj["kind"] in WORKLOAD_KINDS for obj in todo.deferred)
    if new_pools_serve or not replacing or desired.router is None:
        return False
    router = desired.router.workloads[0]
    held = [o for o in todo.apply if _key(o) == router]
    if not held or router not in observed:
        return False
    todo.apply.remove(held[0])
    return True


def pruned_event(objs: Sequence[Mapping[str, Any]]) -> tuple[str, str, str]:
    names = ", ".join(f"{k}/{n}" for k, n in map(_key, objs))
    return ("Normal", "Pruned", f"deleted children no longer in the spec: {names}")


async def apply_all(client: KubeClient, objs: Sequence[dict[str, Any]]) -> tuple[dict[ChildKey, dict], str | None]:
    """Apply in two phases, each concurrently: a RoleBinding after its Role (the API server's escalation
    check reads the Role), workloads after the ServiceAccount their pods use (else the
    first pods are refused and the ReplicaSet backs off). Returns the answers and the first error."""
    results: dict[ChildKey, dict] = {}
    error = None
    later = {"RoleBinding", *WORKLOAD_KINDS}
    for phase in ([o for o in objs if o["kind"] not in later], [o for o in objs if o["kind"] in later]):
        answers = await asyncio.gather(*(client.apply(o) for o in phase), return_exceptions=True)
        for obj, answer in zip(phase, answers, strict=True):
            if isinstance(answer, ApiError) and answer.status not in (429, 500, 502, 503, 504):
                error = error or f"applying {obj['kind']} {obj['metadata']['name']}: {answer.message}"
            elif isinstance(answer, BaseException):
                raise answer  # transient: the caller retries with backoff
            else:
                answer["kind"] = obj["kind"]
                results[_key(obj)] = answer
    return results, error


def observe(
    desired: Desired, workloads: Mapping[ChildKey, Mapping[str, Any]], pods: Sequence[PodInfo]
) -> tuple[list[PoolObservation], PoolObservation | None]:
    pools = [observe_pool(layout, workloads, pods) for layout in desired.pools]
    router = observe_pool(desired.router, workloads, pods) if desired.router else None
    return pools, router


# The status fields reconcile owns; `autoscaling` belongs to the autoscaler and is never written here.
OWNED_STATUS_KEYS = ("observedGeneration", "conditions", "pools", "replicas", "selector", "url")


def status_patch(previous: InferenceServiceStatus, status: InferenceServiceStatus) -> dict[str, Any] | None:
    """The merge patch from `previous` to `status` over the fields reconcile owns; None when equal."""
    old = {k: v for k, v in previous.to_wire().items() if k in OWNED_STATUS_KEYS}
    new = {k: v for k, v in status.to_wire().items() if k in OWNED_STATUS_KEYS}
    if old == new:
        return None
    patch = dict(new)
    # A merge patch keeps map keys it does not mention: drop pools the spec no longer runs.
    for pool in old.get("pools", {}):
        if pool not in new.get("pools", {}):
            patch.setdefault("pools", {})[pool] = None
    for key in ("replicas", "selector", "url"):
        if key in old and key not in new:
            patch[key] = None
    return patch


def is_routine(previous: InferenceServiceStatus, status: InferenceServiceStatus) -> bool:
    """True when only counts and condition messages differ: the same observedGeneration, URL, selector
    and pools, and every condition with the same status, reason and observedGeneration. Such a change
    may wait a moment (it is paced); anything else is a transition and is written at once."""

    def shape(s: InferenceServiceStatus) -> tuple[Any, ...]:
        conditions = sorted((c.type, c.status, c.reason, c.observed_generation) for c in s.conditions)
        return s.observed_generation, s.url, s.selector, sorted(s.pools), conditions

    return shape(previous) == shape(status)


async def write_status(client: KubeClient, body: Mapping[str, Any], patch: dict[str, Any]) -> dict[str, Any] | None:
    """Patch status only if the object is still at the resourceVersion the status was computed from.

    Returns the updated object, or None when it was deleted meanwhile; raises ApiError(409) when
    somebody else wrote first."""
    meta = body["metadata"]
    try:
        return await client.patch_status(KIND, meta["namespace"], meta["name"], patch, meta.get("resourceVersion"))
    except ApiError as exc:
        if exc.status == 404:  # deleted meanwhile: nothing left to report on
            return None
        raise


async def drop_legacy_finalizer(client: KubeClient, body: Mapping[str, Any]) -> dict[str, Any]:
    """Remove the finalizer (and handler annotations) an older, kopf-handler operator left, so deleting
    the object never waits for an operator. Conditional on the resourceVersion; returns the new object."""
    meta = body["metadata"]
    patch: dict[str, Any] = {
        "metadata": {
            "resourceVersion": meta["resourceVersion"],
            "finalizers": [f for f in meta.get("finalizers") or [] if f != LEGACY_FINALIZER] or None,
        }
    }
    stale = [a for a in LEGACY_ANNOTATIONS if a in (meta.get("annotations") or {})]
    if stale:
        patch["metadata"]["annotations"] = dict.fromkeys(stale)
    return await client.patch_merge(KIND, meta["namespace"], meta["name"], patch)
