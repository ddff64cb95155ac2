"""Pure builders: an InferenceService's parsed spec (`ServiceView`) -> its desired state.

`desired_state(name, namespace, view, features, replicas_by_pool, owner)` returns a `Desired`
(layout.py): every child as a plain dict, in a stable order (see KIND_ORDER), and each pool's and
the router's `PoolLayout`, the status URL and selector, built alongside the manifests. No client,
no clock, no I/O: the same inputs always give the same output, byte for byte once dumped with
sorted keys.

Children: per pool an engine workload (Deployment | LeaderWorkerSet | StatefulSet per replica group,
plus a headless Service for the groups), a Service and, where it can protect something, a PodDisruptionBudget
(network.pool_pdb); unless `router.enabled` is false, the router Deployment, Service, ServiceAccount and
RoleBinding (to the chart's ClusterRole --router-cluster-role), and its PodDisruptionBudget from two replicas
(without a router status.url is the pool's Service); per multi-node pool the Secret of its control channel's key
(control_key.py: created once by the plan, never applied); the model-cache claim when
`modelCache.persistentVolumeClaim.size` asks for one (created if absent, never owned: claims.py); a
ServiceMonitor when the CRD exists; an InferencePool when its CRD exists and `spec.inferencePool` names an
Endpoint Picker (inference_pool.py); the ingress NetworkPolicies unless `spec.networkPolicy.enabled` is false
(netpol.py).
`replicas_by_pool` (the autoscaler's seam) overrides the spec's replicas per pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

from tidepool.operator.api.spec import InferenceServiceSpec, Mode
from tidepool.operator.api.view import PoolView, ServiceView, SpecError

from .common import (
    LABEL_POOL,
    LABEL_SERVICE,
    LABEL_SPEC_HASH,
    MANAGED_BY,
    ROUTER_POOL,
    WORKLOAD_KINDS,
    ClusterFeatures,
    inherit_labels,
    inherited_labels,
    selector_labels,
    spec_hash,
)
from .control_key import control_key_secret
from .engine import Topology, pool_workloads, topology, with_workload_kind
from .inference_pool import inference_pool
from .layout import ChildKey, Desired, PoolLayout
from .netpol import network_policies, router_runs
from .network import (
    cache_claim,
    headless_service,
    pool_pdb,
    pool_service,
    pool_url,
    router_deployment,
    router_pdb,
    router_rbac,
    router_service,
    router_url,
    service_monitor,
)

# Per mode, the pools it runs and the one the scale subresource controls (read from the API's own helpers).
_BY_MODE = {mode: InferenceServiceSpec.model_construct(mode=mode) for mode in get_args(Mode)}
POOLS_BY_MODE: dict[str, tuple[str, ...]] = {mode: spec.pool_names() for mode, spec in _BY_MODE.items()}
SCALED_POOL: dict[str, str] = {mode: spec.scaled_pool() for mode, spec in _BY_MODE.items()}

# Apply order: what others reference first (claim, RBAC), then Services, then workloads.
KIND_ORDER = (
    "PersistentVolumeClaim",
    "Secret",
    "ServiceAccount",
    "Role",  # never built any more: an older operator's router Role, pruned (operator/legacy.py)
    "RoleBinding",
    "Service",
    "PodDisruptionBudget",
    "NetworkPolicy",  # before the workloads: their pods start behind it
    "Deployment",
    "StatefulSet",
    "LeaderWorkerSet",
    "ServiceMonitor",
    "InferencePool",
)

__all__ = [
    "KIND_ORDER",
    "LABEL_POOL",
    "LABEL_SERVICE",
    "LABEL_SPEC_HASH",
    "MANAGED_BY",
    "POOLS_BY_MODE",
    "SCALED_POOL",
    "WORKLOAD_KINDS",
    "ChildKey",
    "ClusterFeatures",
    "Desired",
    "PoolLayout",
    "PoolView",
    "ServiceView",
    "SpecError",
    "desired_replicas",
    "desired_state",
    "pod_selector",
    "spec_hash",
]


def desired_replicas(view: ServiceView, replicas_by_pool: Mapping[str, int] | None) -> dict[str, int]:
    """Replicas per pool: the override where given (autoscaler), else the spec's."""
    out = {}
    for pool in view.pool_names:
        value = (replicas_by_pool or {}).get(pool, view.pools[pool].replicas)
        if value < 0:
            raise SpecError(f"replicas of pool {pool} must be >= 0, got {value}")
        out[pool] = int(value)
    return out


def pod_selector(name: str, view: ServiceView) -> str:
    """The label selector of the scaled pool's pods (status.selector, for the scale subresource)."""
    labels = selector_labels(name, view.scaled_pool)
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def pool_layout(pool: PoolView, replicas: int, topo: Topology, workloads: list[dict[str, Any]]) -> PoolLayout:
    """The layout of one engine pool, from the workloads just built for it."""
    first = workloads[0] if workloads else None
    return PoolLayout(
        name=pool.name,
        desired=replicas,
        floor=min(replicas, max(1, pool.min_replicas)),
        spec_hash=first["metadata"]["labels"][LABEL_SPEC_HASH] if first else "",
        workloads=tuple((w["kind"], w["metadata"]["name"]) for w in workloads),
        pods_per_replica=topo.nnodes if first else 1,
    )


def router_layout(view: ServiceView, deployment: dict[str, Any]) -> PoolLayout:
    replicas = view.spec.router_replicas()
    return PoolLayout(
        name=ROUTER_POOL,
        desired=replicas,
        floor=min(replicas, 1),
        spec_hash=deployment["spec"]["template"]["metadata"]["labels"][LABEL_SPEC_HASH],
        workloads=(("Deployment", deployment["metadata"]["name"]),),
    )


def desired_state(
    name: str,
    namespace: str,
    view: ServiceView,
    features: ClusterFeatures | None = None,
    replicas_by_pool: Mapping[str, int] | None = None,
    owner: Mapping[str, Any] | None = None,
    kinds: Mapping[str, str] | None = None,
    service_labels: Mapping[str, str] | None = None,
) -> Desired:
    """Every child manifest of one InferenceService, in apply order, with the pools' layouts. Raises
    SpecError for a spec no cluster can run (e.g. more tensor ranks than a node has GPUs). `kinds`: the
    multi-node workload kind each existing pool runs as, which it keeps (sticky; new pools get the cluster's).
    `service_labels`: the InferenceService's metadata.labels, which every child inherits (common.inherited_labels)."""
    features = features or ClusterFeatures()
    inherited = inherited_labels(dict(service_labels or {}))
    replicas = desired_replicas(view, replicas_by_pool)
    children: list[dict[str, Any]] = []
    engine_workloads: list[dict[str, Any]] = []
    layouts = []
    for pool_name in view.pool_names:
        pool = view.pools[pool_name]
        pool_features = with_workload_kind(features, (kinds or {}).get(pool_name))
        topo = topology(view, pool_features)
        workloads = pool_workloads(view, pool, replicas[pool_name], name, namespace, pool_features)
        for workload in workloads:  # before the layout reads their spec hash
            inherit_labels(workload, inherited)
        engine_workloads += workloads
        layouts.append(pool_layout(pool, replicas[pool_name], topo, workloads))
        children += workloads
        children.append(pool_service(name, namespace, pool_name, topo))
        if topo.workload == "StatefulSet":
            children.append(headless_service(name, namespace, pool_name))
        if topo.nnodes > 1:
            children.append(control_key_secret(name, namespace, pool_name))
        if pdb := pool_pdb(name, namespace, pool_name, view):
            children.append(pdb)
    claim = cache_claim(name, namespace, view)
    if claim:
        children.append(claim)
    router = router_deployment(name, namespace, view, features) if router_runs(view) else None
    if router:
        children += router_rbac(name, namespace, features.router_cluster_role)
        children.append(router)
        children.append(router_service(name, namespace))
        if pdb := router_pdb(name, namespace, view.spec.router_replicas()):
            children.append(pdb)
    if features.has_service_monitor:
        children.append(service_monitor(name, namespace))
    children += network_policies(name, namespace, view, features)
    gateway_pool = inference_pool(name, namespace, view, features)
    if gateway_pool:
        children.append(gateway_pool)
    for child in children:  # a cache claim may serve several services: it keeps the labels it was created with
        if child["kind"] != "PersistentVolumeClaim" and not any(child is w for w in engine_workloads):
            inherit_labels(child, inherited)
    if owner:
        for child in children:
            if child["kind"] != "PersistentVolumeClaim":  # a cache claim is never owned (claims.py): GC never takes it
                child["metadata"]["ownerReferences"] = [dict(owner)]
    children.sort(key=lambda c: (KIND_ORDER.index(c["kind"]), c["metadata"]["name"]))
    # Without a router (unified mode only, rules.py) clients call the pool's Service: it selects the serving pods.
    url = router_url(name, namespace) if router else pool_url(name, namespace, view.pool_names[-1])
    selector = pod_selector(name, view)
    layout = router_layout(view, router) if router else None
    return Desired(children, layouts, layout, url, selector, SCALED_POOL[view.mode])
