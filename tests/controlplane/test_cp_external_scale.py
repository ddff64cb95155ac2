"""`autoscaling.mode: external` on the real control plane: an HPA-like writer owns the scale subresource.

The writer is `kubectl scale` (what an HPA or KEDA does: it writes `spec.replicas` through the
scale subresource; a real HPA needs a metrics API this cluster does not run). The feed offers load
that would make Tidepool's autoscaler grow the pool, yet the operator never scrapes it, never
writes `status.autoscaling`, and the Deployment follows every scale write and stays there.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
from operator_kit import get_isvc, wait_until
from test_cp_autoscale import (
    apply,
    autoscaling_status,
    deployment_replicas,
    isvc,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]


def test_the_operator_never_fights_an_external_scaler(control_plane, cp_namespace, autoscaling_operator, feed):
    name = "ext"
    scraped: list[str] = []
    body = feed.body
    feed.body = lambda namespace, service, pool: (scraped.append(service), body(namespace, service, pool))[1]
    feed.set("unified", kv=0.95, requests=5)  # an active autoscaler would grow the pool at once
    pool = {"replicas": 1, "minReplicas": 1, "maxReplicas": 6}
    obj = isvc(name, {"mode": "external", "kvCacheTarget": 0.5}, pool, gpus=1)
    obj["spec"]["replicas"] = 1  # external mode needs it: HPA and KEDA read it through GET .../scale
    apply(control_plane, cp_namespace, obj)
    wait_until(lambda: deployment_replicas(control_plane, cp_namespace, name) == 1, 60, "the pool at 1 replica")
    for replicas in (3, 2):
        control_plane.kubectl("scale", "inferenceservice", name, "-n", cp_namespace, f"--replicas={replicas}")
        wait_until(
            lambda r=replicas: deployment_replicas(control_plane, cp_namespace, name) == r,
            60,
            f"the Deployment following the scale subresource to {replicas}",
        )
        deadline = time.monotonic() + 5  # several autoscaler intervals (1 s): nothing moves it back
        while time.monotonic() < deadline:
            assert deployment_replicas(control_plane, cp_namespace, name) == replicas
            time.sleep(0.5)
        assert get_isvc(control_plane, cp_namespace, name)["spec"]["replicas"] == replicas
    assert autoscaling_status(control_plane, cp_namespace, name) == {}
    assert name not in scraped
    port = os.environ["TIDEPOOL_OPERATOR_METRICS_PORT"]
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    decided = [
        line for line in metrics.splitlines() if line.startswith("tidepool_autoscaler_") and f'name="{name}"' in line
    ]
    assert "tidepool_autoscaler_" in metrics and not decided  # the families exist; nothing decided for this one
