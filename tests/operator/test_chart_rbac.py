"""The chart's RBAC for routers and tenants, offline (`helm template`; marked `k8sbin` like test_chart.py).

The router ClusterRole ("<fullname>-router") is what the operator's --router-cluster-role names and the one
ClusterRole the operator may bind; the tenant roles ("<fullname>-edit", "<fullname>-view") name only
InferenceServices and aggregate into the built-in edit/admin and view. Against a real API server, with
tenants and the operator: tests/controlplane/test_cp_chart_rbac.py.
"""

from __future__ import annotations

import functools
import subprocess
from typing import Any

import pytest
import yaml
from test_chart import CHART, _by_kind, render

from controlplane_fixture import load_devcluster
from tidepool.cli import build_parser as tidepool_parser
from tidepool.operator.builders import ClusterFeatures
from tidepool.operator.main import build_parser as operator_parser

pytestmark = pytest.mark.k8sbin

RBAC = "rbac.authorization.k8s.io"
AGGREGATE = f"{RBAC}/aggregate-to-"


@functools.cache
def _helm() -> str:
    """The cached helm binary (test_chart.py's `helm` fixture, which a second file may not define again)."""
    devcluster = load_devcluster()
    try:
        return str(devcluster.find_bin_dir() / "helm")
    except devcluster.BinariesMissingError as exc:
        pytest.fail(str(exc), pytrace=False)


def _roles(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _by_kind(docs, "ClusterRole")}


def _operator_args(docs: list[dict[str, Any]]) -> Any:
    (deployment,) = _by_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return operator_parser().parse_args(tidepool_parser().parse_args(container["args"]).args)


def _render_release(helm: str, release: str) -> list[dict[str, Any]]:
    args = [helm, "template", release, str(CHART), "--namespace", "tidepool-system"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize(("release", "fullname"), [("tp", "tp-tidepool"), ("tidepool", "tidepool")])
def test_the_operator_is_told_the_router_cluster_role_it_may_bind(release: str, fullname: str) -> None:
    docs = _render_release(_helm(), release)
    name = _operator_args(docs).router_cluster_role
    assert name == f"{fullname}-router"
    roles = _roles(docs)
    assert roles[name]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]
    binds = [r for r in roles[fullname]["rules"] if "bind" in r["verbs"]]
    assert binds == [{"apiGroups": [RBAC], "resources": ["clusterroles"], "verbs": ["bind"], "resourceNames": [name]}]
    if release == "tidepool":  # the operator's default is the chart's name for the documented release
        assert name == ClusterFeatures().router_cluster_role


def test_the_operator_writes_no_roles_and_holds_no_endpointslices() -> None:
    rules = _roles(render(_helm()))["tp-tidepool"]["rules"]
    granted: dict[str, set[str]] = {}
    for rule in rules:
        for resource in rule["resources"]:
            if RBAC in rule["apiGroups"]:
                granted.setdefault(resource, set()).update(rule["verbs"])
    assert granted["roles"] == {"list", "watch", "delete"}  # only an older operator's are pruned
    assert granted["rolebindings"] == {"list", "watch", "create", "patch", "delete"}
    assert granted["clusterroles"] == {"bind"}
    assert not any("endpointslices" in r["resources"] for r in rules)


def test_tenant_roles_name_only_inference_services_and_aggregate() -> None:
    roles = _roles(render(_helm()))
    edit, view = roles["tp-tidepool-edit"], roles["tp-tidepool-view"]
    assert {k: v for k, v in edit["metadata"]["labels"].items() if k.startswith(AGGREGATE)} == {
        f"{AGGREGATE}edit": "true",
        f"{AGGREGATE}admin": "true",
    }
    assert {k: v for k, v in view["metadata"]["labels"].items() if k.startswith(AGGREGATE)} == {
        f"{AGGREGATE}view": "true"
    }
    for role in (edit, view):
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["tidepool.dev"], rule
            assert all(r.split("/")[0] == "inferenceservices" for r in rule["resources"]), rule
            assert "*" not in rule["verbs"] and "resourceNames" not in rule, rule
    verbs = {r: set(rule["verbs"]) for rule in edit["rules"] for r in rule["resources"]}
    assert verbs["inferenceservices"] == {"get", "list", "watch", "create", "update", "patch", "delete"}
    assert verbs["inferenceservices/status"] == {"get", "list", "watch"}  # the operator's to write
    assert verbs["inferenceservices/scale"] == {"get", "update", "patch"}  # kubectl scale
    assert {v for rule in view["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}


def test_aggregate_false_leaves_out_the_tenant_roles_only() -> None:
    assert set(_roles(render(_helm(), "rbac.aggregate=false"))) == {"tp-tidepool", "tp-tidepool-router"}
    assert _roles(render(_helm(), "rbac.create=false")) == {}
