"""What operators before the watch-driven controller left on InferenceServices, and its removal.

Older, kopf-handler operators put a finalizer (`LEGACY_FINALIZER`) and handler-progress annotations
on every object; the controller removes them at its first sync of an object, so deleting it never
waits for an operator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidepool.operator.api import KIND
from tidepool.operator.k8s import KubeClient

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
