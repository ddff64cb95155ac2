"""The NetworkPolicies of one InferenceService (`spec.networkPolicy`): ingress to its engine and router pods.

`<name>-engine` selects every engine pod of the service (all pools, all ranks) and lets in:
  - every engine pod of the same service, on all ports (tensor/pipeline ranks, the multi-node control channel,
    the KV hand-off between prefill and decode);
  - the router's pods, on the engine HTTP port (while a router runs);
  - the operator's metrics collector (`ClusterFeatures.collector`), on the engine HTTP port: the autoscaler's
    scrapes of /metrics and the operator's LoRA calls (health probes come from the kubelet, which policies never
    block);
  - `clients`, on the engine HTTP port, where they reach the engines directly: no router runs, or an
    InferencePool routes a gateway to the serving pods.
`<name>-router` (only while a router runs) selects the router's pods and lets in `clients` and the collector on
the router port. `clients` unset: every pod of the service's namespace; `[]`: no one (the collector and the
service's own pods still get in).

Invariants: pure; Ingress only (egress is untouched: engines download models, routers read EndpointSlices); no
rule is ever written with an empty `from` (that would admit every source), so an empty peer list drops its
rule, and no empty map or list is written where the API server would drop it (the reconcile compares what it
stores); selectors use only labels the operator owns (users' pod labels cannot override them), so a policy always
selects exactly the pods the engine and router builders render; `spec.networkPolicy.enabled: false` builds none
(the reconcile's prune deletes the ones that exist).
"""

from __future__ import annotations

from typing import Any

from tidepool.operator.api.view import ServiceView

from .common import (
    ENGINE_PORT,
    LABEL_COMPONENT,
    LABEL_SERVICE,
    ROUTER_POOL,
    ROUTER_PORT,
    ClusterFeatures,
    Collector,
    child_name,
    labels,
    metadata,
    selector_labels,
)

API_VERSION = "networking.k8s.io/v1"
KIND = "NetworkPolicy"
COMPONENT = "network-policy"
ENGINE_PART = "engine"  # <name>-engine; also its tidepool.dev/pool label: not an engine pool, never "replaced"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
Peer = dict[str, Any]


def router_runs(view: ServiceView) -> bool:
    """Does the service run router pods? (the one count the router builders use: 0 when router.enabled is false)"""
    return view.spec.router_replicas() > 0


def engine_pod_labels(name: str) -> dict[str, str]:
    """Labels every engine pod of the service carries, whatever its pool or rank (common.labels)."""
    return dict(sorted({LABEL_SERVICE: name, LABEL_COMPONENT: "engine"}.items()))


def collector_peers(collector: Collector) -> list[Peer]:
    """The collector as NetworkPolicy peers: its pods (labels in their namespace) and its address blocks."""
    peers: list[Peer] = []
    if collector.namespace and collector.pod_labels:
        peers.append(
            {
                "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: collector.namespace}},
                "podSelector": {"matchLabels": dict(sorted(collector.pod_labels))},
            }
        )
    peers += [{"ipBlock": {"cidr": cidr}} for cidr in collector.ip_blocks]
    return peers


def client_peers(view: ServiceView) -> list[Peer]:
    """`clients` as peers: unset, every pod of the service's namespace; [], none."""
    clients = view.spec.network_policy.clients
    if clients is None:
        return [{"podSelector": {}}]
    return [peer.to_peer() for peer in clients]


def gateway_routes(view: ServiceView, features: ClusterFeatures) -> bool:
    """Does a gateway reach the engines directly (the service has an InferencePool: inference_pool.py's test)?"""
    spec = view.inference_pool
    return features.has_inference_pool and spec is not None and spec.enabled


def _rule(peers: list[Peer], port: int | None) -> list[dict[str, Any]]:
    """One ingress rule from `peers` (on `port`, or all ports), or none when there is no peer."""
    if not peers:
        return []
    rule: dict[str, Any] = {"from": peers}
    if port is not None:
        rule["ports"] = [{"port": port, "protocol": "TCP"}]
    return [rule]


def _policy(name: str, namespace: str, part: str, pods: dict[str, str], ingress: list[dict]) -> dict[str, Any]:
    """One policy; no `ingress` key when it has no rule (deny all: the API server stores no empty list)."""
    spec: dict[str, Any] = {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"]}
    if ingress:
        spec["ingress"] = ingress
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata(child_name(name, part), namespace, labels(name, part, COMPONENT)),
        "spec": spec,
    }


def network_policies(name: str, namespace: str, view: ServiceView, features: ClusterFeatures) -> list[dict[str, Any]]:
    """The service's NetworkPolicies: `<name>-engine`, and `<name>-router` while a router runs; none when
    `spec.networkPolicy.enabled` is false."""
    if not view.spec.network_policy.enabled:
        return []
    engines = engine_pod_labels(name)
    routers = selector_labels(name, ROUTER_POOL)
    collector = collector_peers(features.collector)
    has_router = router_runs(view)
    clients = client_peers(view)
    engine_ingress = [
        *_rule([{"podSelector": {"matchLabels": engines}}], None),
        *_rule([{"podSelector": {"matchLabels": routers}}] if has_router else [], ENGINE_PORT),
        *_rule(collector, ENGINE_PORT),
        *_rule(clients if not has_router or gateway_routes(view, features) else [], ENGINE_PORT),
    ]
    out = [_policy(name, namespace, ENGINE_PART, engines, engine_ingress)]
    if has_router:
        router_ingress = [*_rule(clients, ROUTER_PORT), *_rule(collector, ROUTER_PORT)]
        out.append(_policy(name, namespace, ROUTER_POOL, routers, router_ingress))
    return out
