"""Cache claims (`spec.modelCache.persistentVolumeClaim`): created, never adopted, never lost by accident.

Helpers without I/O for reconcile.plan() (the desired claim against the observed one), for the creation
outcome in `Plan.execute`, and for the reclaim sweep in sync.py (what the caches say goes now).

Invariants:
- Create, never adopt: a claim is created (POST) only when no claim of its name exists. The claim the
  operator created carries the annotations `tidepool.dev/created-by: <namespace>/<service>` and
  `tidepool.dev/reclaim-policy: Retain|Delete` (builders/network.py). Only its creator ever applies to it
  (a resize, a new policy); any other claim is used as it is: never patched, never given an owner reference,
  never deleted; an Event (ClaimExists) says so, once while it lasts.
- A cache claim has no owner reference, so the garbage collector never deletes it with a service. The operator
  deletes a claim only when (a) it created it, (b) its reclaim policy says Delete, (c) the service that created
  it is gone, and (d) no InferenceService in its namespace names it (modelCache, a pvc:// URI, a pod volume).
  It checks that whenever an InferenceService is gone (sync.py; also at start, since the claim's creator key is
  then synced), never because a field was removed or a spec changed. Why not a finalizer: deletes would wait on
  the operator (it removes finalizers older versions left), and (d) only the operator can judge; why not an
  owner reference from the creator: the garbage collector would delete the claim under the services still
  using it.
- Claims an older operator labelled without the annotations count as created by the service their label
  names; an owner reference it left is taken away by the service it names (released), so no upgrade turns
  into a deletion.
- What Kubernetes cannot change is never applied (the API server would refuse it at every reconcile, and the
  rest of the spec would not roll out): a claim is resized only when bound, only upwards and only past what
  its volume already holds; accessModes, storageClassName and volumeMode are fixed at creation. What was
  kept is said (a ClaimKept Warning, once while it lasts: sync.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tidepool.operator.api.quantity import quantity_value
from tidepool.operator.builders import LABEL_SERVICE, MANAGED_BY
from tidepool.operator.builders.network import ANNOTATION_CREATED_BY, ANNOTATION_RECLAIM_POLICY
from tidepool.operator.cache import Cached, Store

CLAIM_KIND = "PersistentVolumeClaim"
CLAIM_FIXED_FIELDS = ("accessModes", "storageClassName", "volumeMode")  # immutable once a claim exists
DEFAULT_RECLAIM_POLICY = "Retain"  # a claim without the annotation (created by an older operator) is kept


def creator_of(claim: Mapping[str, Any]) -> str | None:
    """`<namespace>/<service>` of the InferenceService that created the claim; None when the operator did not."""
    meta = claim.get("metadata") or {}
    created_by = (meta.get("annotations") or {}).get(ANNOTATION_CREATED_BY)
    if created_by:
        return str(created_by)
    labels = meta.get("labels") or {}
    if labels.get("app.kubernetes.io/managed-by") == MANAGED_BY and labels.get(LABEL_SERVICE):
        return f"{meta.get('namespace', '')}/{labels[LABEL_SERVICE]}"  # labelled by an older operator
    return None


def reclaim_policy(claim: Mapping[str, Any]) -> str:
    annotations = (claim.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(ANNOTATION_RECLAIM_POLICY, DEFAULT_RECLAIM_POLICY))


def is_created_by(claim: Mapping[str, Any], namespace: str, name: str) -> bool:
    return creator_of(claim) == f"{namespace}/{name}"


def claim_as_it_can_be(desired: dict[str, Any], observed: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The desired claim with what the existing one cannot change kept as it is, and what was kept (for a Warning).

    Kubernetes resizes bound claims only, and only upwards (an expandable StorageClass may still refuse, which the
    apply then reports): a smaller size, or any size before the claim is bound, keeps the claim's own request; a
    larger one the bound volume already holds needs no resize. accessModes, storageClassName and volumeMode are
    fixed at creation."""
    spec, old = desired["spec"], observed.get("spec") or {}
    status = observed.get("status") or {}
    kept_spec, kept = copy.deepcopy(spec), []
    want = spec["resources"]["requests"]["storage"]
    have = ((old.get("resources") or {}).get("requests") or {}).get("storage")
    wanted, held = quantity_value(want), quantity_value(have) if have is not None else None
    if held is not None and wanted != held:
        capacity = (status.get("capacity") or {}).get("storage")
        room = max(held, quantity_value(capacity) if capacity else 0)
        bound = status.get("phase") == "Bound"
        if not (bound and wanted > room):
            kept_spec["resources"]["requests"]["storage"] = have
            if wanted < held:
                kept.append(f"its {have} (a claim cannot shrink to {want})")
            elif not bound:
                kept.append(
                    f"its {have} until it is bound (Kubernetes resizes bound claims only; the spec asks {want})"
                )
    for name in CLAIM_FIXED_FIELDS:
        if name in old and old[name] != spec.get(name):
            # Also when the spec leaves it out: the field manager that set it would otherwise remove it, which is
            # a change the API server refuses.
            kept_spec[name] = old[name]
            if name in spec:
                kept.append(f"{name} {old[name]} (fixed at creation; the spec asks {spec[name]})")
    changed = kept or kept_spec != spec
    return ({**desired, "spec": kept_spec} if changed else desired), kept


def used_as_it_is(name: str, existing: Mapping[str, Any] | None) -> str:
    """The ClaimExists message for a claim this service names with size but did not create (`existing`: the claim
    as the caches hold it; None when they do not, i.e. the operator did not create it)."""
    creator = creator_of(existing) if existing is not None else None
    if creator is None:
        whose = "exists and was not created by the operator: it is never changed, owned nor deleted by it"
    else:
        whose = (
            f"was created by InferenceService {creator} (reclaimPolicy {reclaim_policy(existing or {})}); "
            "its size, class, access modes and reclaim policy are that service's"
        )
    return (
        f"PersistentVolumeClaim {name} {whose}; used as it is (this spec's size, storageClassName, accessModes "
        "and reclaimPolicy apply only to a claim it creates)"
    )


def released_claim(observed: Mapping[str, Any], uid: str) -> dict[str, Any] | None:
    """The apply that takes this service's owner reference (left by an older operator) off a claim, keeping the
    others and everything else as it is (the apply must not drop fields this field manager set). None when the
    claim names no such reference."""
    meta = observed["metadata"]
    refs = meta.get("ownerReferences") or []
    others = [r for r in refs if r.get("uid") != uid]
    if len(others) == len(refs):
        return None
    kept = {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta}
    if others:
        kept["ownerReferences"] = others
    return {"apiVersion": "v1", "kind": CLAIM_KIND, "metadata": kept, "spec": copy.deepcopy(observed.get("spec") or {})}


def with_shared_claims(
    observed: Mapping[tuple[str, str], dict[str, Any]],
    desired: Sequence[Mapping[str, Any]],
    find: Callable[[str, str], Mapping[str, Any] | None],
) -> dict[tuple[str, str], dict[str, Any]]:
    """`observed` plus each desired claim the caches hold under another service's label (`find(kind, name)`): the
    plan must see an existing claim as it is, never create it again nor take it over."""
    out = dict(observed)
    for child in desired:
        key = (child["kind"], child["metadata"]["name"])
        if child["kind"] == CLAIM_KIND and key not in out:
            found = find(*key)
            if found is not None:
                out[key] = dict(found)
    return out


def names_claim(spec: Any, claim: str) -> bool:
    """True when an InferenceService spec mounts the claim anywhere: modelCache, a pod volume (`claimName`), or a
    pvc:// model or adapter URI."""
    if isinstance(spec, Mapping):
        return spec.get("claimName") == claim or any(names_claim(v, claim) for v in spec.values())
    if isinstance(spec, list):
        return any(names_claim(v, claim) for v in spec)
    return isinstance(spec, str) and (spec == f"pvc://{claim}" or spec.startswith(f"pvc://{claim}/"))


def reclaimable(claims: Iterable[Mapping[str, Any]], specs: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The claims the operator deletes now: created by it with reclaim policy Delete, not being deleted already,
    whose creating service is gone and which no InferenceService of `specs` (name -> spec, the claim's namespace)
    names."""
    out = []
    for claim in claims:
        meta = claim.get("metadata") or {}
        creator = (meta.get("annotations") or {}).get(ANNOTATION_CREATED_BY)
        if not creator or reclaim_policy(claim) != "Delete" or meta.get("deletionTimestamp"):
            continue
        namespace, _, service = str(creator).partition("/")
        if namespace != meta.get("namespace") or service in specs:
            continue
        if not any(names_claim(spec, meta["name"]) for spec in specs.values()):
            out.append(claim)
    return out


def created_claims(store: Store, key: tuple[str, str]) -> dict[tuple[str, str], Cached]:
    """The cache claims the service `key` (namespace, name) created, as the caches hold them: never owned by it, so
    not among `children_of`, yet its own to compare (one deleted by hand is created again at once)."""
    bucket = store.children.get(key) or {}
    return {k: c for k, c in bucket.items() if k[0] == CLAIM_KIND and is_created_by(c.body(), *key)}


def reclaimable_in(store: Store, namespace: str) -> list[Mapping[str, Any]]:
    """`reclaimable` over the caches: the claims of `namespace` the operator deletes now."""
    names = [name for _, name in store.keys_in_scope(CLAIM_KIND, namespace)]
    claims = [c.body() for name in names if (c := store.find(CLAIM_KIND, namespace, name)) is not None]
    if not any(reclaim_policy(c) == "Delete" for c in claims):
        return []  # the common case: no service's spec is read
    services = [s for k in store.service_keys() if k[0] == namespace and (s := store.service(k)) is not None]
    return reclaimable(claims, {s.name: s.body().get("spec") or {} for s in services})
