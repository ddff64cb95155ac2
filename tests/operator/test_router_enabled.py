"""`spec.router.enabled` and the per-service cost of a service, from the builders and the controller (in-memory
API server): without a router no router object exists, the pool's Service (status.url) selects the serving pods
and Ready says there is no router; switching the router off prunes its children at once and switching it back
on recreates them; a disaggregated or scale-to-zero service must keep its router.

Per-service cost (issue #42), checked here for a minimal service (one unified replica, no autoscaler):
- with a router: the engine Deployment and Service, the router Deployment, Service, ServiceAccount and its
  RoleBinding (plus the NetworkPolicies of builders/netpol.py); no PodDisruptionBudget (a lone router's or a
  single-replica pool's budget protects nothing);
- without: the engine Deployment and its Service (plus the engine's NetworkPolicy), no router object, no RBAC.
Creating it costs one apply per child, one Created Event and the status writes; at steady state (pods ready,
syncs and full resyncs) it costs no API write at all.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from fake_api import NAME, NS, FakeApi, with_controller

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.api.rules import ROUTER_REQUIRED_MESSAGE, validate_spec
from tidepool.operator.builders import LABEL_POOL, ServiceView, desired_state
from tidepool.operator.controller import Controller
from tidepool.operator.status import NO_ROUTER_NOTE

MINIMAL: dict[str, Any] = {"model": {"uri": "hf://org/model"}, "resources": {"gpusPerReplica": 1}}
NO_ROUTER: dict[str, Any] = {**MINIMAL, "router": {"enabled": False}}
ENGINE = {("Deployment", f"{NAME}-unified"), ("Service", f"{NAME}-unified")}
ROUTER_ONLY_KINDS = {"ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"}  # none without a router here


def is_router(obj: dict[str, Any]) -> bool:
    return obj["metadata"]["labels"].get(LABEL_POOL) == "router"


def built(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    desired = desired_state(NAME, NS, ServiceView.from_spec(copy.deepcopy(spec)))
    return {(c["kind"], c["metadata"]["name"]): c for c in desired.children}


def sync(ctrl: Controller, full: bool = False) -> None:
    asyncio.run(ctrl.services.sync((NS, NAME), full))


def children_of(api: FakeApi) -> set[tuple[str, str]]:
    return {k for k in api.objects if k[0] not in ("InferenceService", "Pod")}


def make_ready(api: FakeApi) -> None:
    """Every workload's pods Ready on its current template (as the Deployment controller and kubelets would)."""
    for kind, name in sorted(children_of(api)):
        if kind == "Deployment":
            obj = api.objects[(kind, name)]
            pool = obj["spec"]["template"]["metadata"]["labels"][LABEL_POOL]
            for i in range(obj["spec"]["replicas"]):
                api.add_pod(f"{name}-{api.hash_of(name)}-{i}", pool, api.hash_of(name))


def test_without_a_router_the_pool_service_selects_the_serving_pods_and_is_the_url():
    view = ServiceView.from_spec(NO_ROUTER)
    desired = desired_state(NAME, NS, view)
    found = {(c["kind"], c["metadata"]["name"]): c for c in desired.children}
    assert set(found) >= ENGINE
    assert not any(is_router(c) or kind in ROUTER_ONLY_KINDS for (kind, _), c in found.items())  # nor a pool PDB
    assert desired.router is None
    assert desired.url == f"http://{NAME}-unified.{NS}.svc:8000"
    service, deployment = found[("Service", f"{NAME}-unified")], found[("Deployment", f"{NAME}-unified")]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_minimal_service_children_with_and_without_a_router():
    with_router, without = built(MINIMAL), built(NO_ROUTER)
    assert ENGINE <= set(without) < set(with_router)
    assert not any(kind in ROUTER_ONLY_KINDS for kind, _ in without)
    extra = set(with_router) - set(without)
    # What the router adds is the router's own and nothing else, and no budget where nothing needs one.
    assert all(is_router(with_router[k]) for k in extra)
    assert not any(is_router(c) for c in without.values())
    assert {("Deployment", f"{NAME}-router"), ("Service", f"{NAME}-router"), ("ServiceAccount", f"{NAME}-router"),
            ("RoleBinding", f"{NAME}-router")} <= extra  # fmt: skip
    assert not any(kind == "PodDisruptionBudget" for kind, _ in with_router)
    assert with_router[("Deployment", f"{NAME}-router")]["spec"]["replicas"] == 1  # automatic: one pool replica


@pytest.mark.parametrize(
    "spec",
    [
        {**NO_ROUTER, "mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}},
        {
            **NO_ROUTER,
            "autoscaling": {"enabled": True, "scaleToZero": {"enabled": True}},
            "pools": {"unified": {"minReplicas": 0}},
        },
    ],
    ids=["disaggregated", "scale-to-zero"],
)
def test_a_service_that_needs_its_router_cannot_turn_it_off(spec):
    assert ROUTER_REQUIRED_MESSAGE in validate_spec(InferenceServiceSpec.model_validate(spec))
    assert validate_spec(InferenceServiceSpec.model_validate({**spec, "router": {"enabled": True}})) == []


@pytest.mark.parametrize("spec", [MINIMAL, NO_ROUTER], ids=["router", "no-router"])
def test_creating_a_minimal_service_costs_one_apply_per_child_and_nothing_at_steady_state(spec):
    api, ctrl = with_controller(spec)
    sync(ctrl)
    children = children_of(api)
    assert children == set(built(spec))
    assert api.calls["apply"] == len(children) and api.calls["delete"] == 0
    assert [e["reason"] for e in api.events] == ["Created"]
    make_ready(api)
    sync(ctrl)
    assert api.condition("Ready")["status"] == "True"
    writes = sum(api.calls.values())
    for full in (False, True, False, True):
        sync(ctrl, full)
    assert sum(api.calls.values()) == writes, api.calls  # steady state: no API write


def test_switching_the_router_off_prunes_its_children_and_on_recreates_them():
    api, ctrl = with_controller(MINIMAL)
    sync(ctrl)
    make_ready(api)
    sync(ctrl)
    with_router = children_of(api)
    router_children = {k for k in with_router if is_router(api.objects[k])}
    assert router_children and api.service()["status"]["url"] == f"http://{NAME}-router.{NS}.svc"
    assert NO_ROUTER_NOTE not in api.condition("Ready")["message"]

    api.put_service(NO_ROUTER, generation=2)
    sync(ctrl)
    assert children_of(api) == with_router - router_children == set(built(NO_ROUTER))  # pruned now
    assert api.calls["delete"] == len(router_children)
    status = api.service()["status"]
    assert status["url"] == f"http://{NAME}-unified.{NS}.svc:8000" and status["observedGeneration"] == 2
    ready = api.condition("Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 2 and NO_ROUTER_NOTE in ready["message"]
    assert "Pruned" in [e["reason"] for e in api.events]
    for _, pod in [k for k in api.objects if k[0] == "Pod" and is_router(api.objects[k])]:
        api.remove_pod(pod)  # the garbage collector takes the pruned Deployment's pods

    api.put_service(MINIMAL, generation=3)
    sync(ctrl)
    assert children_of(api) == with_router
    assert api.service()["status"]["url"] == f"http://{NAME}-router.{NS}.svc"
    assert api.condition("Ready")["status"] == "False"  # the new router has no ready pod yet
    make_ready(api)
    sync(ctrl)
    ready = api.condition("Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 3 and NO_ROUTER_NOTE not in ready["message"]
