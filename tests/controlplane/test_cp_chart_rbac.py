"""The chart's tenant and router RBAC against a real API server (authorization mode Node,RBAC).

Tenants are users the admin impersonates (`kubectl --as`), asked about through SubjectAccessReviews (the
authorizer's own answer) and, for each refusal that matters, a real request that must come back 403:
- `<fullname>-edit` bound in namespace a by a RoleBinding: InferenceServices created in a, nothing in b, no
  Secrets nor pods' logs in b (nor in a: the role names only InferenceServices);
- `<fullname>-view`: read, never create;
- aggregation: the built-in `edit` bound in a is enough to create InferenceServices (the controller-manager's
  ClusterRole aggregation copies the chart's rules into it).
The operator, running with only the chart's RBAC (conftest `identity`), binds the router ClusterRole per service
(it holds `bind` on that name only) and, at its first sync, replaces what an older operator left: a Role
`<name>-router` and a RoleBinding naming it (operator/legacy.py). Its log must hold no refusal.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_kit import (
    CHART,
    OPERATOR_NAMESPACE,
    OperatorIdentity,
    OperatorProcess,
    children,
    get_isvc,
    install_crd,
    load_example,
    wait_until,
)

from controlplane_fixture import wait_for
from tidepool.operator.builders import ClusterFeatures
from tidepool.operator.builders.common import ROUTER_POOL, child_name, labels

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

RBAC_GROUP = "rbac.authorization.k8s.io"


def _can(
    control_plane, user: str, verb: str, resource: str, namespace: str, groups: list[str] | None = None, name: str = ""
) -> bool:
    """The authorizer's answer for `user` (a SubjectAccessReview, what `kubectl auth can-i --as` asks)."""
    resource, _, sub = resource.partition("/")
    plural, _, group = resource.partition(".")
    attrs = {"verb": verb, "resource": plural, "group": group, "subresource": sub, "namespace": namespace}
    attrs["name"] = name
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview"}
    review["spec"] = {"user": user, "groups": groups or ["system:authenticated"], "resourceAttributes": attrs}
    api = client.AuthorizationV1Api(control_plane.api_client())
    return bool(api.create_subject_access_review(review).status.allowed)


def _as(control_plane, user: str, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return control_plane.kubectl(f"--as={user}", *args, input=input, check=False)


def _forbidden(out: subprocess.CompletedProcess) -> bool:
    return out.returncode != 0 and "forbidden" in out.stderr.lower()


def _isvc(name: str) -> str:
    obj = load_example("inferenceservice-unified.yaml")
    obj["metadata"] = {"name": name}
    return yaml.safe_dump(obj)


@pytest.fixture
def tenant_roles(control_plane) -> Iterator[str]:
    """The chart's tenant ClusterRoles of a fresh release, applied as rendered; yields the release's fullname."""
    install_crd(control_plane)
    release = f"tp{uuid.uuid4().hex[:6]}"
    out = subprocess.run(
        [str(control_plane.bin_dir / "helm"), "template", release, str(CHART), "--namespace", "tidepool-system"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    fullname = f"{release}-tidepool"
    names = {f"{fullname}-edit", f"{fullname}-view"}
    docs = [
        d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] in names
    ]
    assert len(docs) == 2, [d["metadata"]["name"] for d in docs]
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    try:
        yield fullname
    finally:
        for name in sorted(names):
            control_plane.kubectl("delete", "clusterrole", name, "--ignore-not-found", check=False)


@pytest.fixture
def namespace_b(control_plane) -> Iterator[str]:
    name = f"tenant-b-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_a_tenant_bound_to_edit_creates_inference_services_in_its_namespace_only(
    control_plane, cp_namespace, namespace_b, tenant_roles
):
    a, b, alice = cp_namespace, namespace_b, f"alice-{uuid.uuid4().hex[:4]}"
    control_plane.kubectl("create", "secret", "generic", "s", "-n", b, "--from-literal=k=v")
    control_plane.kubectl(
        "create", "rolebinding", "alice", f"--clusterrole={tenant_roles}-edit", f"--user={alice}", "-n", a
    )
    wait_for(lambda: _can(control_plane, alice, "create", "inferenceservices.tidepool.dev", a), 30, what="binding")

    allowed = {
        (verb, "inferenceservices.tidepool.dev", a) for verb in ("get", "list", "watch", "create", "patch", "delete")
    } | {("update", "inferenceservices.tidepool.dev/scale", a), ("get", "inferenceservices.tidepool.dev/status", a)}
    denied = {
        ("create", "inferenceservices.tidepool.dev", b),
        ("get", "secrets", b),
        ("list", "secrets", b),
        ("get", "pods/log", b),
        ("get", "secrets", a),
        ("get", "pods/log", a),
        ("create", "deployments.apps", a),
        ("patch", "inferenceservices.tidepool.dev/status", a),  # the operator's to write
    }
    answers = {(v, r, n): _can(control_plane, alice, v, r, n) for v, r, n in allowed | denied}
    wrong = {k: v for k, v in answers.items() if v != (k in allowed)}
    assert not wrong, wrong

    out = _as(control_plane, alice, "create", "-n", a, "-f", "-", input=_isvc("mine"))
    assert out.returncode == 0, out.stderr
    assert get_isvc(control_plane, a, "mine") is not None
    assert _forbidden(_as(control_plane, alice, "create", "-n", b, "-f", "-", input=_isvc("theirs")))
    assert _forbidden(_as(control_plane, alice, "get", "secret", "s", "-n", b))
    # Authorization comes before any lookup: a pod that does not exist still answers 403, not 404.
    assert _forbidden(_as(control_plane, alice, "get", "--raw", f"/api/v1/namespaces/{b}/pods/p/log"))
    # And what `kubectl auth can-i` tells the tenant (it exits 1 on "no").
    for question in (("get", "secrets"), ("get", "pods", "--subresource=log")):
        out = _as(control_plane, alice, "auth", "can-i", *question, "-n", b)
        assert out.returncode == 1 and out.stdout.strip() == "no", (question, out.stdout, out.stderr)
    out = _as(control_plane, alice, "auth", "can-i", "create", "inferenceservices.tidepool.dev", "-n", a)
    assert out.returncode == 0 and out.stdout.strip() == "yes", out.stderr


def test_a_tenant_bound_to_view_reads_but_never_creates(control_plane, cp_namespace, tenant_roles):
    a, bob = cp_namespace, f"bob-{uuid.uuid4().hex[:4]}"
    control_plane.kubectl("create", "-n", a, "-f", "-", input=_isvc("seen"))
    control_plane.kubectl(
        "create", "rolebinding", "bob", f"--clusterrole={tenant_roles}-view", f"--user={bob}", "-n", a
    )
    wait_for(lambda: _can(control_plane, bob, "list", "inferenceservices.tidepool.dev", a), 30, what="binding")
    for verb in ("create", "patch", "delete", "update"):
        assert not _can(control_plane, bob, verb, "inferenceservices.tidepool.dev", a), verb
    assert not _can(control_plane, bob, "update", "inferenceservices.tidepool.dev/scale", a)
    got = _as(control_plane, bob, "get", "inferenceservice", "seen", "-n", a, "-o", "json")
    assert got.returncode == 0 and json.loads(got.stdout)["metadata"]["name"] == "seen", got.stderr
    assert _forbidden(_as(control_plane, bob, "create", "-n", a, "-f", "-", input=_isvc("not-mine")))
    assert _forbidden(_as(control_plane, bob, "delete", "inferenceservice", "seen", "-n", a))


def test_the_built_in_edit_and_view_roles_aggregate_the_tenant_roles(control_plane, cp_namespace, tenant_roles):
    a, carol, dave = cp_namespace, f"carol-{uuid.uuid4().hex[:4]}", f"dave-{uuid.uuid4().hex[:4]}"
    control_plane.kubectl("create", "rolebinding", "carol", "--clusterrole=edit", f"--user={carol}", "-n", a)
    control_plane.kubectl("create", "rolebinding", "dave", "--clusterrole=view", f"--user={dave}", "-n", a)
    # The controller-manager aggregates the labelled ClusterRoles into edit/admin/view a moment after they appear.
    wait_for(lambda: _can(control_plane, carol, "create", "inferenceservices.tidepool.dev", a), 60, what="edit")
    wait_for(lambda: _can(control_plane, dave, "list", "inferenceservices.tidepool.dev", a), 60, what="view")
    edit_rules = json.loads(control_plane.kubectl("get", "clusterrole", "edit", "-o", "json").stdout)["rules"]
    assert any("tidepool.dev" in r.get("apiGroups", []) and "create" in r["verbs"] for r in edit_rules), edit_rules
    out = _as(control_plane, carol, "create", "-n", a, "-f", "-", input=_isvc("via-edit"))
    assert out.returncode == 0, out.stderr
    assert not _can(control_plane, dave, "create", "inferenceservices.tidepool.dev", a)
    assert _forbidden(_as(control_plane, dave, "create", "-n", a, "-f", "-", input=_isvc("via-view")))


def test_with_watch_namespaces_the_operator_binds_the_router_cluster_role_only_there(
    control_plane, cp_namespace, namespace_b
):
    """The operator's ClusterRole bound per watched namespace (a RoleBinding) still carries `bind`: the API
    server's escalation check for a router's RoleBinding asks in that namespace."""
    a, b, release = cp_namespace, namespace_b, f"tp{uuid.uuid4().hex[:6]}"
    out = subprocess.run(
        [str(control_plane.bin_dir / "helm"), "template", release, str(CHART), "--namespace", a,
         "--set", "watchNamespaces={" + a + "}", "--set", "rbac.aggregate=false"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    kinds = ("ServiceAccount", "ClusterRole", "RoleBinding")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] in kinds]
    fullname, router_role = f"{release}-tidepool", f"{release}-tidepool-router"
    try:
        control_plane.kubectl("apply", "-n", a, "-f", "-", input=yaml.safe_dump_all(docs))
        operator_sa = f"system:serviceaccount:{a}:{fullname}"
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{a}", "system:authenticated"]
        roles = f"clusterroles.{RBAC_GROUP}"
        wait_for(lambda: _can(control_plane, operator_sa, "bind", roles, a, groups, name=router_role), 30, what="bind")
        assert not _can(control_plane, operator_sa, "bind", roles, b, groups, name=router_role)

        def binding(namespace: str) -> str:
            return json.dumps({
                "apiVersion": f"{RBAC_GROUP}/v1", "kind": "RoleBinding",
                "metadata": {"name": "x-router", "namespace": namespace},
                "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": router_role},
                "subjects": [{"kind": "ServiceAccount", "name": "x-router", "namespace": namespace}],
            })  # fmt: skip

        made = _as(control_plane, operator_sa, "create", "-f", "-", input=binding(a))
        assert made.returncode == 0, made.stderr
        assert _forbidden(_as(control_plane, operator_sa, "create", "-f", "-", input=binding(b)))
    finally:
        for name in (fullname, router_role):
            control_plane.kubectl("delete", "clusterrole", name, "--ignore-not-found", check=False)


def _legacy_router_rbac(name: str, namespace: str, uid: str) -> list[dict[str, Any]]:
    """What an operator before the router ClusterRole created for a service's router (same labels and owner)."""
    sa = child_name(name, ROUTER_POOL)
    meta = {
        "name": sa,
        "namespace": namespace,
        "labels": labels(name, ROUTER_POOL, "router"),
        "ownerReferences": [
            {
                "apiVersion": "tidepool.dev/v1alpha1",
                "kind": "InferenceService",
                "name": name,
                "uid": uid,
                "controller": True,
            }
        ],
    }
    rule = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    return [
        {"apiVersion": f"{RBAC_GROUP}/v1", "kind": "Role", "metadata": meta, "rules": [rule]},
        {
            "apiVersion": f"{RBAC_GROUP}/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": RBAC_GROUP, "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
        },
    ]


def test_the_operator_binds_the_router_cluster_role_and_replaces_an_older_operators_role(
    control_plane, cp_namespace, namespace_b, identity: OperatorIdentity, tmp_path: Path
):
    ns, name = cp_namespace, "migrated"
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=_isvc(name))
    uid = get_isvc(control_plane, ns, name)["metadata"]["uid"]
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(_legacy_router_rbac(name, ns, uid)))
    router = child_name(name, ROUTER_POOL)
    cluster_role = ClusterFeatures().router_cluster_role
    assert ("Role", router) in children(control_plane, ns, name)

    running = OperatorProcess(identity.kubeconfig, [ns], tmp_path / "operator.log")
    running.start()
    try:

        def migrated() -> dict[str, Any] | None:
            found = children(control_plane, ns, name)
            binding = found.get(("RoleBinding", router))
            ref = (binding or {}).get("roleRef") or {}
            done = ("Role", router) not in found and ref.get("kind") == "ClusterRole"
            return binding if done else None

        binding = wait_until(migrated, 90, "the older Role pruned and the RoleBinding naming the ClusterRole")
        assert binding["roleRef"] == {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": cluster_role}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router, "namespace": ns}]
        router_sa = f"system:serviceaccount:{ns}:{router}"
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]
        wait_for(lambda: _can(control_plane, router_sa, "watch", "endpointslices.discovery.k8s.io", ns, groups), 30)
        assert not _can(control_plane, router_sa, "list", "endpointslices.discovery.k8s.io", namespace_b, groups)
        assert not _can(control_plane, router_sa, "get", "secrets", ns, groups)
        events = control_plane.kubectl(
            "get", "events", "-n", ns, "-o", "json", "--field-selector", f"involvedObject.name={name}"
        )  # fmt: skip
        reasons = {e["reason"] for e in json.loads(events.stdout)["items"]}
        assert {"Replaced", "Pruned"} <= reasons, reasons
        _operator_binds_only_the_router_cluster_role(control_plane, identity, ns, cluster_role)
    finally:
        running.stop()
    forbidden = running.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


def _operator_binds_only_the_router_cluster_role(
    control_plane, identity: OperatorIdentity, namespace: str, cluster_role: str
) -> None:
    """The operator's `bind` names one ClusterRole: binding any other with its token is refused (403)."""
    operator_sa = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{identity.service_account}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{OPERATOR_NAMESPACE}", "system:authenticated"]
    roles = f"clusterroles.{RBAC_GROUP}"
    assert _can(control_plane, operator_sa, "bind", roles, namespace, groups, name=cluster_role)
    for other in ("view", "edit", "admin"):
        assert not _can(control_plane, operator_sa, "bind", roles, namespace, groups, name=other), other
    binding = {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "not-the-router", "namespace": namespace},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": "view"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
    }
    kubectl = [str(control_plane.bin_dir / "kubectl"), f"--kubeconfig={identity.kubeconfig}"]
    out = subprocess.run(
        [*kubectl, "create", "-f", "-"], input=json.dumps(binding), capture_output=True, text=True, timeout=60
    )
    assert _forbidden(out), (out.stdout, out.stderr)
