"""What operators before the watch-driven controller left on InferenceServices, and its removal.

Older, kopf-handler operators put a finalizer (`LEGACY_FINALIZER`) and handler-progress annotations
on every object; the controller removes them at its first sync of an object, so deleting it never
waits for an operator.

Operators before the chart-shipped router ClusterRole created, per service, a Role `<name>-router`
(endpointslices get/list/watch) and a RoleBinding of that name to it. Its replacement binds the ClusterRole
instead (builders/network.py `router_rbac`); nothing here acts on it, the reconcile does, at the service's next
full sync: `LEGACY_CHILD_KINDS` stay watched (features.BASE_KINDS) and in the apply order (builders.KIND_ORDER),
so the old Role is an observed child no longer desired and is pruned; the RoleBinding keeps its name, and
because a roleRef is immutable, the plan deletes it and creates it anew (reconcile.Plan.replace). The
operator's ClusterRole keeps list/watch/delete on roles for this, never create or patch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidepool.operator.api import KIND
from tidepool.operator.k8s import KubeClient

LEGACY_CHILD_KINDS = ("Role",)  # children only older operators created: watched so that they are pruned
LEGACY_FINALIZER = "tidepool.dev/finalizer"  # kopf's, from operators before the watch-driven controller
LEGACY_ANNOTATIONS = tuple(
    f"tidepool.dev/{k}" for k in ("last-handled-configuration", "create", "update", "resume", "resync", "autoscale")
)


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
