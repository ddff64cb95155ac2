"""`spec.router.enabled` on the real control plane, with the operator as the chart's ServiceAccount.

A service created without a router gets no router object (Deployment, Service, ServiceAccount, RoleBinding,
PodDisruptionBudget); its status.url is the pool's Service, which selects the serving pods, and Ready says there
is no router. Switching the router on creates its children and moves the URL to the router Service; switching it
off again deletes them (the pods go with their Deployment) and the service stays Ready; on again recreates them.
The API server refuses router.enabled false where the router is required (disaggregated mode) and router.replicas 0,
naming the fix.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from operator_kit import children, condition, get_isvc, is_ready, pod_is_ready, pods, wait_until

from tidepool.operator.api.router import ROUTER_REPLICAS_MESSAGE
from tidepool.operator.api.rules import ROUTER_REQUIRED_MESSAGE
from tidepool.operator.status import NO_ROUTER_NOTE

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(420)]
POOL = "tidepool.dev/pool"


def service(name: str, **spec: Any) -> dict[str, Any]:
    body = {
        "model": {"uri": "hf://org/model"},
        "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "1Gi"},
        "pools": {"unified": {"replicas": 1}},
        "router": {"enabled": False},
        **spec,
    }
    return {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def ready_at(cluster, namespace: str, name: str, generation: int) -> dict[str, Any] | None:
    obj = get_isvc(cluster, namespace, name)
    return obj if obj and obj["metadata"]["generation"] == generation and is_ready(obj) else None


def router_children(cluster, namespace: str, name: str) -> set[tuple[str, str]]:
    found = children(cluster, namespace, name)
    return {k for k, obj in found.items() if obj["metadata"]["labels"].get(POOL) == "router"}


def set_router(cluster, namespace: str, name: str, enabled: bool) -> None:
    body = json.dumps({"spec": {"router": {"enabled": enabled}}})
    cluster.kubectl("patch", "inferenceservice", name, "-n", namespace, "--type=merge", "-p", body)


def test_router_off_on_off_on(control_plane, cp_namespace, operator):
    ns, name = cp_namespace, "lean"
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service(name)))
    obj = wait_until(lambda: ready_at(control_plane, ns, name, 1), 180, "Ready without a router")
    assert obj["status"]["url"] == f"http://{name}-unified.{ns}.svc:8000"
    assert NO_ROUTER_NOTE in condition(obj, "Ready")["message"]
    found = children(control_plane, ns, name)
    assert not router_children(control_plane, ns, name)
    assert not {kind for kind, _ in found} & {"ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"}
    # The URL's Service selects the serving pods themselves.
    selector = found[("Service", f"{name}-unified")]["spec"]["selector"]
    serving = pods(control_plane, ns, ",".join(f"{k}={v}" for k, v in selector.items()))
    assert [p["metadata"]["labels"][POOL] for p in serving] == ["unified"] and pod_is_ready(serving[0])

    set_router(control_plane, ns, name, True)
    obj = wait_until(lambda: ready_at(control_plane, ns, name, 2), 180, "Ready with its router")
    assert obj["status"]["url"] == f"http://{name}-router.{ns}.svc"
    assert NO_ROUTER_NOTE not in condition(obj, "Ready")["message"]
    made = router_children(control_plane, ns, name)
    assert {("Deployment", f"{name}-router"), ("Service", f"{name}-router"), ("ServiceAccount", f"{name}-router"),
            ("RoleBinding", f"{name}-router")} <= made  # fmt: skip
    assert ("PodDisruptionBudget", f"{name}-router") not in made  # one pool replica: one router, no budget
    routers = pods(control_plane, ns, f"tidepool.dev/inferenceservice={name},{POOL}=router")
    assert [pod_is_ready(p) for p in routers] == [True]

    set_router(control_plane, ns, name, False)
    wait_until(lambda: not router_children(control_plane, ns, name), 120, "the router's children deleted")
    obj = wait_until(lambda: ready_at(control_plane, ns, name, 3), 120, "Ready without a router again")
    assert obj["status"]["url"] == f"http://{name}-unified.{ns}.svc:8000"
    selector = f"tidepool.dev/inferenceservice={name},{POOL}=router"
    wait_until(lambda: not pods(control_plane, ns, selector), 120, "the router pods gone with their Deployment")
    assert condition(get_isvc(control_plane, ns, name), "Degraded")["status"] == "False"

    set_router(control_plane, ns, name, True)  # true -> false -> true: recreated as the first time
    obj = wait_until(lambda: ready_at(control_plane, ns, name, 4), 180, "Ready with its router again")
    assert router_children(control_plane, ns, name) == made
    assert obj["status"]["url"] == f"http://{name}-router.{ns}.svc"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}, "router": {"enabled": False}},
            ROUTER_REQUIRED_MESSAGE,
        ),
        ({"router": {"replicas": 0}}, ROUTER_REPLICAS_MESSAGE),
    ],
    ids=["disaggregated-without-router", "router-replicas-zero"],
)
def test_the_api_server_refuses_a_service_that_needs_its_router(control_plane, cp_namespace, identity, spec, message):
    obj = service("refused", **spec)
    out = control_plane.kubectl("apply", "-n", cp_namespace, "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr
