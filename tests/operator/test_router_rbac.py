"""The router's RBAC: a RoleBinding to the chart's ClusterRole (--router-cluster-role), no Role per service, and
the migration of what older operators left (a Role `<name>-router` and a RoleBinding of that name naming it).

Against the in-memory API server of fake_api.py, which refuses a roleRef change as the real one does (422), so a
plan that re-applied an old binding in place would fail here. Against a real API server, under the chart's own
RBAC: tests/controlplane/test_cp_chart_rbac.py.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from typing import Any

import pytest
from fake_api import NAME, NS, UID, with_controller
from test_builders import CASES, build

from tidepool.operator.builders import KIND_ORDER, ClusterFeatures
from tidepool.operator.builders.network import router_rbac
from tidepool.operator.controller import Controller
from tidepool.operator.features import watched_kinds
from tidepool.operator.legacy import LEGACY_CHILD_KINDS
from tidepool.operator.main import build_parser
from tidepool.operator.reconcile import plan

ROUTER = f"{NAME}-router"
RBAC = "rbac.authorization.k8s.io"
LABELS = {"tidepool.dev/inferenceservice": NAME, "tidepool.dev/pool": "router", "app.kubernetes.io/name": "tidepool"}
OWNER = [{"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "name": NAME, "uid": UID,
          "controller": True}]  # fmt: skip


def sync(ctrl: Controller, full: bool = False) -> None:
    asyncio.run(ctrl.services.sync((NS, NAME), full))


def legacy_children() -> list[dict[str, Any]]:
    """What an operator before the chart's router ClusterRole created for the router, as the server holds it."""
    meta = {"name": ROUTER, "namespace": NS, "labels": dict(LABELS), "ownerReferences": copy.deepcopy(OWNER)}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {**copy.deepcopy(meta), "uid": "uid-old-role", "resourceVersion": "1"},
        "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {**copy.deepcopy(meta), "uid": "uid-old-binding", "resourceVersion": "2"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER},
        "subjects": [{"kind": "ServiceAccount", "name": ROUTER, "namespace": NS}],
    }
    return [role, binding]


def test_the_router_binds_the_cluster_role_it_is_given():
    sa, binding = router_rbac("svc", "team", "my-router-role")
    assert sa["kind"] == "ServiceAccount" and binding["kind"] == "RoleBinding"
    assert binding["metadata"]["name"] == sa["metadata"]["name"] == "svc-router"
    assert binding["metadata"]["namespace"] == "team"
    assert binding["roleRef"] == {"apiGroup": RBAC, "kind": "ClusterRole", "name": "my-router-role"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "svc-router", "namespace": "team"}]


@pytest.mark.parametrize(("body", "features", "expected", "_layouts"), CASES)
def test_no_service_builds_a_role_and_every_router_binding_names_the_flagged_cluster_role(
    body, features, expected, _layouts
):
    children = build(body, replace(features, router_cluster_role="chart-router"))
    assert not [c for c in children if c["kind"] == "Role"]
    assert (("RoleBinding", "svc-router") in expected) == (("Deployment", "svc-router") in expected)
    for binding in (c for c in children if c["kind"] == "RoleBinding"):
        assert binding["roleRef"]["kind"] == "ClusterRole" and binding["roleRef"]["name"] == "chart-router"


def test_legacy_kinds_stay_watched_and_ordered_so_that_they_are_pruned():
    for kind in LEGACY_CHILD_KINDS:
        assert kind in watched_kinds(ClusterFeatures()) and kind in KIND_ORDER


def test_the_flag_sets_the_cluster_role_and_refuses_an_empty_one():
    from tidepool.operator.main import _invalid_number

    assert build_parser().parse_args([]).router_cluster_role == ClusterFeatures().router_cluster_role
    args = build_parser().parse_args(["--router-cluster-role", "rel-tidepool-router"])
    assert args.router_cluster_role == "rel-tidepool-router" and _invalid_number(args) is None
    assert "--router-cluster-role" in (_invalid_number(build_parser().parse_args(["--router-cluster-role="])) or "")


def test_plan_replaces_a_binding_whose_role_ref_changed_and_prunes_the_old_role():
    role, old_binding = legacy_children()
    observed = {("Role", ROUTER): role, ("RoleBinding", ROUTER): old_binding}
    (_, binding) = router_rbac(NAME, NS, "tidepool-router")
    todo = plan([binding], observed)
    assert [o["metadata"]["uid"] for o in todo.replace] == ["uid-old-binding"]
    assert todo.apply == [binding] and [o["kind"] for o in todo.prune] == ["Role"]
    assert ("Normal", "Replaced", f"RoleBinding {ROUTER}: roleRef Role/{ROUTER} -> ClusterRole/tidepool-router") in (
        todo.events
    )
    # The same roleRef: nothing to replace, and a subject edit is an ordinary re-apply.
    current = {**copy.deepcopy(binding), "metadata": {**binding["metadata"], "uid": "u"}}
    assert not plan([binding], {("RoleBinding", ROUTER): current}).replace
    current["subjects"] = []
    edited = plan([binding], {("RoleBinding", ROUTER): current})
    assert not edited.replace and edited.apply == [binding]


def test_an_upgraded_operator_migrates_an_older_operators_router_rbac_at_its_first_sync():
    api, ctrl = with_controller()
    for obj in legacy_children():
        api.objects[(obj["kind"], obj["metadata"]["name"])] = obj
        api.store.put(copy.deepcopy(obj))
    sync(ctrl)
    assert ("Role", ROUTER) not in api.objects
    binding = api.objects[("RoleBinding", ROUTER)]
    assert binding["roleRef"] == {"apiGroup": RBAC, "kind": "ClusterRole", "name": "tidepool-router"}
    assert binding["metadata"]["uid"] != "uid-old-binding"  # deleted, then created: a roleRef cannot change
    reasons = [e["reason"] for e in api.events]
    assert "Replaced" in reasons and "Pruned" in reasons
    assert api.calls["delete"] == 2
    writes = sum(api.calls.values())
    sync(ctrl, full=True)  # migrated once: the resync finds nothing to change
    assert sum(api.calls.values()) == writes, api.calls


def test_a_new_router_cluster_role_flag_recreates_each_binding():
    api, ctrl = with_controller()
    sync(ctrl)
    assert api.objects[("RoleBinding", ROUTER)]["roleRef"]["name"] == "tidepool-router"
    ctrl.services.features = replace(ctrl.services.features, router_cluster_role="other-router")
    sync(ctrl, full=True)
    assert api.objects[("RoleBinding", ROUTER)]["roleRef"]["name"] == "other-router"
    assert "Replaced" in [e["reason"] for e in api.events]
