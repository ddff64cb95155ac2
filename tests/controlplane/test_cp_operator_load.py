"""A large pool costs status writes by time, not by pod events: measured by the API server itself.

One InferenceService whose router runs ROUTER_REPLICAS pods on the KWOK nodes (each pod is created,
scheduled and made ready: several pod events each). The operator, with its production defaults,
writes routine status changes (counts, messages) at most once per `status_interval_seconds` per
service and transitions (a condition's status or reason, a new generation) at once. So from
the apply until the service reports every router pod ready, its status PATCHes must stay within
one per interval of elapsed time plus the transitions, however fast or slow the machine is. Before
pacing, an operator fuzz run with `router.replicas: 7032` made ~5,100 status PATCHes in 4 minutes.

The operator's own metrics (controller-runtime's and client-go's names) must tell the same story:
its count of status writes equals the API server's count of successful status PATCHes.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from operator_kit import (
    NodeLeaseKeeper,
    OperatorProcess,
    apiserver_counters,
    condition,
    counter_delta,
    get_isvc,
    install_crd,
    is_ready,
    operator_identity,
    restricted_namespace,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families

from tidepool.operator.sync import ControllerOptions

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(600)]
ROUTER_REPLICAS = 120  # ~60 per KWOK node (110 pods each)
TRANSITIONS = 12  # condition changes from creation to complete, generously (about six happen)


def service(name: str) -> dict:
    on_kwok = {
        "nodeSelector": {"type": "kwok"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
    }
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
            "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "1Gi"},
            "mode": "unified",
            "pools": {"unified": {"replicas": 1}},
            "router": {"replicas": ROUTER_REPLICAS, **on_kwok},
        },
    }


def status_patches(before: dict, after: dict, **match: str) -> float:
    return counter_delta(
        before,
        after,
        "apiserver_request_total",
        verb="PATCH",
        resource="inferenceservices",
        subresource="status",
        **match,
    )


def operator_metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The operator's /metrics as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(metrics: dict, metric: str, **match: str) -> float:
    return sum(v for (n, labels), v in metrics.items() if n == metric and match.items() <= dict(labels).items())


def test_status_writes_of_a_large_pool_follow_time_not_pod_events(control_plane, cp_namespace, tmp_path):
    ns, name = cp_namespace, "wide"
    install_crd(control_plane)
    identity = operator_identity(control_plane, tmp_path)
    restricted_namespace(control_plane, ns)
    interval = ControllerOptions().status_interval_seconds  # the operator runs with this default
    with NodeLeaseKeeper(control_plane):
        op = OperatorProcess(identity.kubeconfig, [ns], tmp_path / "operator.log")
        op.start()
        try:
            wait_until(lambda: "caches synced" in op.log_text(), 120, "the operator's caches synced")
            before = apiserver_counters(control_plane)
            start = time.monotonic()
            control_plane.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(service(name)))

            def complete() -> bool:  # Progressing=False (Complete): every pool and every router pod ready
                obj = get_isvc(control_plane, ns, name)
                return is_ready(obj) and (condition(obj, "Progressing") or {}).get("reason") == "Complete"

            wait_until(complete, 480, f"{ROUTER_REPLICAS} router pods ready and reported", interval_s=1)
            elapsed = time.monotonic() - start
            after = apiserver_counters(control_plane)

            def counted_alike() -> dict | None:  # a paced write may land between two reads: read both again
                mine = operator_metrics(op.metrics_port)
                server = status_patches(before, apiserver_counters(control_plane), code="200")
                return mine if total(mine, "tidepool_operator_status_writes_total") == server else None

            metrics = wait_until(counted_alike, 60, "the operator's status-write count matches the API server's")
        finally:
            op.stop()
    patches = status_patches(before, after)
    bound = elapsed / interval + TRANSITIONS
    print(f"{patches:.0f} status PATCHes in {elapsed:.1f}s for {ROUTER_REPLICAS} pods (bound {bound:.0f})")
    assert patches >= 2, "the measurement has to see the operator's status writes"
    assert patches <= bound
    assert not op.forbidden_lines()
    # Its other metrics, under the names Go controllers use.
    assert total(metrics, "controller_runtime_reconcile_total", controller="inferenceservice", result="success") > 0
    assert total(metrics, "workqueue_adds_total", name="inferenceservice") > 0
    writes = total(metrics, "tidepool_operator_status_writes_total")
    assert total(metrics, "rest_client_requests_total", method="PATCH", code="200") >= writes > 0
    assert total(metrics, "leader_election_master_status") == 1
    assert total(metrics, "tidepool_operator_cached_objects", kind="pods") == ROUTER_REPLICAS + 1
    ready = total(metrics, "tidepool_inferenceservice_status_condition", namespace=ns, name=name, type="Ready")
    assert ready == total(metrics, "tidepool_inferenceservice_status_condition", name=name, type="Ready", status="True")
    assert ready == 1  # one series per condition, with its status: what the chart's alert rules read
