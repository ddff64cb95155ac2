"""One idempotent reconcile of an InferenceService: read -> plan -> apply -> status.

read:   the object (from kopf) and its children (one labelled list per managed kind, filtered to
        those owned by this object's uid).
plan:   `plan()` (pure) compares the builders' desired children with the observed ones: a child
        is applied when missing or when any field the operator sets differs (hand edits included);
        an owned child that is no longer desired (mode switch, fewer StatefulSet groups) is pruned.
apply:  server-side apply with one field manager (`tidepool-operator`, force), config and RBAC
        before Services and workloads; prunes use the child's uid as a precondition.
status: pool counts and conditions from the workloads the API server returned, pod problems only
        when something is not ready; written as a merge patch of the status subresource, and
        only when it changed.

Create, update, resume and the resync timer all call `reconcile()`; a status change of a child
workload calls it with `status_only=True` (read workloads, write status). The autoscaler's seam is
`replicas_override` (replicas per pool) and `scaling_limit` (a ScalingLimited reason/message).
No sleeps, no module-level state; the clock comes in as `now`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tidepool.operator.api import API_VERSION, KIND, InferenceService, InferenceServiceStatus, validate_spec
from tidepool.operator.builders import (
    KIND_ORDER,
    LABEL_POOL,
    LABEL_SERVICE,
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
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.status import Outcome, PoolObservation, build_status, observe_pool, pod_problems

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


@dataclass(slots=True)
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    prune: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (Normal|Warning, reason, message)


@dataclass(slots=True)
class ReconcileResult:
    status: InferenceServiceStatus
    ready: bool
    events: list[tuple[str, str, str]]
    applied: list[str]
    pruned: list[str]
    permanent_error: str | None = None
    apply_error: str | None = None


def managed_kinds(features: ClusterFeatures) -> tuple[str, ...]:
    skip = {"LeaderWorkerSet"} if not features.has_lws else set()
    if not features.has_service_monitor:
        skip.add("ServiceMonitor")
    return tuple(k for k in KIND_ORDER if k not in skip)


def contains(observed: Any, desired: Any) -> bool:
    """True when every field of `desired` has the same value in `observed` (server defaults are ignored)."""
    if isinstance(desired, dict):
        return isinstance(observed, dict) and all(
            k in observed and contains(observed[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(observed) == len(desired)
            and all(contains(o, d) for o, d in zip(observed, desired, strict=True))
        )
    if isinstance(desired, bool) or isinstance(observed, bool):
        return observed is desired
    return observed == desired or str(observed) == str(desired)


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def plan(desired: Sequence[dict[str, Any]], observed: Sequence[dict[str, Any]]) -> Plan:
    """What to apply and prune, and the Events worth telling the user. Pure."""
    out = Plan()
    seen = {_key(o): o for o in observed}
    wanted = {_key(d) for d in desired}
    created = []
    for obj in desired:
        old = seen.get(_key(obj))
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
            old_hash = old["metadata"].get("labels", {}).get(LABEL_SPEC_HASH)
            new_hash = obj["metadata"]["labels"].get(LABEL_SPEC_HASH)
            if old_hash != new_hash:
                out.events.append(("Normal", "RollingOut", f"{kind} {name}: spec hash {old_hash} -> {new_hash}"))
                continue
        if not any(e[2].startswith(f"{kind} {name}:") for e in out.events):
            out.events.append(("Normal", "DriftCorrected", f"{kind} {name} differed from the spec; re-applied"))
    if created:
        out.events.insert(0, ("Normal", "Created", f"created {len(created)} children: {', '.join(created)}"))
    out.prune = [o for o in observed if _key(o) not in wanted]
    if out.prune:
        names = ", ".join(f"{k}/{n}" for k, n in map(_key, out.prune))
        out.events.append(("Normal", "Pruned", f"deleted children no longer in the spec: {names}"))
    return out


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid, "controller": True}


async def _observe(client: KubeClient, namespace: str, name: str, uid: str, kinds: Sequence[str]) -> list[dict]:
    selector = f"{LABEL_SERVICE}={name}"
    lists = await asyncio.gather(*(client.list(k, namespace, selector) for k in kinds))
    owned = []
    for items in lists:
        for item in items:
            if any(ref.get("uid") == uid for ref in item["metadata"].get("ownerReferences", [])):
                owned.append(item)
    return owned


async def _apply_all(
    client: KubeClient, objs: Sequence[dict[str, Any]]
) -> tuple[dict[tuple[str, str], dict], str | None]:
    """Apply in phases, each concurrently: a RoleBinding after its Role (the API server's escalation check
    reads the Role), workloads after what they reference. Returns the results and the first error."""
    results: dict[tuple[str, str], dict] = {}
    error = None
    later = {"RoleBinding", *WORKLOAD_KINDS}
    for phase in (
        [o for o in objs if o["kind"] not in later],
        [o for o in objs if o["kind"] == "RoleBinding"],
        [o for o in objs if o["kind"] in WORKLOAD_KINDS],
    ):
        answers = await asyncio.gather(*(client.apply(o) for o in phase), return_exceptions=True)
        for obj, answer in zip(phase, answers, strict=True):
            if isinstance(answer, ApiError):
                error = error or f"applying {obj['kind']} {obj['metadata']['name']}: {answer.message}"
            elif isinstance(answer, BaseException):
                raise answer
            else:
                answer.setdefault("kind", obj["kind"])
                results[_key(obj)] = answer
    return results, error


async def reconcile(
    client: KubeClient,
    body: Mapping[str, Any],
    features: ClusterFeatures,
    now: str,
    replicas_override: Mapping[str, int] | None = None,
    scaling_limit: tuple[str, str] | None = None,
    status_only: bool = False,
) -> ReconcileResult:
    """Reconcile one InferenceService body. `status_only` reads only the workloads and writes status
    (no apply, no prune): the cheap path taken when a child workload reports a status change."""
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    generation = int(meta.get("generation", 1))
    previous = InferenceServiceStatus.model_validate(dict(body.get("status") or {}))
    try:
        spec, _ = InferenceService.from_body(body)
        problems = validate_spec(spec, name)
        if problems:
            raise SpecError("; ".join(problems))
        view = ServiceView.from_spec(spec.to_wire())
        desired = build_children(name, namespace, view, features, replicas_override, owner_reference(name, uid))
    except (ValidationError, SpecError) as exc:
        message = str(exc).replace("\n", " ")
        status = build_status(previous, generation, [], None, Outcome(spec_error=message), None, None, None, now)
        await _write_status(client, namespace, name, previous, status)
        return ReconcileResult(status, False, [("Warning", "InvalidSpec", message)], [], [], permanent_error=message)

    if status_only:
        kinds = tuple(k for k in managed_kinds(features) if k in WORKLOAD_KINDS)
        observed = await _observe(client, namespace, name, uid, kinds)
        todo, applied, apply_error = Plan(), {}, None
    else:
        observed = await _observe(client, namespace, name, uid, managed_kinds(features))
        todo = plan(desired, observed)
        applied, apply_error = await _apply_all(client, todo.apply)
        await asyncio.gather(*(client.delete(o) for o in todo.prune))

    current = {_key(o): o for o in observed}
    current.update(applied)
    replicas = desired_replicas(view, replicas_override)
    pools: list[PoolObservation] = []
    for pool in view.pool_names:
        workloads = [
            current[_key(d)]
            for d in desired
            if d["kind"] in WORKLOAD_KINDS and d["metadata"]["labels"].get(LABEL_POOL) == pool and _key(d) in current
        ]
        pools.append(observe_pool(pool, replicas[pool], workloads))
    router_obj = current.get(("Deployment", f"{name}-router"))
    router = observe_pool("router", view.router.replicas, [router_obj] if router_obj else [])
    outcome = Outcome(apply_error=apply_error, scaling_limit=scaling_limit)
    if not all(p.is_ready for p in [*pools, router]):
        pods = await client.list("Pod", namespace, f"{LABEL_SERVICE}={name}")
        pool_of = {p["metadata"]["name"]: p["metadata"].get("labels", {}).get(LABEL_POOL, "?") for p in pods}
        outcome.pod_problems = pod_problems(pool_of, pods)
    url = (
        router_url(name, namespace)
        if view.router.replicas
        else f"http://{name}-{view.pool_names[-1]}.{namespace}.svc:8000"
    )
    status = build_status(
        previous, generation, pools, router, outcome, url, pod_selector(name, view), SCALED_POOL[view.mode], now
    )
    await _write_status(client, namespace, name, previous, status)
    events = list(todo.events)
    if apply_error:
        events.append(("Warning", "ApplyFailed", apply_error))
    ready = status.condition("Ready") is not None and status.condition("Ready").status == "True"  # type: ignore[union-attr]
    return ReconcileResult(
        status=status,
        ready=ready,
        events=events,
        applied=[f"{k}/{n}" for k, n in map(_key, todo.apply)],
        pruned=[f"{k}/{n}" for k, n in map(_key, todo.prune)],
        apply_error=apply_error,
    )


# The status fields reconcile owns; `autoscaling` belongs to the autoscaler and is never written here.
OWNED_STATUS_KEYS = ("observedGeneration", "conditions", "pools", "replicas", "selector", "url")


async def _write_status(
    client: KubeClient, namespace: str, name: str, previous: InferenceServiceStatus, status: InferenceServiceStatus
) -> None:
    old = {k: v for k, v in previous.to_wire().items() if k in OWNED_STATUS_KEYS}
    new = {k: v for k, v in status.to_wire().items() if k in OWNED_STATUS_KEYS}
    if old == new:
        return
    patch = dict(new)
    # A merge patch keeps map keys it does not mention: drop pools the spec no longer runs.
    for pool in old.get("pools", {}):
        if pool not in new.get("pools", {}):
            patch.setdefault("pools", {})[pool] = None
    for key in ("replicas", "selector", "url"):
        if key in old and key not in new:
            patch[key] = None
    try:
        await client.patch_status(KIND, namespace, name, patch)
    except ApiError as exc:
        if exc.status != 404:  # deleted meanwhile: nothing left to report on
            raise
