"""Optional CRDs the operator uses when a cluster has them: discovery, and the kinds its caches watch.

One table, `OPTIONAL_KINDS`: ClusterFeatures flag -> (group/version, kind). `detect_features` asks API
discovery for each (the controller does at start-up and every `feature_recheck_seconds`); `watched_kinds`
is what the informers watch for a set of features. A kind whose CRD goes away is no longer watched and
its cached objects are forgotten (the controller does that; nothing is left to delete); a refused apply
of an optional kind makes the controller look again at once. `sticky_kinds` keeps an existing multi-node
pool on the workload kind it runs as (StatefulSet groups or LeaderWorkerSet) when LWS comes or goes: only a
new pool takes the cluster's current choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tidepool.operator.builders import LABEL_POOL, ClusterFeatures
from tidepool.operator.cache import SERVICE_KIND
from tidepool.operator.k8s import KubeClient
from tidepool.operator.legacy import LEGACY_CHILD_KINDS  # no longer built; watched so that they are pruned

BASE_KINDS = (
    "ServiceAccount", *LEGACY_CHILD_KINDS, "RoleBinding", "Service", "PodDisruptionBudget",
    "PersistentVolumeClaim", "Deployment", "StatefulSet", "Pod", "NetworkPolicy",
)  # fmt: skip
OPTIONAL_KINDS: dict[str, tuple[str, str]] = {
    "has_lws": ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    "has_service_monitor": ("monitoring.coreos.com/v1", "ServiceMonitor"),
    "has_inference_pool": ("inference.networking.k8s.io/v1", "InferencePool"),
}
OPTIONAL_KIND_NAMES = frozenset(kind for _, kind in OPTIONAL_KINDS.values())


async def detect_features(client: KubeClient, base: ClusterFeatures) -> ClusterFeatures:
    """`base` (the operator's options) with each optional CRD's presence looked up."""
    found = {flag: await client.has_kind(group_version, kind) for flag, (group_version, kind) in OPTIONAL_KINDS.items()}
    return replace(base, **found)


def watched_kinds(features: ClusterFeatures) -> list[str]:
    return [SERVICE_KIND, *BASE_KINDS, *(kind for flag, (_, kind) in OPTIONAL_KINDS.items() if getattr(features, flag))]


def sticky_kinds(observed: Mapping[tuple[str, str], Mapping[str, Any]]) -> dict[str, str]:
    """The multi-node workload kind (StatefulSet groups or LeaderWorkerSet) each existing engine pool runs as: it
    keeps it when LWS is installed or removed (a flip would replace the pool make-before-break, twice its GPUs).
    A pool that runs both (a replacement under way) keeps the one the builders would choose anyway (none given)."""
    kinds: dict[str, set[str]] = {}
    for (kind, _), obj in observed.items():
        if kind in ("StatefulSet", "LeaderWorkerSet"):
            pool = (obj["metadata"].get("labels") or {}).get(LABEL_POOL, "")
            kinds.setdefault(pool, set()).add(kind)
    return {pool: next(iter(found)) for pool, found in kinds.items() if len(found) == 1}


def refused_optional(objs: Sequence[Mapping[str, Any]], applied: Mapping[tuple[str, str], Any]) -> bool:
    """Did an apply of an optional kind fail (not among the `applied` answers)? Its CRD may be gone."""
    return any(o["kind"] in OPTIONAL_KIND_NAMES and (o["kind"], o["metadata"]["name"]) not in applied for o in objs)
