"""Cache claims (`spec.modelCache.persistentVolumeClaim` with `size`): how the plan treats one that exists.

Pure helpers for reconcile.plan(), which hands them the desired claim and the observed one.

Invariants:
- What Kubernetes cannot change is never applied (the API server would refuse it at every reconcile, and the
  rest of the spec would not roll out): a claim is resized only when bound, only upwards and only past what
  its volume already holds; accessModes, storageClassName and volumeMode are fixed at creation. What was
  kept is said (a ClaimKept Warning, once while it lasts: sync.py).
- A claim several InferenceServices name is shared: it keeps the service label of the one that created it
  (the caches file it there; the others find it by name), and every service adds its owner reference
  (non-controller), so no apply takes another service's reference away and the garbage collector deletes
  the claim only with its last owner. A service that stops naming it, while others still own it, only
  takes its own reference away.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tidepool.operator.api.quantity import quantity_value
from tidepool.operator.builders import LABEL_SERVICE

CLAIM_FIXED_FIELDS = ("accessModes", "storageClassName", "volumeMode")  # immutable once a claim exists


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
            # Also when the spec leaves it out: the field manager that set it (this operator, for whichever
            # service created the claim) would otherwise remove it, which is a change the API server refuses.
            kept_spec[name] = old[name]
            if name in spec:
                kept.append(f"{name} {old[name]} (fixed at creation; the spec asks {spec[name]})")
    changed = kept or kept_spec != spec
    return ({**desired, "spec": kept_spec} if changed else desired), kept


def shared_claim(desired: dict[str, Any], observed: Mapping[str, Any]) -> dict[str, Any]:
    """The desired claim as one of the services that share it: the service label stays the one it has (the
    service that created it), and its owners are everyone's, this one's included, so the garbage collector
    deletes it only with its last service and no apply takes another service's reference away."""
    meta = observed["metadata"]
    creator = (meta.get("labels") or {}).get(LABEL_SERVICE)
    mine = {r.get("uid"): r for r in desired["metadata"].get("ownerReferences") or []}
    present = meta.get("ownerReferences") or []
    if not creator and not present:
        return desired
    owners = [mine.pop(r.get("uid"), r) for r in present] + list(mine.values())  # in the order stored
    labels = {**(desired["metadata"].get("labels") or {}), **({LABEL_SERVICE: creator} if creator else {})}
    return {**desired, "metadata": {**desired["metadata"], "labels": labels, "ownerReferences": owners}}


def released_claim(observed: Mapping[str, Any], uid: str) -> dict[str, Any] | None:
    """A claim this service no longer wants but others still own: the apply that takes only this service's
    reference away (its spec as it is: the apply must not drop fields it set). None when no one else owns it."""
    meta = observed["metadata"]
    others = [r for r in meta.get("ownerReferences") or [] if r.get("uid") != uid]
    if not others or len(others) == len(meta.get("ownerReferences") or []):
        return None
    kept = {k: meta[k] for k in ("name", "namespace", "labels") if k in meta}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {**kept, "ownerReferences": others},
        "spec": copy.deepcopy(observed.get("spec") or {}),
    }


def with_shared_claims(
    observed: Mapping[tuple[str, str], dict[str, Any]],
    desired: Sequence[Mapping[str, Any]],
    find: Callable[[str, str], Mapping[str, Any] | None],
) -> dict[tuple[str, str], dict[str, Any]]:
    """`observed` plus each desired claim that exists under another service's label (`find(kind, name)`): the
    plan must see a shared claim as it is, not create it again over another service's."""
    out = dict(observed)
    for child in desired:
        key = (child["kind"], child["metadata"]["name"])
        if child["kind"] == "PersistentVolumeClaim" and key not in out:
            found = find(*key)
            if found is not None:
                out[key] = dict(found)
    return out
