"""The InferencePool builder (Gateway API Inference Extension) and the llm-d role labels on engine pods.

Checked against the pods the workloads would run: the pool's selector matches every serving pod
(unified, or decode when disaggregated; rank 0 only in multi-node replicas) and nothing else (prefill,
ranks > 0, the router); its one target port is the engine container's HTTP port; it is owned by the
InferenceService and appears only when the CRD is installed and spec.inferencePool is set and enabled.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_builders import DISAGG, MULTI_NODE, UNIFIED, build, by_key, engine_container, pod_specs, spec

from tidepool.operator.builders import ClusterFeatures
from tidepool.operator.builders.common import ENGINE_PORT, LLMD_ROLE_LABEL, POD_INDEX_LABEL
from tidepool.operator.builders.engine import LWS_WORKER_INDEX_LABEL
from tidepool.operator.builders.inference_pool import API_VERSION
from tidepool.operator.reconcile import owner_reference, plan

GATEWAY = ClusterFeatures(has_inference_pool=True)
PICKER = {"endpointPicker": {"name": "svc-epp"}}


def with_pool(base: dict[str, Any], **pool: Any) -> dict[str, Any]:
    return spec(base, inferencePool={**PICKER, **pool})


def the_pool(children: list[dict[str, Any]]) -> dict[str, Any]:
    (pool,) = [c for c in children if c["kind"] == "InferencePool"]
    return pool


def matches(selector: dict[str, str], pod_labels: dict[str, str]) -> bool:
    return all(pod_labels.get(k) == v for k, v in selector.items())


def pods_by_pool(children: list[dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
    """(workload name, labels) of every pod the workloads would run, rank labels as their controllers add."""
    out = []
    for c in children:
        if c["kind"] not in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
            continue
        (tmpl,) = pod_specs([c])
        base = tmpl["metadata"]["labels"]
        if c["kind"] == "StatefulSet":
            out += [(c["metadata"]["name"], {**base, POD_INDEX_LABEL: str(r)}) for r in range(c["spec"]["replicas"])]
        elif c["kind"] == "LeaderWorkerSet":
            size = c["spec"]["leaderWorkerTemplate"]["size"]
            out += [(c["metadata"]["name"], {**base, LWS_WORKER_INDEX_LABEL: str(r)}) for r in range(size)]
        else:
            out.append((c["metadata"]["name"], dict(base)))
    return out


@pytest.mark.parametrize(
    ("s", "features", "serving"),
    [
        (with_pool(UNIFIED), GATEWAY, {"svc-unified": "all"}),
        (with_pool(DISAGG), GATEWAY, {"svc-decode": "all"}),
        (with_pool(MULTI_NODE), GATEWAY, {"svc-unified-g0": "0", "svc-unified-g1": "0"}),
        (with_pool(MULTI_NODE), ClusterFeatures(has_lws=True, has_inference_pool=True), {"svc-unified": "0"}),
    ],
    ids=["unified", "disaggregated-decode-only", "multi-node-statefulset-rank0", "multi-node-lws-leader"],
)
def test_selector_matches_exactly_the_serving_pods(s, features, serving):
    children = build(s, features)
    pool = the_pool(children)
    selector = pool["spec"]["selector"]["matchLabels"]
    # The pool selects what the pool's ClusterIP Service selects: the pods that serve HTTP.
    scaled = "decode" if s["mode"] == "disaggregated" else "unified"
    assert selector == by_key(children)[("Service", f"svc-{scaled}")]["spec"]["selector"]
    for workload, labels in pods_by_pool(children):
        rank = labels.get(POD_INDEX_LABEL, labels.get(LWS_WORKER_INDEX_LABEL, "0"))
        wanted = workload in serving and serving[workload] in ("all", rank)
        assert matches(selector, labels) == wanted, (workload, labels)
    router = by_key(children)[("Deployment", "svc-router")]["spec"]["template"]["metadata"]["labels"]
    assert not matches(selector, router)


def test_target_port_is_the_engine_http_port_and_the_picker_is_referenced():
    children = build(
        with_pool(UNIFIED, endpointPicker={"name": "epp", "port": 9100, "failureMode": "FailOpen"}), GATEWAY
    )
    pool = the_pool(children)
    assert pool["apiVersion"] == API_VERSION and pool["metadata"]["name"] == "svc"
    assert pool["spec"]["targetPorts"] == [{"number": ENGINE_PORT}]
    http = {
        p["name"]: p["containerPort"]
        for p in engine_container(by_key(children)[("Deployment", "svc-unified")])["ports"]
    }
    assert http["http"] == ENGINE_PORT
    ref = pool["spec"]["endpointPickerRef"]
    assert ref == {"group": "", "kind": "Service", "name": "epp", "port": {"number": 9100}, "failureMode": "FailOpen"}
    assert pool["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tidepool-operator"


def test_owned_by_the_inference_service_for_garbage_collection():
    owner = owner_reference("svc", "uid-1")
    pool = the_pool(build(with_pool(UNIFIED), GATEWAY, owner=owner))
    assert pool["metadata"]["ownerReferences"] == [owner]
    assert owner["controller"] is True


@pytest.mark.parametrize(
    ("s", "features"),
    [
        (with_pool(UNIFIED), ClusterFeatures()),  # no CRD
        (spec(UNIFIED), GATEWAY),  # no spec.inferencePool: no picker to name
        (with_pool(UNIFIED, enabled=False), GATEWAY),  # opted out
    ],
    ids=["crd-missing", "not-asked-for", "disabled"],
)
def test_no_pool_unless_the_crd_exists_and_the_spec_asks(s, features):
    assert not [c for c in build(s, features) if c["kind"] == "InferencePool"]


def test_turning_it_off_prunes_the_pool_at_once():
    before = build(with_pool(UNIFIED), GATEWAY, owner=owner_reference("svc", "u"))
    after = build(with_pool(UNIFIED, enabled=False), GATEWAY, owner=owner_reference("svc", "u"))
    observed = {(c["kind"], c["metadata"]["name"]): c for c in before}
    todo = plan(after, observed)
    assert [(o["kind"], o["metadata"]["name"]) for o in todo.prune] == [("InferencePool", "svc")]
    # The one other change: the engines' NetworkPolicy no longer lets the gateway's clients in (builders/netpol.py).
    assert not todo.deferred and [(o["kind"], o["metadata"]["name"]) for o in todo.apply] == [
        ("NetworkPolicy", "svc-engine")
    ]


def test_a_mode_switch_keeps_the_pool_and_moves_its_selector_to_decode():
    before = build(with_pool(UNIFIED), GATEWAY)
    after = build(with_pool(DISAGG), GATEWAY)
    observed = {(c["kind"], c["metadata"]["name"]): c for c in before}
    todo = plan(after, observed)
    assert ("InferencePool", "svc") in {(o["kind"], o["metadata"]["name"]) for o in todo.apply}
    assert all(o["kind"] != "InferencePool" for o in todo.prune + todo.deferred)
    assert the_pool(after)["spec"]["selector"]["matchLabels"]["tidepool.dev/pool"] == "decode"


@pytest.mark.parametrize(
    ("s", "roles"),
    [(spec(UNIFIED), {"svc-unified": "both"}), (spec(DISAGG), {"svc-prefill": "prefill", "svc-decode": "decode"})],
    ids=["unified-both", "disaggregated"],
)
def test_engine_pods_carry_the_llm_d_role(s, roles):
    children = build(s, ClusterFeatures())
    found = {name: labels.get(LLMD_ROLE_LABEL) for name, labels in pods_by_pool(children) if name != "svc-router"}
    assert found == roles
    router = by_key(children)[("Deployment", "svc-router")]["spec"]["template"]["metadata"]["labels"]
    assert LLMD_ROLE_LABEL not in router
