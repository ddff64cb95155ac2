"""spec.networkPolicy on the real control plane, with the chart's RBAC (networkpolicies: the verbs of any child).

The operator (a host process given a collector identity by its --collector-* flags) creates `<name>-engine` and
`<name>-router` for a disaggregated service; the API server accepts them as built, and stores them in a form the
reconcile's comparison sees as unchanged (no drift loop); their pod selectors, evaluated by the API server on
the pods the workload controllers created, pick exactly the engine pods (both pools) and the router pods. A
hand edit is reverted, opting out deletes both, opting back in recreates them. A service without a router gets
only the engine policy, with its clients on the engine port. Peers the CRD cannot accept are refused by the
API server with the message of their Python twin (operator/api/netpol.py). Whether a CNI enforces the policies
is the real-pod tier's test (this control plane runs no network plugin).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_kit import OperatorProcess, get_isvc, is_ready, pods, restricted_namespace, wait_until

from tidepool.operator.api.netpol import NETPOL_RULES
from tidepool.operator.builders import ClusterFeatures, ServiceView, desired_state
from tidepool.operator.builders.common import Collector
from tidepool.operator.reconcile import contains

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

COLLECTOR_ARGS = (
    "--collector-namespace=tidepool-system",
    "--collector-pod-labels=app.kubernetes.io/name=tidepool,app.kubernetes.io/component=operator",
    "--collector-ip-blocks=127.0.0.1",
)
COLLECTOR = Collector(
    "tidepool-system",
    (("app.kubernetes.io/component", "operator"), ("app.kubernetes.io/name", "tidepool")),
    ("127.0.0.1/32",),
)
GATEWAY = {"namespaceSelector": {"matchLabels": {"team": "gateway"}}, "podSelector": {"matchLabels": {"app": "gw"}}}


@pytest.fixture
def collector_operator(control_plane, cp_namespace: str, identity, tmp_path: Path) -> Iterator[OperatorProcess]:
    restricted_namespace(control_plane, cp_namespace)
    running = OperatorProcess(identity.kubeconfig, [cp_namespace], tmp_path / "operator.log", COLLECTOR_ARGS)
    running.start()
    yield running
    running.stop()
    forbidden = running.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])
    assert "Traceback" not in running.log_text()


def service(name: str, **spec: Any) -> dict[str, Any]:
    body = {
        "model": {"uri": "hf://org/model"},
        "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "1Gi"},
        "mode": "disaggregated",
        "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
        "router": {"replicas": 1},
        "networkPolicy": {"clients": [GATEWAY]},
        **spec,
    }
    return {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def apply(cluster, namespace: str, body: dict[str, Any], check: bool = True):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body), check=check)


def policy(cluster, namespace: str, name: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", "networkpolicy", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def selected(cluster, namespace: str, np: dict[str, Any]) -> set[str]:
    """The pods the API server selects with the policy's podSelector (matchLabels only, as the builders write)."""
    labels = np["spec"]["podSelector"]["matchLabels"]
    return {p["metadata"]["name"] for p in pods(cluster, namespace, ",".join(f"{k}={v}" for k, v in labels.items()))}


def pod_names(cluster, namespace: str, selector: str) -> set[str]:
    return {p["metadata"]["name"] for p in pods(cluster, namespace, selector)}


def desired_policies(cluster, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    """What the builders want now for the stored InferenceService (the operator's collector identity)."""
    isvc = get_isvc(cluster, namespace, name)
    view = ServiceView.from_spec(isvc["spec"])
    children = desired_state(name, namespace, view, ClusterFeatures(collector=COLLECTOR)).children
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "NetworkPolicy"}


def test_policies_follow_the_spec(control_plane, cp_namespace, collector_operator):
    name = "np"
    apply(control_plane, cp_namespace, service(name))
    wait_until(lambda: is_ready(get_isvc(control_plane, cp_namespace, name)), 120, "the service Ready")
    engine_np = wait_until(lambda: policy(control_plane, cp_namespace, f"{name}-engine"), 60, "the engine policy")
    router_np = wait_until(lambda: policy(control_plane, cp_namespace, f"{name}-router"), 60, "the router policy")

    uid = get_isvc(control_plane, cp_namespace, name)["metadata"]["uid"]
    for np in (engine_np, router_np):
        assert [(r["kind"], r["uid"]) for r in np["metadata"]["ownerReferences"]] == [("InferenceService", uid)]
    # Stored as built: the reconcile's comparison finds nothing to re-apply (no drift loop at steady state).
    desired = desired_policies(control_plane, cp_namespace, name)
    assert set(desired) == {f"{name}-engine", f"{name}-router"}
    assert contains(engine_np, desired[f"{name}-engine"]) and contains(router_np, desired[f"{name}-router"])
    # The selectors pick exactly the service's engine pods (both pools) and its router pods.
    service_label = f"tidepool.dev/inferenceservice={name}"
    engines = pod_names(control_plane, cp_namespace, f"{service_label},tidepool.dev/pool in (prefill,decode)")
    routers = pod_names(control_plane, cp_namespace, f"{service_label},tidepool.dev/pool=router")
    assert len(engines) == 3 and len(routers) == 1
    assert selected(control_plane, cp_namespace, engine_np) == engines
    assert selected(control_plane, cp_namespace, router_np) == routers
    # The clients reach the router port; the engines' ingress names the router, the collector and the ranks.
    assert router_np["spec"]["ingress"][0] == {"from": [GATEWAY], "ports": [{"port": 8080, "protocol": "TCP"}]}
    sources = [rule["from"] for rule in engine_np["spec"]["ingress"]]
    assert GATEWAY not in [peer for peers in sources for peer in peers]
    assert [p for peers in sources for p in peers if "ipBlock" in p] == [{"ipBlock": {"cidr": "127.0.0.1/32"}}]

    # A hand edit is reverted.
    patch = {"spec": {"ingress": [{"from": [{"podSelector": {}}]}]}}
    control_plane.kubectl(
        "patch", "networkpolicy", f"{name}-engine", "-n", cp_namespace, "--type=merge", "-p", json.dumps(patch)
    )
    wait_until(
        lambda: contains(policy(control_plane, cp_namespace, f"{name}-engine") or {}, desired[f"{name}-engine"]),
        60,
        "the hand-edited policy reverted",
    )

    # Opting out deletes both; opting back in recreates them.
    off = {"spec": {"networkPolicy": {"enabled": False}}}
    control_plane.kubectl("patch", "inferenceservice", name, "-n", cp_namespace, "--type=merge", "-p", json.dumps(off))
    wait_until(
        lambda: all(policy(control_plane, cp_namespace, f"{name}-{part}") is None for part in ("engine", "router")),
        60,
        "both policies deleted",
    )
    on = {"spec": {"networkPolicy": {"enabled": True}}}
    control_plane.kubectl("patch", "inferenceservice", name, "-n", cp_namespace, "--type=merge", "-p", json.dumps(on))
    wait_until(
        lambda: all(policy(control_plane, cp_namespace, f"{name}-{part}") for part in ("engine", "router")),
        60,
        "both policies back",
    )


def test_without_a_router_clients_reach_the_engines(control_plane, cp_namespace, collector_operator):
    name = "direct"
    body = service(name, mode="unified", pools={"unified": {"replicas": 1}}, router={"enabled": False})
    apply(control_plane, cp_namespace, body)
    engine_np = wait_until(lambda: policy(control_plane, cp_namespace, f"{name}-engine"), 120, "the engine policy")
    assert policy(control_plane, cp_namespace, f"{name}-router") is None
    assert {"from": [GATEWAY], "ports": [{"port": 8000, "protocol": "TCP"}]} in engine_np["spec"]["ingress"]
    assert contains(engine_np, desired_policies(control_plane, cp_namespace, name)[f"{name}-engine"])


@pytest.mark.parametrize(
    ("clients", "rule_index", "field"),
    [
        ([{}], 0, None),
        ([{"podSelector": {"matchLabels": {"not a key": "x"}}}], 1, None),
        ([{"namespaceSelector": {"matchLabels": {"-team": "a"}}, "podSelector": {}}], 1, None),
        ([{"podSelector": {"matchLabels": {"app": "not a value"}}}], None, "matchLabels"),
        ([{"ipBlock": {"cidr": "10.0.0.0/8"}}], None, "ipBlock"),
    ],
)
def test_invalid_peers_are_refused_by_the_api_server(control_plane, cp_namespace, identity, clients, rule_index, field):
    out = apply(control_plane, cp_namespace, service("bad", networkPolicy={"clients": clients}), check=False)
    assert out.returncode != 0, out.stdout
    expected = NETPOL_RULES[rule_index].message if rule_index is not None else field
    assert expected in out.stderr, out.stderr
