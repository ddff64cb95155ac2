"""Two operator replicas on the real control plane (production defaults, the chart's Lease and RBAC):
exactly one reconciles; when it is SIGKILLed the stand-by takes the Lease within 30 s and reconciles;
a clean stop hands over at once. Deleting an InferenceService never waits for an operator."""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_kit import (
    LEASE_NAME,
    OPERATOR_NAMESPACE,
    OperatorProcess,
    children,
    get_isvc,
    is_ready,
    pods,
    restricted_namespace,
    wait_until,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(420)]
TAKEOVER_S = 30.0  # the requirement; the defaults (15 s lease, 5 s polls) give at most 25 s (test_leader.py,
# on a fake clock). Here, on a real API server that a busy 2-core machine may slow, the bound has slack.
TAKEOVER_SLACK_S = 15.0


def lease_holder(cluster) -> str | None:
    api = client.CoordinationV1Api(cluster.api_client())
    try:
        return api.read_namespaced_lease(LEASE_NAME, OPERATOR_NAMESPACE).spec.holder_identity
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def identity_of(op: OperatorProcess) -> str | None:
    """The Lease identity the operator's latest start logged ("... lease <ns>/<name> as <identity>")."""
    last_start = op.log_text().rsplit("---- start", 1)[-1]
    for line in last_start.splitlines():
        if "tidepool operator starting" in line and " as " in line:
            return line.rsplit(" as ", 1)[1].strip()
    return None


def reconciled(op: OperatorProcess, name: str) -> bool:
    return f"/{name}] Ready=" in op.log_text()


def small(name: str, seqs: int = 64) -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
            "engine": {"maxNumSeqs": seqs},
            "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "4Gi"},
            "mode": "unified",
            "pools": {"unified": {"replicas": 1}},
            "router": {"replicas": 1},
        },
    }


def ready_at(cluster, namespace: str, name: str, generation: int) -> bool:
    obj = get_isvc(cluster, namespace, name)
    return bool(obj and obj["metadata"]["generation"] == generation and is_ready(obj))


def test_one_leader_reconciles_and_the_standby_takes_over(control_plane, cp_namespace, identity, tmp_path):
    ns = cp_namespace
    restricted_namespace(control_plane, ns)
    ops = [OperatorProcess(identity.kubeconfig, [ns], tmp_path / f"operator-{i}.log") for i in range(2)]
    for op in ops:
        op.start()
    try:
        wait_until(lambda: all(identity_of(op) for op in ops), 60, "both operators started")
        ours = {identity_of(op) for op in ops}

        def our_holder() -> str | None:  # an earlier test's operator may hold the Lease until it expires (15 s)
            holder = lease_holder(control_plane)
            return holder if holder in ours else None

        holder = wait_until(our_holder, 60, "one of the two as leader")
        (leader,) = [op for op in ops if identity_of(op) == holder]
        (standby,) = [op for op in ops if op is not leader]

        control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(small("ha")))
        wait_until(lambda: ready_at(control_plane, ns, "ha", 1), 120, "Ready under the first leader")
        assert reconciled(leader, "ha") and not reconciled(standby, "ha"), "exactly one replica reconciles"
        assert "waiting for leadership" in standby.log_text() and "became the leader" not in standby.log_text()

        # The leader dies without a word; a change made right after must still be rolled out.
        leader.kill()
        killed_at = time.monotonic()
        control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(small("ha", seqs=32)))
        wait_until(lambda: lease_holder(control_plane) == identity_of(standby), TAKEOVER_S + 30, "takeover")
        took_over_s = time.monotonic() - killed_at
        print(f"stand-by took the Lease {took_over_s:.1f}s after the leader was killed")
        assert took_over_s <= TAKEOVER_S + TAKEOVER_SLACK_S, f"takeover took {took_over_s:.1f}s"
        wait_until(lambda: ready_at(control_plane, ns, "ha", 2), 120, "generation 2 Ready under the new leader")
        assert reconciled(standby, "ha")

        # A clean stop (SIGTERM) releases the Lease: the restarted first replica takes it on its next poll.
        leader.start()
        wait_until(lambda: "waiting for leadership" in leader.log_text().rsplit("---- start", 1)[-1], 60, "stand-by")
        standby.stop()
        stopped_at = time.monotonic()
        wait_until(lambda: lease_holder(control_plane) == identity_of(leader), 30, "handover after SIGTERM")
        print(f"handover after a clean stop took {time.monotonic() - stopped_at:.1f}s")
    finally:
        for op in ops:
            op.stop()
    for op in ops:
        assert not op.forbidden_lines(), op.forbidden_lines()[:5]


def test_delete_completes_while_no_operator_runs(control_plane, cp_namespace, identity, tmp_path):
    ns = cp_namespace
    restricted_namespace(control_plane, ns)
    op = OperatorProcess(identity.kubeconfig, [ns], tmp_path / "operator.log")
    op.start()
    try:
        control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(small("gone")))
        wait_until(lambda: ready_at(control_plane, ns, "gone", 1), 120, "Ready")
    finally:
        op.kill()  # down hard: nothing will ever run a finalizer
    assert not (get_isvc(control_plane, ns, "gone") or {}).get("metadata", {}).get("finalizers")
    control_plane.kubectl("delete", "inferenceservice", "gone", "-n", ns, "--wait=true", "--timeout=60s", timeout=70)
    wait_until(lambda: not children(control_plane, ns, "gone"), 120, "children garbage-collected")
    wait_until(lambda: not pods(control_plane, ns, "tidepool.dev/inferenceservice=gone"), 120, "pods gone")
