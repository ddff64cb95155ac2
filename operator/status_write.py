"""Writing an InferenceService's status: the merge patch, whether a change may wait, the conditional write.

`status_patch()` is the merge patch over the fields reconcile owns (`autoscaling` belongs to the
autoscaler and is never written here); `is_routine()` tells a change of counts and messages (paced
by the controller) from a transition (written at once); `write_status()` patches the status
subresource with the resourceVersion the status was computed from (a 409 means somebody wrote in
between: the caller retries from fresh state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidepool.operator.api import KIND, InferenceServiceStatus
from tidepool.operator.k8s import ApiError, KubeClient

# The status fields reconcile owns; `autoscaling` belongs to the autoscaler and is never written here.
OWNED_STATUS_KEYS = (
    "observedGeneration", "conditions", "pools", "replicas", "selector", "url", "lora", "operatorDefaults", "model",
)  # fmt: skip


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
    for key in ("replicas", "selector", "url", "lora", "model"):
        if key in old and key not in new:
            patch[key] = None
    return patch


def is_routine(previous: InferenceServiceStatus, status: InferenceServiceStatus) -> bool:
    """True when only counts and condition messages differ: the same observedGeneration, URL, selector
    and pools, every condition with the same status, reason and observedGeneration, and every LoRA adapter
    in the same state per pool, and the same resolved model revision (status.model). Such a change
    may wait a moment (it is paced); anything else is a transition and is written at once."""

    def shape(s: InferenceServiceStatus) -> tuple[Any, ...]:
        conditions = sorted((c.type, c.status, c.reason, c.observed_generation) for c in s.conditions)
        adapters = [(a.name, a.state, [(p.pool, p.state) for p in a.pools]) for a in s.lora or []]
        return s.observed_generation, s.url, s.selector, sorted(s.pools), conditions, adapters, s.model

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
