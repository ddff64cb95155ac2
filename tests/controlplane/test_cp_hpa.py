"""`autoscaling.mode: external` under a real HorizontalPodAutoscaler on the real control plane.

kube-controller-manager's HPA controller scales the InferenceService through its scale subresource
on an External metric served by a stub aggregated API (metrics_api_stub.py: what KEDA's metrics server
serves). The stub's value drives the HPA up, then down; the HPA writes `spec.replicas`, the unified
Deployment follows, and the operator never writes replicas: every field manager of `spec.replicas`
is the HPA's (through the scale subresource), the operator never scrapes the service's pods (the
feed would tell) and never writes `status.autoscaling`, and the replicas stay wherever the HPA put
them although the feed offers load an active autoscaler would act on.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from metrics_api_stub import MetricsStub, register, unregister
from operator_kit import get_isvc, wait_until
from test_cp_autoscale import (
    apply,
    autoscaling_status,
    deployment_replicas,
    isvc,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(420)]
METRIC = "tidepool_test_queue"
OPERATOR_MANAGER = "tidepool-operator"  # k8s.FIELD_MANAGER; the operator's server-side applies


@pytest.fixture
def metrics_api(control_plane, cp_namespace):
    from controlplane_fixture import load_devcluster

    load_devcluster()
    import devcluster_pki

    pki_dir = control_plane.state_dir / "pki"
    names = ("ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "admin.crt", "admin.key", "sa.key", "sa.pub")
    pki = devcluster_pki.Pki(*(pki_dir / n for n in names))
    crt, key = devcluster_pki.sign(
        pki, "metrics-stub", "metrics-stub", server=True, dns=(f"metrics-stub.{cp_namespace}.svc",)
    )
    stub = MetricsStub(crt, key)
    try:
        register(control_plane, stub, cp_namespace, pki.ca_crt)
        yield stub
    finally:
        unregister(control_plane, cp_namespace)
        stub.close()


def hpa(name: str) -> dict:
    fast = {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15}]}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "name": name},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "External",
                    "external": {"metric": {"name": METRIC}, "target": {"type": "AverageValue", "averageValue": "1"}},
                }
            ],
            "behavior": {"scaleUp": fast, "scaleDown": fast},
        },
    }


def replicas_managers(obj: dict) -> set[tuple[str, str]]:
    """(manager, subresource) of every managedFields entry that owns spec.replicas."""
    return {
        (e["manager"], e.get("subresource", ""))
        for e in obj["metadata"].get("managedFields") or []
        if "f:replicas" in ((e.get("fieldsV1") or {}).get("f:spec") or {})
    }


def hpa_status(cluster, namespace: str, name: str) -> dict:
    out = cluster.kubectl("get", "hpa", name, "-n", namespace, "-o", "json")
    return json.loads(out.stdout).get("status") or {}


def test_a_real_hpa_scales_and_the_operator_never_writes_replicas(
    control_plane,
    cp_namespace,
    autoscaling_operator,
    feed,
    metrics_api,
):
    name = "hpa"
    scraped: list[str] = []
    body = feed.body
    feed.body = lambda namespace, service, pool: (scraped.append(service), body(namespace, service, pool))[1]
    feed.set("unified", kv=0.95, requests=5)  # an active autoscaler would grow the pool at once
    pool = {"replicas": 1, "minReplicas": 1, "maxReplicas": 6}
    obj = isvc(name, {"mode": "external", "kvCacheTarget": 0.5}, pool, gpus=1)
    obj["spec"]["replicas"] = 1  # external mode needs it: HPA and KEDA read it through GET .../scale
    apply(control_plane, cp_namespace, obj)
    wait_until(
        lambda: ((get_isvc(control_plane, cp_namespace, name) or {}).get("status") or {}).get("selector"),
        60,
        "status.selector, which the HPA reads through the scale subresource",
    )
    metrics_api.values[METRIC] = 3.0  # 3 per replica at a target of 1: the HPA wants 3
    control_plane.kubectl("apply", "-n", cp_namespace, "-f", "-", input=yaml.safe_dump(hpa(name)))

    for target in (3, 1):  # up on the metric, then down when it falls
        metrics_api.values[METRIC] = float(target)
        try:
            wait_until(
                lambda t=target: deployment_replicas(control_plane, cp_namespace, name) == t,
                120,
                f"the HPA scaling the InferenceService (and the Deployment) to {target}",
            )
        except AssertionError as exc:
            described = control_plane.kubectl("describe", "hpa", name, "-n", cp_namespace, check=False).stdout
            raise AssertionError(f"{exc}\n{described}\nstub requests: {metrics_api.requests[-5:]}") from None
        obj = get_isvc(control_plane, cp_namespace, name)
        assert obj["spec"]["replicas"] == target
        assert hpa_status(control_plane, cp_namespace, name).get("desiredReplicas") == target
        managers = replicas_managers(obj)
        assert managers and all(sub == "scale" for _, sub in managers), managers
        assert all(manager != OPERATOR_MANAGER for manager, _ in managers), managers
        deadline = time.monotonic() + 5  # several operator autoscaler intervals (1 s): nothing moves it
        while time.monotonic() < deadline:
            assert deployment_replicas(control_plane, cp_namespace, name) == target
            time.sleep(0.5)

    assert any(METRIC in path for path in metrics_api.requests)  # the HPA did read the stub
    assert autoscaling_status(control_plane, cp_namespace, name) == {}
    assert name not in scraped
    obj = get_isvc(control_plane, cp_namespace, name)
    owned = [e for e in obj["metadata"]["managedFields"] if e["manager"] == OPERATOR_MANAGER]
    assert all(e.get("subresource") == "status" for e in owned), owned  # the operator wrote status only
