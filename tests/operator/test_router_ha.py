"""Router availability and per-pool disruption budgets, from the pure builders: two routers where any pool can
exceed one replica (one otherwise, router.replicas winning when set), spread across nodes and zones, rolled
without losing one, a PodDisruptionBudget from two routers that keeps one up (none for a lone router); each
pool's PDB from its disruptionBudget (exactly one bound), unset: maxUnavailable 1 where the pool can exceed one
replica, none for a single replica."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.api.availability import ONE_OF_MESSAGE
from tidepool.operator.api.router import ROUTER_REPLICAS_MESSAGE
from tidepool.operator.api.rules import validate_spec
from tidepool.operator.builders import ServiceView, desired_state
from tidepool.operator.crdgen import build_crd

BASE: dict[str, Any] = {"model": {"uri": "hf://org/model"}, "pools": {"unified": {"replicas": 2}}}
DISAGG: dict[str, Any] = {
    "model": {"uri": "hf://org/model"},
    "mode": "disaggregated",
    "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 3, "maxReplicas": 8}},
}


def children(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    built = desired_state("svc", "ns", ServiceView.from_spec(json.loads(json.dumps(spec)))).children
    return {(c["kind"], c["metadata"]["name"]): c for c in built}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_two_spread_routers_by_default_rolled_without_losing_one():
    found = children(BASE)
    router = found[("Deployment", "svc-router")]
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = router["spec"]["template"]
    assert pod["spec"]["enableServiceLinks"] is False  # no env vars per Service of the namespace
    spread = pod["spec"]["topologySpreadConstraints"]
    assert [(c["topologyKey"], c["whenUnsatisfiable"], c["maxSkew"]) for c in spread] == [
        ("kubernetes.io/hostname", "ScheduleAnyway", 1),
        ("topology.kubernetes.io/zone", "ScheduleAnyway", 1),
    ]
    for constraint in spread:  # counts the router's own pods, never the engines'
        assert matches(constraint["labelSelector"]["matchLabels"], pod["metadata"]["labels"])
        engine_labels = found[("Deployment", "svc-unified")]["spec"]["template"]["metadata"]["labels"]
        assert not matches(constraint["labelSelector"]["matchLabels"], engine_labels)
        assert constraint["matchLabelKeys"] == ["pod-template-hash"]


SINGLE: dict[str, Any] = {"model": {"uri": "hf://org/model"}}  # one unified replica, no autoscaler


@pytest.mark.parametrize(
    ("spec", "routers"),
    [
        (SINGLE, 1),
        (BASE, 2),  # pools.unified.replicas 2
        ({**SINGLE, "replicas": 3}, 2),  # the scale subresource's spec.replicas
        ({**SINGLE, "autoscaling": {"enabled": True}}, 2),  # the autoscaler may take it to maxReplicas 4
        ({**SINGLE, "autoscaling": {"enabled": True, "mode": "external"}, "replicas": 1}, 2),  # HPA/KEDA may too
        ({**SINGLE, "autoscaling": {"enabled": True, "mode": "advisory"}}, 1),  # advisory never scales
        ({**SINGLE, "autoscaling": {"enabled": True}, "pools": {"unified": {"maxReplicas": 1}}}, 1),
        (DISAGG, 2),
        ({**DISAGG, "pools": {"prefill": {}, "decode": {}}}, 2),  # disaggregated: always two
        ({**BASE, "router": {"replicas": 1}}, 1),  # explicit wins
        ({**SINGLE, "router": {"replicas": 3}}, 3),
    ],
    ids=lambda v: "" if isinstance(v, dict) else str(v),
)
def test_router_replicas_default_to_two_where_any_pool_can_exceed_one(spec, routers):
    found = children(spec)
    assert found[("Deployment", "svc-router")]["spec"]["replicas"] == routers
    assert desired_state("svc", "ns", ServiceView.from_spec(spec)).router.desired == routers
    assert (("PodDisruptionBudget", "svc-router") in found) == (routers >= 2)


def test_router_replicas_zero_is_refused_pointing_at_enabled_false():
    for spec in (BASE, DISAGG):
        model = InferenceServiceSpec.model_validate({**spec, "router": {"replicas": 0}})
        assert validate_spec(model) == [ROUTER_REPLICAS_MESSAGE]
    assert "router.enabled: false" in ROUTER_REPLICAS_MESSAGE


@pytest.mark.parametrize(("replicas", "budget"), [(2, {"minAvailable": 1}), (5, {"minAvailable": 1}), (1, None)])
def test_the_router_budget_keeps_one_up_and_a_lone_router_has_none(replicas, budget):
    found = children({**BASE, "router": {"replicas": replicas}})
    pdb = found.get(("PodDisruptionBudget", "svc-router"))
    if budget is None:
        assert pdb is None  # minAvailable 1 would block every drain of its node; maxUnavailable 1 protects nothing
        assert found[("Deployment", "svc-router")]["spec"]["replicas"] == replicas
        return
    spec = dict(pdb["spec"])
    selector = spec.pop("selector")["matchLabels"]
    assert spec == budget
    router_labels = found[("Deployment", "svc-router")]["spec"]["template"]["metadata"]["labels"]
    assert matches(selector, router_labels)
    assert not matches(selector, found[("Deployment", "svc-unified")]["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize(
    ("spec", "budget"),
    [
        (SINGLE, None),  # one replica, nothing to scale it: no PDB
        ({**SINGLE, "pools": {"unified": {"disruptionBudget": {"minAvailable": 1}}}}, {"minAvailable": 1}),  # asked
        ({**SINGLE, "pools": {"unified": {"disruptionBudget": {"maxUnavailable": 1}}}}, {"maxUnavailable": 1}),
        ({**SINGLE, "autoscaling": {"enabled": True}}, {"maxUnavailable": 1}),  # may grow to maxReplicas 4
        ({**SINGLE, "autoscaling": {"enabled": True, "mode": "advisory"}}, None),
        ({**SINGLE, "replicas": 2}, {"maxUnavailable": 1}),
        (BASE, {"maxUnavailable": 1}),
    ],
    ids=lambda v: "" if isinstance(v, dict) else str(v),
)
def test_a_pool_has_a_default_budget_only_where_it_can_exceed_one_replica(spec, budget):
    pdb = children(spec).get(("PodDisruptionBudget", "svc-unified"))
    assert (pdb and {k: v for k, v in pdb["spec"].items() if k != "selector"}) == budget


def test_pool_budgets_default_to_max_unavailable_one_and_follow_each_pools_disruption_budget():
    assert children(BASE)[("PodDisruptionBudget", "svc-unified")]["spec"]["maxUnavailable"] == 1
    spec = json.loads(json.dumps(DISAGG))
    spec["pools"]["decode"]["disruptionBudget"] = {"minAvailable": "50%"}
    spec["pools"]["prefill"]["disruptionBudget"] = {"maxUnavailable": 0}
    found = children(spec)
    decode, prefill = (found[("PodDisruptionBudget", f"svc-{p}")]["spec"] for p in ("decode", "prefill"))
    assert {k: v for k, v in decode.items() if k != "selector"} == {"minAvailable": "50%"}
    assert {k: v for k, v in prefill.items() if k != "selector"} == {"maxUnavailable": 0}
    decode_pods = found[("Deployment", "svc-decode")]["spec"]["template"]["metadata"]["labels"]
    assert matches(decode["selector"]["matchLabels"], decode_pods)
    assert not matches(prefill["selector"]["matchLabels"], decode_pods)


@pytest.mark.parametrize(
    "budget",
    [{}, {"maxUnavailable": 1, "minAvailable": 1}, {"maxUnavailable": "10%", "minAvailable": "90%"}],
    ids=["neither", "both-counts", "both-percent"],
)
def test_a_budget_sets_exactly_one_bound(budget):
    spec = InferenceServiceSpec.model_validate({**BASE, "pools": {"unified": {"disruptionBudget": budget}}})
    assert validate_spec(spec) == [ONE_OF_MESSAGE]


@pytest.mark.parametrize("bad", [-1, "150", "half", "1.5%"])
def test_a_budget_bound_is_a_count_or_percent(bad):
    with pytest.raises(ValueError, match="disruptionBudget"):
        InferenceServiceSpec.model_validate({**BASE, "pools": {"unified": {"disruptionBudget": {"minAvailable": bad}}}})


def test_the_crd_carries_the_rule_and_the_router_default():
    crd = build_crd()  # what `tidepool crds` writes (test_crd.py keeps the files in sync with it)
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    router = spec["router"]["properties"]
    assert "default" not in router["replicas"] and router["enabled"]["default"] is True  # replicas: automatic
    assert ROUTER_REPLICAS_MESSAGE in {r["message"] for r in spec["router"]["x-kubernetes-validations"]}
    for pool in ("unified", "prefill", "decode"):
        budget = spec["pools"]["properties"][pool]["properties"]["disruptionBudget"]
        assert {r["message"] for r in budget["x-kubernetes-validations"]} == {ONE_OF_MESSAGE}
        assert "blocks the drain" in spec["pools"]["properties"][pool]["properties"]["disruptionBudget"]["description"]
