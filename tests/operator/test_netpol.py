"""The NetworkPolicies of a service (builders/netpol.py), checked against the pods the real builders render.

Every selector is evaluated on the pod templates `desired_state` produces (engine workloads of every kind and
the router Deployment), and every port on those pods' container ports, so a label or port the engine or router
builders change breaks these tests instead of silently opening or closing a path. Also: the spec's peers and
their rules (Python twins of the CRD's CEL), and the operator's --collector-* flags.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tidepool.operator.api import InferenceServiceSpec, validate_spec
from tidepool.operator.builders import ClusterFeatures, ServiceView, desired_state
from tidepool.operator.builders.common import TEMPLATE_PATHS, WORKLOAD_KINDS, Collector
from tidepool.operator.builders.netpol import network_policies, router_runs
from tidepool.operator.collector_flags import add_collector_args, collector_from_args, own_namespace

BASE = {
    "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
    "resources": {"gpusPerReplica": 1},
    "pools": {"unified": {"replicas": 2, "maxReplicas": 4}},
}
DISAGG = {**BASE, "mode": "disaggregated", "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}}
MULTI_NODE = {**BASE, "parallelism": {"tensor": 8, "pipeline": 2}, "resources": {"gpusPerReplica": 16}}
NO_ROUTER = {**BASE, "router": {"enabled": False}}
COLLECTOR = Collector(
    namespace="tidepool-system", pod_labels=(("app", "tidepool-operator"),), ip_blocks=("10.9.0.0/16",)
)
COLLECTOR_PEERS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tidepool-system"}},
        "podSelector": {"matchLabels": {"app": "tidepool-operator"}},
    },
    {"ipBlock": {"cidr": "10.9.0.0/16"}},
]
TOPOLOGIES = [
    pytest.param(BASE, ClusterFeatures(), id="unified"),
    pytest.param(DISAGG, ClusterFeatures(), id="disaggregated"),
    pytest.param(MULTI_NODE, ClusterFeatures(), id="multi-node-statefulset-groups"),
    pytest.param(MULTI_NODE, ClusterFeatures(has_lws=True), id="multi-node-lws"),
]


def build(spec: dict[str, Any], features: ClusterFeatures | None = None, **changes: Any) -> list[dict[str, Any]]:
    body = json.loads(json.dumps(spec))
    body.update(changes)
    view = ServiceView.from_spec(InferenceServiceSpec.model_validate(body).to_wire())
    return desired_state("svc", "ns", view, features or ClusterFeatures(collector=COLLECTOR)).children


def policies(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "NetworkPolicy"}


def pods(children: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    """Every pod template (leader and worker) of the workloads whose pods are `component`'s."""
    out = []
    for child in children:
        if child["kind"] not in WORKLOAD_KINDS:
            continue
        for path in TEMPLATE_PATHS[child["kind"]]:
            node: Any = child
            for key in path:
                node = node.get(key) if node else None
            if node and node["spec"]["containers"][0]["name"] == component:
                out.append(node)
    return out


def selects(selector: dict[str, Any], template: dict[str, Any]) -> bool:
    """A matchLabels-only selector (as the builders write them) applied to a pod template's labels."""
    assert set(selector) <= {"matchLabels"}, selector
    labels = template["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def http_port(template: dict[str, Any]) -> int:
    (port,) = [p["containerPort"] for p in template["spec"]["containers"][0]["ports"] if p["name"] == "http"]
    return port


def rules_from(policy: dict[str, Any], peer: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for rule in policy["spec"]["ingress"] if peer in rule["from"]]


@pytest.mark.parametrize(("spec", "features"), TOPOLOGIES)
def test_selectors_match_exactly_the_pods_the_builders_render(spec, features):
    children = build(spec, ClusterFeatures(has_lws=features.has_lws, collector=COLLECTOR))
    engines, routers = pods(children, "engine"), pods(children, "router")
    assert engines and routers
    nps = policies(children)
    assert set(nps) == {"svc-engine", "svc-router"}
    engine_np, router_np = nps["svc-engine"], nps["svc-router"]
    for np in nps.values():
        assert np["apiVersion"] == "networking.k8s.io/v1" and np["spec"]["policyTypes"] == ["Ingress"]
        assert all(rule["from"] for rule in np["spec"]["ingress"])  # an empty `from` would admit everyone
    assert all(selects(engine_np["spec"]["podSelector"], t) for t in engines)  # every pool, every rank
    assert not any(selects(engine_np["spec"]["podSelector"], t) for t in routers)
    assert all(selects(router_np["spec"]["podSelector"], t) for t in routers)
    assert not any(selects(router_np["spec"]["podSelector"], t) for t in engines)
    # Engines reach each other on every port (ranks, control channel, KV hand-off): the only rule without ports.
    ingress = engine_np["spec"]["ingress"]
    (ranks,) = [r for r in ingress if "ports" not in r]
    assert ranks["from"] == [{"podSelector": ranks["from"][0]["podSelector"]}]
    assert all(selects(ranks["from"][0]["podSelector"], t) for t in engines)
    assert not any(selects(ranks["from"][0]["podSelector"], t) for t in routers)
    # The router reaches the engines' HTTP port only.
    by_pods = [r for r in ingress if len(r["from"]) == 1 and set(r["from"][0]) == {"podSelector"}]
    (from_router,) = [r for r in by_pods if all(selects(r["from"][0]["podSelector"], t) for t in routers)]
    assert not any(selects(from_router["from"][0]["podSelector"], t) for t in engines)
    assert from_router["ports"] == [{"port": http_port(engines[0]), "protocol": "TCP"}]
    assert {http_port(t) for t in engines} == {from_router["ports"][0]["port"]}


def test_collector_and_default_clients():
    children = build(BASE)
    engine_np, router_np = policies(children)["svc-engine"], policies(children)["svc-router"]
    engine_port, router_port = http_port(pods(children, "engine")[0]), http_port(pods(children, "router")[0])
    # The collector scrapes /metrics on both (the engine HTTP port, the router port).
    assert rules_from(engine_np, COLLECTOR_PEERS[0]) == [
        {"from": COLLECTOR_PEERS, "ports": [{"port": engine_port, "protocol": "TCP"}]}
    ]
    assert rules_from(router_np, COLLECTOR_PEERS[0])[0]["ports"] == [{"port": router_port, "protocol": "TCP"}]
    # clients unset: every pod of the namespace calls the router, and only the router.
    everyone = {"podSelector": {}}
    assert rules_from(router_np, everyone) == [
        {"from": [everyone], "ports": [{"port": router_port, "protocol": "TCP"}]}
    ]
    assert rules_from(engine_np, everyone) == []


def test_no_collector_identity_means_no_collector_rule():
    for collector in (Collector(), Collector(namespace="ops"), Collector(pod_labels=(("app", "op"),))):
        nps = policies(build(BASE, ClusterFeatures(collector=collector)))
        assert len(nps["svc-engine"]["spec"]["ingress"]) == 2  # ranks and router only
        assert len(nps["svc-router"]["spec"]["ingress"]) == 1  # the namespace's clients only
    only_blocks = policies(build(BASE, ClusterFeatures(collector=Collector(ip_blocks=("192.0.2.7/32",)))))
    assert rules_from(only_blocks["svc-engine"], {"ipBlock": {"cidr": "192.0.2.7/32"}})


def test_clients_given_and_empty():
    peers = [
        {"namespaceSelector": {"matchLabels": {"team": "gateway"}}, "podSelector": {"matchLabels": {"app": "gw"}}},
        {"namespaceSelector": {}},
        {"podSelector": {"matchLabels": {"app": "batch"}}},
    ]
    router_np = policies(build(BASE, networkPolicy={"clients": peers}))["svc-router"]
    assert router_np["spec"]["ingress"][0]["from"] == peers  # {} selects every namespace, as in NetworkPolicy
    nobody = policies(build(BASE, networkPolicy={"clients": []}))["svc-router"]["spec"]["ingress"]
    assert [r["from"] for r in nobody] == [COLLECTOR_PEERS]
    no_one_at_all = policies(build(BASE, ClusterFeatures(), networkPolicy={"clients": []}))["svc-router"]
    assert "ingress" not in no_one_at_all["spec"]  # deny all: still a policy selecting the routers
    assert no_one_at_all["spec"]["policyTypes"] == ["Ingress"]


def empties(node: Any, key: str = "") -> list[str]:
    """Paths of the empty maps and lists in `node`, except a selector (`{}`: everything, which the API keeps)."""
    if isinstance(node, dict):
        here = [key] if not node and not key.endswith("Selector") else []
        return here + [p for k, v in node.items() for p in empties(v, f"{key}.{k}" if key else k)]
    if isinstance(node, list):
        return ([key] if not node else []) + [p for i, v in enumerate(node) for p in empties(v, f"{key}[{i}]")]
    return []


@pytest.mark.parametrize(
    "changes",
    [{}, {"networkPolicy": {"clients": []}}, {"networkPolicy": {"clients": [{"namespaceSelector": {}}]}}],
)
def test_no_empty_field_the_api_server_would_drop(changes):
    # An empty matchLabels or ingress list is not stored (Go's omitempty): the reconcile would see drift forever.
    for features in (ClusterFeatures(), ClusterFeatures(collector=COLLECTOR)):
        for np in policies(build(BASE, features, **changes)).values():
            assert empties(np) == [], np


def test_router_disabled_clients_call_the_engines():
    view = ServiceView.from_spec(InferenceServiceSpec.model_validate(NO_ROUTER).to_wire())
    assert not router_runs(view)
    children = build(NO_ROUTER, networkPolicy={"clients": [{"podSelector": {"matchLabels": {"app": "gw"}}}]})
    nps = policies(children)
    assert set(nps) == {"svc-engine"} and not pods(children, "router")
    engine_port = http_port(pods(children, "engine")[0])
    assert rules_from(nps["svc-engine"], {"podSelector": {"matchLabels": {"app": "gw"}}}) == [
        {"from": [{"podSelector": {"matchLabels": {"app": "gw"}}}], "ports": [{"port": engine_port, "protocol": "TCP"}]}
    ]
    # Unset clients: the namespace, on the engine port; the router rule is gone with the router.
    default = policies(build(NO_ROUTER))["svc-engine"]["spec"]["ingress"]
    assert {"from": [{"podSelector": {}}], "ports": [{"port": engine_port, "protocol": "TCP"}]} in default
    assert len(default) == 3  # ranks, collector, clients


@pytest.mark.parametrize(("replicas", "runs"), [(None, True), (1, True), (3, True)])
def test_router_runs_reads_replicas_and_enabled(replicas, runs):
    body = {**BASE, "router": {} if replicas is None else {"replicas": replicas}}
    assert router_runs(ServiceView.from_spec(InferenceServiceSpec.model_validate(body).to_wire())) is runs


def test_an_inference_pool_makes_clients_engine_callers_too():
    pool = {"endpointPicker": {"name": "epp", "port": 9002}}
    gateway = {"podSelector": {"matchLabels": {"app": "gateway"}}}
    with_crd = ClusterFeatures(has_inference_pool=True, collector=COLLECTOR)
    children = build(BASE, with_crd, inferencePool=pool, networkPolicy={"clients": [gateway]})
    assert any(c["kind"] == "InferencePool" for c in children)
    engine_port = http_port(pods(children, "engine")[0])
    assert rules_from(policies(children)["svc-engine"], gateway)[0]["ports"] == [
        {"port": engine_port, "protocol": "TCP"}
    ]
    without_crd = policies(build(BASE, inferencePool=pool, networkPolicy={"clients": [gateway]}))
    assert rules_from(without_crd["svc-engine"], gateway) == []  # no InferencePool built: the router is the way in


def test_disabled_builds_none_and_changes_nothing_else():
    on, off = build(DISAGG), build(DISAGG, networkPolicy={"enabled": False})
    assert not policies(off)
    assert [c for c in on if c["kind"] != "NetworkPolicy"] == off
    view = ServiceView.from_spec(InferenceServiceSpec.model_validate({**DISAGG, "networkPolicy": {"enabled": False}}))
    assert network_policies("svc", "ns", view, ClusterFeatures(collector=COLLECTOR)) == []


def test_policies_are_owned_and_inherit_labels_like_every_child():
    view = ServiceView.from_spec(InferenceServiceSpec.model_validate(BASE).to_wire())
    owner = {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "name": "svc", "uid": "u1"}
    children = desired_state("svc", "ns", view, owner=owner, service_labels={"team": "a"}).children
    for np in policies(children).values():
        assert np["metadata"]["ownerReferences"] == [owner]
        assert np["metadata"]["labels"]["team"] == "a"
        assert np["metadata"]["labels"]["tidepool.dev/inferenceservice"] == "svc"
        assert np["metadata"]["labels"]["tidepool.dev/pool"] not in ("unified", "prefill", "decode")


@pytest.mark.parametrize(
    ("clients", "message"),
    [
        ([{}], "a peer needs namespaceSelector or podSelector"),
        ([{"podSelector": {"matchLabels": {"bad key!": "x"}}}], "matchLabels keys must be label keys"),
        ([{"namespaceSelector": {"matchLabels": {"-x": "y"}}}], "matchLabels keys must be label keys"),
    ],
)
def test_invalid_peers_are_refused_with_the_field(clients, message):
    spec = InferenceServiceSpec.model_validate({**BASE, "networkPolicy": {"clients": clients}})
    assert any(message in m and "networkPolicy.clients" in m for m in validate_spec(spec, "svc"))


def test_peer_shapes_are_refused_by_the_model():
    for bad in ({"podSelector": {"matchExpressions": []}}, {"ipBlock": {"cidr": "10.0.0.0/8"}}):
        with pytest.raises(ValidationError):
            InferenceServiceSpec.model_validate({**BASE, "networkPolicy": {"clients": [bad]}})
    with pytest.raises(ValidationError, match=r"networkPolicy\.clients\.0\.podSelector\.matchLabels"):
        InferenceServiceSpec.model_validate(
            {**BASE, "networkPolicy": {"clients": [{"podSelector": {"matchLabels": {"a": "no spaces"}}}]}}
        )
    ok = InferenceServiceSpec.model_validate(
        {**BASE, "networkPolicy": {"clients": [{"podSelector": {"matchLabels": {"example.com/team": "a"}}}]}}
    )
    assert validate_spec(ok, "svc") == []


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_collector_args(parser)
    return parser.parse_args(list(argv))


def test_collector_flags():
    args = parse(
        "--collector-namespace=ops", "--collector-pod-labels=b=2, a=1", "--collector-ip-blocks=10.0.0.1,fd00::/64"
    )
    assert collector_from_args(args, env={}) == Collector("ops", (("a", "1"), ("b", "2")), ("10.0.0.1/32", "fd00::/64"))
    assert collector_from_args(parse(), env={"POD_NAMESPACE": "tp"}).namespace == "tp"  # the pod's own, by default
    assert collector_from_args(parse("--collector-namespace=x"), env={"POD_NAMESPACE": "tp"}).namespace == "x"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--collector-pod-labels=app",), "--collector-pod-labels"),
        (("--collector-pod-labels=a b=c", "--collector-namespace=x"), "--collector-pod-labels"),
        (("--collector-pod-labels=a=b c", "--collector-namespace=x"), "--collector-pod-labels"),
        (("--collector-ip-blocks=10.0.0.1/8",), "--collector-ip-blocks"),  # host bits set
        (("--collector-ip-blocks=nowhere",), "--collector-ip-blocks"),
        (("--collector-namespace=Not_A_Namespace",), "--collector-namespace"),
    ],
)
def test_bad_collector_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        collector_from_args(parse(*argv), env={}, sa_dir=Path("/nonexistent"))


def test_the_default_namespace_is_the_pods_own(tmp_path):
    assert own_namespace({}, tmp_path) is None
    with pytest.raises(ValueError, match="--collector-pod-labels needs --collector-namespace"):
        collector_from_args(parse("--collector-pod-labels=app=op"), env={}, sa_dir=tmp_path)
    (tmp_path / "namespace").write_text("from-file\n")
    assert own_namespace({}, tmp_path) == "from-file"
    assert own_namespace({"POD_NAMESPACE": "from-env"}, tmp_path) == "from-env"
    found = collector_from_args(parse("--collector-pod-labels=app=op"), env={}, sa_dir=tmp_path)
    assert found == Collector("from-file", (("app", "op"),))
