"""The operator's own gauges per pool after a tick: desired, current and ready replicas (the dashboard's)."""

from __future__ import annotations

from prometheus_client import REGISTRY
from test_autoscale_actuation import isvc, run_ticks


def sample(name: str, pool: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"namespace": "ns", "name": "svc", "pool": pool})


def test_desired_current_and_ready_replicas_per_pool():
    body = isvc()
    body["status"]["pools"] = {"unified": {"desiredReplicas": 2, "readyReplicas": 1}}  # what reconcile recorded
    run_ticks(body, kv=0.9, ticks=1)  # kv 0.9 against 0.5 on 2 pods: 4 wanted
    assert sample("tidepool_autoscaler_desired_replicas", "unified") == 4
    assert sample("tidepool_autoscaler_current_replicas", "unified") == 2
    assert sample("tidepool_autoscaler_ready_replicas", "unified") == 1
