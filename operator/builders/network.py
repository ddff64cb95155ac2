"""Services, the router (Deployment, Service, ServiceAccount + RoleBinding to read EndpointSlices, PodDisruptionBudget),
the pools' PodDisruptionBudgets and the optional ServiceMonitor of one InferenceService.

Router availability: `spec.router_replicas()` (router.replicas, or automatic: 2 where any pool can exceed one
replica, else 1) spread across nodes and zones (topologySpreadConstraints, ScheduleAnyway: a one-node cluster
still runs them all), rolled with maxUnavailable 0 (a new router is Ready before an old one stops), and from two
replicas a PodDisruptionBudget keeping one up through drains (minAvailable 1; a lone router gets none). A pool's
PDB is its `disruptionBudget`; unset, maxUnavailable 1 where the pool can exceed one replica, else none.
With `router.enabled: false` none of the router objects exist (builders/__init__.py).

Invariants: pure; a pool Service selects only pods that serve HTTP (rank 0 of a multi-node replica);
the router discovers engines through the pool Services' EndpointSlices, so its RoleBinding grants exactly
get/list/watch on endpointslices in its own namespace (a chart-shipped ClusterRole, bound per service; an older
operator's per-service Role is pruned: legacy.py); with spec.auth the router mounts the API-key Secret
and gets --api-key-file, as the engines do (auth.py).
"""

from __future__ import annotations

from typing import Any

from tidepool.operator.api.availability import DEFAULT_POOL_BUDGET
from tidepool.operator.api.pod import ROUTER_RESOURCES
from tidepool.operator.api.quantity import canonical_quantity
from tidepool.operator.api.view import ServiceView

from .auth import api_key_args, with_api_key
from .common import (
    ENGINE_PORT,
    GROUP,
    KV_PORT,
    MASTER_PORT,
    POD_INDEX_LABEL,
    ROUTER_POOL,
    ROUTER_PORT,
    ClusterFeatures,
    child_name,
    container_security_context,
    engine_image,
    flags_to_args,
    labels,
    metadata,
    pod_security_context,
    selector_labels,
    sorted_env,
    spec_hash,
)
from .engine import LWS_WORKER_INDEX_LABEL, Topology, headless_name, termination_grace_s
from .overrides import container_resources, wire


def serving_selector(name: str, pool: str, topo: Topology) -> dict[str, str]:
    """Labels of the pool's pods that serve HTTP: every pod, or only rank 0 of each multi-node replica."""
    selector = selector_labels(name, pool)
    if topo.workload == "LeaderWorkerSet":
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    elif topo.workload == "StatefulSet":
        selector[POD_INDEX_LABEL] = "0"
    return dict(sorted(selector.items()))


def pool_service(name: str, namespace: str, pool: str, topo: Topology) -> dict[str, Any]:
    selector = serving_selector(name, pool, topo)
    ports = [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]
    if pool in ("prefill", "decode"):
        ports.append({"name": "kv", "port": KV_PORT, "targetPort": "kv", "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(child_name(name, pool), namespace, labels(name, pool, "engine")),
        "spec": {"type": "ClusterIP", "selector": dict(sorted(selector.items())), "ports": ports},
    }


def headless_service(name: str, namespace: str, pool: str) -> dict[str, Any]:
    """DNS for the ranks of StatefulSet groups; published before readiness so ranks can rendezvous."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(headless_name(name, pool), namespace, labels(name, pool, "engine")),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(name, pool),
            "ports": [{"name": "dist", "port": MASTER_PORT, "targetPort": "dist", "protocol": "TCP"}],
        },
    }


def pool_pdb(name: str, namespace: str, pool: str, view: ServiceView) -> dict[str, Any] | None:
    """The pool's PodDisruptionBudget: pools.<pool>.disruptionBudget; unset, maxUnavailable 1 where the pool can
    run more than one replica and None for a single-replica pool (a budget there protects nothing)."""
    budget = view.spec.pool(pool).disruption_budget
    if budget is None and not view.spec.can_exceed_one_replica(pool):
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(child_name(name, pool), namespace, labels(name, pool, "engine")),
        "spec": {
            **(budget.to_pdb_spec() if budget else DEFAULT_POOL_BUDGET),
            "selector": {"matchLabels": selector_labels(name, pool)},
        },
    }


def router_pdb(name: str, namespace: str, replicas: int) -> dict[str, Any] | None:
    """One router stays up through voluntary disruptions once there are two (minAvailable 1). None below two:
    a lone router's budget could only block its node's drains (minAvailable 1) or protect nothing."""
    if replicas < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(child_name(name, ROUTER_POOL), namespace, labels(name, ROUTER_POOL, "router")),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": selector_labels(name, ROUTER_POOL)}},
    }


def router_spread(name: str) -> list[dict[str, Any]]:
    """Routers spread over nodes, then zones; ScheduleAnyway: a preference, never a reason to stay Pending.
    matchLabelKeys counts only the pods of the same ReplicaSet, so a rollout's surge does not skew it."""
    selector = {"matchLabels": selector_labels(name, ROUTER_POOL)}
    return [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": selector,
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
    ]


# On a cache claim the operator created (claims.py reads them): which InferenceService created it
# ("<namespace>/<name>"), and what becomes of it once that service is deleted (spec reclaimPolicy).
ANNOTATION_CREATED_BY = f"{GROUP}/created-by"
ANNOTATION_RECLAIM_POLICY = f"{GROUP}/reclaim-policy"


def cache_claim(name: str, namespace: str, view: ServiceView) -> dict[str, Any] | None:
    """The model-cache claim, when the spec asks the operator to create it (its size is set): created only if no
    claim of that name exists, never owned by the service (claims.py); its annotations say who created it and
    its reclaim policy."""
    cache = view.model_cache.persistent_volume_claim if view.model_cache else None
    if cache is None or cache.size is None:
        return None
    spec: dict[str, Any] = {
        # Default ReadWriteMany: every replica of every pool, on any node, reads (and fills) it.
        "accessModes": list(cache.access_modes or ["ReadWriteMany"]),
        "resources": {"requests": {"storage": canonical_quantity(cache.size)}},
    }
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    annotations = {ANNOTATION_CREATED_BY: f"{namespace}/{name}", ANNOTATION_RECLAIM_POLICY: cache.reclaim_policy}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(cache.claim_name, namespace, labels(name, "cache", "cache"), annotations),
        "spec": spec,
    }


def router_rbac(name: str, namespace: str, cluster_role: str) -> list[dict[str, Any]]:
    """The router's ServiceAccount and a RoleBinding, in its own namespace, to the chart's ClusterRole
    `cluster_role` (endpointslices get/list/watch): no Role per service. The operator may create the binding
    because it holds `bind` on exactly that ClusterRole (the API server's escalation check)."""
    sa = child_name(name, ROUTER_POOL)
    lbls = labels(name, ROUTER_POOL, "router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(sa, namespace, lbls)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(sa, namespace, lbls),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
        },
    ]


SCALE_FROM_ZERO_HOLD_S = 300  # the router's --hold-timeout for a service that scales to zero (Knative's default)


def router_deployment(name: str, namespace: str, view: ServiceView, features: ClusterFeatures) -> dict[str, Any]:
    flags: dict[str, Any] = {
        "--port": ROUTER_PORT,
        "--policy": view.router.policy,
        "--discovery": "kubernetes",
        "--namespace": namespace,
    }
    for pool in view.pool_names:
        flags[f"--{pool}-service"] = child_name(name, pool)
    if view.autoscaling.scale_to_zero.enabled:
        # A request arriving at zero waits for an autoscaler tick (15 s) and a whole pod start (schedule, image,
        # weights, warm-up), far past the router's 30 s default: hold it as long as Knative's activator does.
        flags["--hold-timeout"] = SCALE_FROM_ZERO_HOLD_S
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}
    mounts, volumes = with_api_key(view, [{"name": "tmp", "mountPath": "/tmp"}], [{"name": "tmp", "emptyDir": {}}])
    container = {
        "name": "router",
        "image": features.router_image or engine_image(view, features),
        "command": ["tidepool", "router"],
        "args": flags_to_args(flags) + api_key_args(view),
        "env": sorted_env({"HOME": "/tmp"}),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "resources": container_resources(ROUTER_RESOURCES, view.router.resources),
        "livenessProbe": probe,
        "readinessProbe": {**probe, "httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {
        "serviceAccountName": child_name(name, ROUTER_POOL),
        # No *_SERVICE_HOST/PORT variables for every Service of the namespace (7 per Service: with hundreds of
        # services in a namespace, thousands per pod); the router finds engines through EndpointSlices and the
        # API server through KUBERNETES_SERVICE_HOST, which the kubelet sets regardless.
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        # The router proxies streams from engines that drain for up to engine.drainTimeoutSeconds.
        "terminationGracePeriodSeconds": termination_grace_s(view),
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": router_spread(name),
    }
    # What of spec.pod reaches the router is documented in api/pod.py; router.* adds the router's own.
    if view.pod.priority_class_name:
        spec["priorityClassName"] = view.pod.priority_class_name
    tolerations = [*view.pod.tolerations, *view.router.tolerations]
    if tolerations:
        spec["tolerations"] = [t.to_wire() for t in tolerations]
    if view.router.node_selector:
        spec["nodeSelector"] = dict(sorted(view.router.node_selector.items()))
    if view.pod.image_pull_secrets:
        spec["imagePullSecrets"] = [wire(s) for s in view.pod.image_pull_secrets]
    template = {"metadata": {"labels": labels(name, ROUTER_POOL, "router")}, "spec": spec}
    template["metadata"]["labels"]["tidepool.dev/spec-hash"] = spec_hash(template)
    template["metadata"]["labels"] = dict(sorted(template["metadata"]["labels"].items()))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(child_name(name, ROUTER_POOL), namespace, labels(name, ROUTER_POOL, "router")),
        "spec": {
            "replicas": view.spec.router_replicas(),
            "selector": {"matchLabels": selector_labels(name, ROUTER_POOL)},
            # A new router is Ready before an old one stops: the Service never loses its last endpoint.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": template,
        },
    }


def router_service(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(child_name(name, ROUTER_POOL), namespace, labels(name, ROUTER_POOL, "router")),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, ROUTER_POOL),
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_url(name: str, namespace: str) -> str:
    """The in-cluster endpoint clients use (the router Service; port 80)."""
    return f"http://{child_name(name, ROUTER_POOL)}.{namespace}.svc"


def pool_url(name: str, namespace: str, pool: str) -> str:
    """A pool Service's in-cluster endpoint (status.url of a service run without a router)."""
    return f"http://{child_name(name, pool)}.{namespace}.svc:{ENGINE_PORT}"


def service_monitor(name: str, namespace: str) -> dict[str, Any]:
    """Scrapes /metrics of every pool Service and the router Service of this InferenceService."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata(name, namespace, labels(name, "metrics", "metrics")),
        "spec": {
            "selector": {
                "matchLabels": {"app.kubernetes.io/instance": name, "app.kubernetes.io/name": "tidepool"},
                "matchExpressions": [{"key": "tidepool.dev/pool", "operator": "NotIn", "values": ["config"]}],
            },
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }
