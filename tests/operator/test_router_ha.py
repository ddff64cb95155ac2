"""Router availability and per-pool disruption budgets, from the pure builders: two routers by default, spread
across nodes and zones, rolled without losing one, a PodDisruptionBudget that keeps one up (and never blocks a
drain of a lone router); each pool's PDB from its disruptionBudget (exactly one bound), maxUnavailable 1 unset."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.api.availability import ONE_OF_MESSAGE
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


@pytest.mark.parametrize(
    ("replicas", "budget"),
    [(2, {"minAvailable": 1}), (5, {"minAvailable": 1}), (1, {"maxUnavailable": 1}), (0, None)],
)
def test_the_router_budget_keeps_one_up_without_blocking_a_lone_routers_drain(replicas, budget):
    found = children({**BASE, "router": {"replicas": replicas}})
    pdb = found.get(("PodDisruptionBudget", "svc-router"))
    if budget is None:
        assert pdb is None  # no router pods: nothing to protect
        return
    spec = dict(pdb["spec"])
    selector = spec.pop("selector")["matchLabels"]
    assert spec == budget
    router_labels = found[("Deployment", "svc-router")]["spec"]["template"]["metadata"]["labels"]
    assert matches(selector, router_labels)
    assert not matches(selector, found[("Deployment", "svc-unified")]["spec"]["template"]["metadata"]["labels"])


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
    assert spec["router"]["properties"]["replicas"]["default"] == 2
    for pool in ("unified", "prefill", "decode"):
        budget = spec["pools"]["properties"][pool]["properties"]["disruptionBudget"]
        assert {r["message"] for r in budget["x-kubernetes-validations"]} == {ONE_OF_MESSAGE}
        assert "blocks the drain" in spec["pools"]["properties"][pool]["properties"]["disruptionBudget"]["description"]
