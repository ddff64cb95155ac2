"""spec.auth and router HA on the real control plane, with the chart's RBAC (secrets: create and get, nothing more).

One InferenceService names an API-key Secret that does not exist yet. The operator reports it (Degraded, reason
ApiKeySecretMissing, the Secret named; a Warning Event): KWOK plays the kubelet and runs pods whatever their
volumes, so the report cannot come from a FailedMount here, it comes from the operator's own read. Every pod the
workload controllers create from the operator's templates (engine and router) mounts the key read-only and gets
--api-key-file. The API server accepts and the disruption controller evaluates the PodDisruptionBudgets as
specified: the pool's from its disruptionBudget, the router's minAvailable 1 over its two automatic replicas (the
pool runs two). Once the Secret is created the problem clears with no watch on Secrets (the operator's wake-up reads
it again). The operator fixture fails the test if the chart's RBAC refused any request.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml
from operator_kit import condition, get_isvc, pod_is_ready, pods, wait_until

from tidepool.operator.api.auth import API_KEY_MOUNT_DIR
from tidepool.operator.builders.auth import API_KEY_FILE_FLAG

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

NAME = "authed"
SECRET = "authed-keys"
ITEM = "keys"


def service() -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "hf://example/model"},
            "pools": {"unified": {"replicas": 2, "disruptionBudget": {"minAvailable": "50%"}}},
            "auth": {"apiKeySecretRef": {"name": SECRET, "key": ITEM}},
        },
    }


def degraded(cluster, ns: str) -> dict[str, Any] | None:
    return condition(get_isvc(cluster, ns, NAME), "Degraded")


def ready_pods(cluster, ns: str, pool: str, count: int) -> list[dict[str, Any]] | None:
    found = [
        p
        for p in pods(cluster, ns, f"tidepool.dev/inferenceservice={NAME},tidepool.dev/pool={pool}")
        if not p["metadata"].get("deletionTimestamp")
    ]
    return found if len(found) == count and all(map(pod_is_ready, found)) else None


def assert_mounts_the_key(pod: dict[str, Any]) -> None:
    container = pod["spec"]["containers"][0]
    name = pod["metadata"]["name"]
    args = container["args"]
    assert args[args.index(API_KEY_FILE_FLAG) + 1] == f"{API_KEY_MOUNT_DIR}/{ITEM}", name
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == API_KEY_MOUNT_DIR]
    assert mount.get("readOnly") is True, name
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == SECRET and volume["secret"]["items"] == [{"key": ITEM, "path": ITEM}]


def pdb(cluster, ns: str, name: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", "pdb", name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def evaluated(cluster, ns: str, name: str, expected_pods: int) -> dict[str, Any] | None:
    """The PDB once the disruption controller has counted its pods."""
    found = pdb(cluster, ns, name)
    status = (found or {}).get("status") or {}
    return (
        found if status.get("expectedPods") == expected_pods and status.get("currentHealthy") == expected_pods else None
    )


def test_missing_key_secret_is_reported_pods_mount_it_and_budgets_hold(control_plane, cp_namespace, operator):
    ns = cp_namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service()))

    missing = wait_until(
        lambda: (d := degraded(control_plane, ns)) and d["reason"] == "ApiKeySecretMissing" and d, 120, "the report"
    )
    assert missing["status"] == "True"
    assert f"Secret {SECRET} (spec.auth.apiKeySecretRef) not found" in missing["message"]
    events = control_plane.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    reasons = [e["reason"] for e in json.loads(events)["items"] if e["involvedObject"].get("name") == NAME]
    assert "ApiKeySecretMissing" in reasons

    engines = wait_until(lambda: ready_pods(control_plane, ns, "unified", 2), 180, "two engine pods")
    routers = wait_until(lambda: ready_pods(control_plane, ns, "router", 2), 180, "two router pods (the default)")
    for pod in [*engines, *routers]:
        assert_mounts_the_key(pod)
    spread = routers[0]["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}

    pool_pdb = wait_until(lambda: evaluated(control_plane, ns, f"{NAME}-unified", 2), 120, "the pool's PDB")
    assert pool_pdb["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in pool_pdb["spec"]
    assert pool_pdb["status"]["disruptionsAllowed"] == 1
    router_pdb = wait_until(lambda: evaluated(control_plane, ns, f"{NAME}-router", 2), 120, "the router's PDB")
    assert router_pdb["spec"]["minAvailable"] == 1 and router_pdb["status"]["disruptionsAllowed"] == 1

    value = base64.b64encode(b"sk-first\nsk-second\n").decode()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "data": {ITEM: value}}
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(secret))
    cleared = wait_until(
        lambda: (d := degraded(control_plane, ns)) and d["status"] == "False" and d, 120, "the report cleared"
    )
    assert cleared["reason"] != "ApiKeySecretMissing"
