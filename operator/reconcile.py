"""One InferenceService's desired state, compared with what the caches hold, and carried out.

desire:  `desire()` runs the pure builders on the sync's one parsed spec (`ServiceView`) into `Desired`
         (children and each pool's `PoolLayout`); replicas come from the autoscaler's decision in
         status when it acts.
plan:    `plan()` (pure) compares the desired children with the observed ones from the caches: a
         child is applied when missing or when any field the operator sets differs (hand edits
         included; quantities compared by value, so `500m` == `0.5`). A cache claim is planned as
         claims.py says: created when absent (`Plan.claims`), applied only by the service that created
         it (what Kubernetes cannot change is kept), used as it is by any other, and never pruned (an
         owner reference an older operator left is taken away instead). An owned child no longer
         desired is pruned at once, except make-before-break: children of a pool being replaced
         (mode switch, a Deployment becoming StatefulSet groups or back) stay until every new pool
         serves, and so does the router's update (`Plan.hold_router`). A multi-node pool's control-key
         Secret is never compared nor applied: each full reconcile plans its creation (`Plan.create`).
execute: `Plan.execute(client, store, versions, owner)` creates the control-key Secrets, each with a
         fresh random key, keeping any that exists (AlreadyExists: the key never changes; nothing is read
         back), and the cache claims, using any that exists as it is (ClaimExists), then applies
         (server-side apply, one field manager `tidepool-operator`, force; config and RBAC before
         Services and workloads) and prunes; a RoleBinding whose roleRef changed (immutable: an older
         operator's, naming its own Role) is deleted first and created anew (`Plan.replace`); answers
         and deletions are written through to the cache and to the verified child versions.
         `Plan.prune_deferred(...)` deletes the make-before-break leftovers once the new pools serve.

No sleeps, no module-level state, no clock.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.operator.api import API_VERSION, KIND, POOL_NAMES, ServiceView
from tidepool.operator.api.quantity import same_quantity
from tidepool.operator.builders import (
    KIND_ORDER,
    LABEL_POOL,
    LABEL_SPEC_HASH,
    WORKLOAD_KINDS,
    ChildKey,
    ClusterFeatures,
    Desired,
    desired_state,
)
from tidepool.operator.builders.control_key import KEY_BYTES, SECRET_KIND, with_key
from tidepool.operator.cache import Store, compact
from tidepool.operator.claims import (
    CLAIM_KIND,
    claim_as_it_can_be,
    creator_of,
    is_created_by,
    reclaim_policy,
    released_claim,
    used_as_it_is,
)
from tidepool.operator.k8s import ApiError, KubeClient

QUANTITY_MAPS = ("requests", "limits")  # container resources, PVC storage: every value is a quantity
TRANSIENT_STATUSES = (429, 500, 502, 503, 504)  # raised: the caller retries with backoff
Event = tuple[str, str, str]  # (Normal|Warning, reason, message)


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid, "controller": True}


def desire(
    view: ServiceView,
    meta: Mapping[str, Any],
    features: ClusterFeatures,
    replicas: Mapping[str, int] | None,
    kinds: Mapping[str, str] | None = None,
) -> Desired:
    """The desired children and pool layouts of the object with metadata `meta`, owned by it; raises SpecError
    for a spec no cluster can run. `kinds`: each existing multi-node pool's workload kind, which it keeps."""
    name, namespace = meta["name"], meta["namespace"]
    owner = owner_reference(name, meta["uid"])
    return desired_state(name, namespace, view, features, replicas, owner, kinds, meta.get("labels"))


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


@dataclass(slots=True)
class Plan:
    """What one full reconcile changes, and the Events worth telling the user."""

    apply: list[dict[str, Any]] = field(default_factory=list)
    create: list[dict[str, Any]] = field(default_factory=list)  # create once, keep if it exists (control keys)
    claims: list[dict[str, Any]] = field(default_factory=list)  # cache claims to create; one that exists is not ours
    prune: list[dict[str, Any]] = field(default_factory=list)  # delete now
    replace: list[dict[str, Any]] = field(default_factory=list)  # delete before applying anew (immutable roleRef)
    deferred: list[dict[str, Any]] = field(default_factory=list)  # delete once the new pools serve
    events: list[Event] = field(default_factory=list)
    held_router: bool = False  # the router's update waits for the new pools (see hold_router)

    def hold_router(self, desired: Desired, observed: Mapping[ChildKey, Mapping[str, Any]], new_serve: bool) -> None:
        """During a mode switch the router keeps routing to the old pools until the new ones serve: its update
        is taken out of the plan (`held_router`). A router that does not exist yet is created."""
        replacing = any(obj["kind"] in WORKLOAD_KINDS for obj in self.deferred)
        if new_serve or not replacing or desired.router is None:
            return
        router = desired.router.workloads[0]
        held = [o for o in self.apply if _key(o) == router]
        if held and router in observed:
            self.apply.remove(held[0])
            self.held_router = True

    async def execute(
        self, client: KubeClient, store: Store, versions: dict[ChildKey, str], owner: tuple[str, str]
    ) -> tuple[dict[ChildKey, dict[str, Any]], str | None]:
        """Create the control keys (before the pods that mount them), apply, then prune what goes now. Answers
        and deletions are written through to `store`; `versions` gets the version of each child applied that
        `owner` (name, uid) owns, and loses each pruned one. Returns the answers and the first error the API
        server gave."""
        create_error = await create_once(client, self.create)
        created, claim_error = await create_claims(client, self.claims, store, self.events)
        await _delete(client, store, self.replace, versions)  # their new versions are in self.apply
        applied, error = await apply_all(client, self.apply)
        error = create_error or claim_error or error
        for child, obj in {**created, **applied}.items():
            store.put(obj)
            item = compact(obj)
            claim_of_mine = child[0] == CLAIM_KIND and is_created_by(obj, item.namespace, owner[0])
            if item.owner == owner[0] and (owner[1] in item.owner_uids or claim_of_mine):  # not another's claim
                versions[child] = item.version
        await _delete(client, store, self.prune, versions)
        return applied, error

    async def prune_deferred(self, client: KubeClient, store: Store, versions: dict[ChildKey, str]) -> Event:
        """Delete the children kept for make-before-break (once the new pools serve); the Pruned event."""
        pruned, self.deferred = self.deferred, []
        await _delete(client, store, pruned, versions)
        return pruned_event(pruned)


async def _delete(
    client: KubeClient, store: Store, objs: Sequence[Mapping[str, Any]], versions: dict[ChildKey, str]
) -> None:
    await asyncio.gather(*(client.delete(o) for o in objs))
    for obj in objs:
        store.delete({"kind": obj["kind"], "metadata": obj["metadata"]})
        versions.pop(_key(obj), None)


def plan(desired: Sequence[dict[str, Any]], observed: Mapping[ChildKey, Mapping[str, Any]], uid: str = "") -> Plan:
    """What to apply, create and prune, and the Events worth telling the user. Pure. `uid`: the service's own, so
    that an owner reference an older operator put on a cache claim is taken away, never followed by a delete."""
    out = Plan()
    wanted = {_key(d) for d in desired}
    created = []
    for obj in desired:
        if obj["kind"] == SECRET_KIND:  # never watched nor read: created once, the key kept (create_once)
            out.create.append(obj)
            continue
        old = observed.get(_key(obj))
        if obj["kind"] == CLAIM_KIND and old is None:
            out.claims.append(obj)  # created if still absent (create_claims): never applied over one that exists
            continue
        if old is not None and obj["kind"] == CLAIM_KIND:
            if creator_of(old) != creator_of(obj):  # not this service's: used as it is
                out.events.append(("Normal", "ClaimExists", used_as_it_is(_key(obj)[1], old)))
                release = released_claim(old, uid)
                if release is not None:
                    out.apply.append(release)
                continue
            obj, kept = claim_as_it_can_be(obj, old)
            if kept:
                out.events.append(
                    (
                        "Warning",
                        "ClaimKept",
                        f"PersistentVolumeClaim {obj['metadata']['name']} keeps {'; '.join(kept)}; to change it, "
                        "delete the claim (its data goes with it) or use another claimName",
                    )
                )
        if old is not None and obj["kind"] == "RoleBinding" and not contains(old.get("roleRef"), obj["roleRef"]):
            out.replace.append(dict(old))  # roleRef cannot change: deleted, then created (an older operator's Role)
            out.apply.append(obj)
            before, after = (f"{r.get('kind')}/{r.get('name')}" for r in (old.get("roleRef") or {}, obj["roleRef"]))
            out.events.append(("Normal", "Replaced", f"RoleBinding {_key(obj)[1]}: roleRef {before} -> {after}"))
            continue
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
        if key in wanted:
            continue
        if key[0] == CLAIM_KIND:  # never pruned: a cache claim goes only as claims.py says (sync.py's reclaim)
            release = released_claim(obj, uid)
            if release is not None:
                out.apply.append(release)
                out.events.append(
                    ("Normal", "ClaimReleased", f"PersistentVolumeClaim {key[1]}: this service's owner reference "
                     "(left by an older operator) removed; the claim is kept")
                )  # fmt: skip
            continue
        (out.deferred if _replaced(obj, kind_of_pool) else out.prune).append(dict(obj))
    return out


def pruned_event(objs: Sequence[Mapping[str, Any]]) -> Event:
    names = ", ".join(f"{k}/{n}" for k, n in map(_key, objs))
    return ("Normal", "Pruned", f"deleted children no longer in the spec: {names}")


async def apply_all(client: KubeClient, objs: Sequence[dict[str, Any]]) -> tuple[dict[ChildKey, dict], str | None]:
    """Apply in two phases, each concurrently: workloads after the ServiceAccount their pods use (else the
    first pods are refused and the ReplicaSet backs off). A RoleBinding names a chart-shipped ClusterRole the
    operator may `bind`, so it needs nothing applied before it. Returns the answers and the first error."""
    results: dict[ChildKey, dict] = {}
    error = None
    later = set(WORKLOAD_KINDS)
    for phase in ([o for o in objs if o["kind"] not in later], [o for o in objs if o["kind"] in later]):
        answers = await asyncio.gather(*(client.apply(o) for o in phase), return_exceptions=True)
        for obj, answer in zip(phase, answers, strict=True):
            if isinstance(answer, ApiError) and answer.status not in TRANSIENT_STATUSES:
                error = error or f"applying {obj['kind']} {obj['metadata']['name']}: {answer.message}"
            elif isinstance(answer, BaseException):
                raise answer  # transient: the caller retries with backoff
            else:
                answer["kind"] = obj["kind"]
                results[_key(obj)] = answer
    return results, error


async def create_once(client: KubeClient, objs: Sequence[dict[str, Any]]) -> str | None:
    """Create each Secret with a fresh random key (drawn here, never by the builders); one that exists is kept as
    it is (409 AlreadyExists), so a key never changes under the ranks that read it. Returns the first error the
    API server gave; a transient one raises (the caller retries with backoff)."""
    keyed = [with_key(obj, secrets.token_urlsafe(KEY_BYTES)) for obj in objs]
    answers = await asyncio.gather(*(client.create(obj) for obj in keyed), return_exceptions=True)
    error = None
    for obj, answer in zip(objs, answers, strict=True):
        if isinstance(answer, ApiError) and answer.status == 409:
            continue
        if isinstance(answer, ApiError) and answer.status not in TRANSIENT_STATUSES:
            error = error or f"creating {obj['kind']} {obj['metadata']['name']}: {answer.message}"
        elif isinstance(answer, BaseException):
            raise answer
    return error


async def create_claims(
    client: KubeClient, objs: Sequence[dict[str, Any]], store: Store, events: list[Event]
) -> tuple[dict[ChildKey, dict[str, Any]], str | None]:
    """Create each cache claim that did not exist when planned; one that exists now (409 AlreadyExists) is used as
    it is, never adopted (`events` gets ClaimExists; ClaimCreated for each one created). Returns the created
    claims and the first error the API server gave; a transient one raises (the caller retries with backoff)."""
    answers = await asyncio.gather(*(client.create(obj) for obj in objs), return_exceptions=True)
    created: dict[ChildKey, dict[str, Any]] = {}
    error = None
    for obj, answer in zip(objs, answers, strict=True):
        kind, name = _key(obj)
        if isinstance(answer, ApiError) and answer.status == 409:
            found = store.find(kind, obj["metadata"]["namespace"], name)
            existing = found.body() if found is not None else None
            if existing is None or creator_of(existing) != creator_of(obj):  # else: its own, seen late by the caches
                events.append(("Normal", "ClaimExists", used_as_it_is(name, existing)))
        elif isinstance(answer, ApiError) and answer.status not in TRANSIENT_STATUSES:
            error = error or f"creating {kind} {name}: {answer.message}"
        elif isinstance(answer, BaseException):
            raise answer
        else:
            answer["kind"] = kind
            created[(kind, name)] = answer
            message = f"PersistentVolumeClaim {name} created (reclaimPolicy {reclaim_policy(obj)})"
            events.append(("Normal", "ClaimCreated", message))
    return created, error
