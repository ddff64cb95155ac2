"""The Gateway API Inference Extension's CRDs (from sigs.k8s.io/gateway-api-inference-extension, copied
by build.sh) install on the dev cluster, and the API server enforces their published schema; the
operator (as the chart's ServiceAccount) serves without them, finds them by periodic discovery once
installed, then owns an InferencePool per InferenceService that asks for one: decode pods selected,
drift reverted, pruned when disabled, garbage-collected with its InferenceService."""

from __future__ import annotations

import json

import pytest
import yaml
from operator_kit import (
    OperatorProcess,
    condition,
    get_isvc,
    is_ready,
    pods,
    wait_until,
)

from controlplane_fixture import load_devcluster

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(240)]
POOLS = "inferencepools.inference.networking.k8s.io"


def pool(name: str, **spec: object) -> dict:
    body = {
        "selector": {"matchLabels": {"tidepool.dev/inferenceservice": "chat"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "chat-epp", "port": {"number": 9002}},
        **spec,
    }
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": body,
    }


def test_inference_pool_crds_install_and_validate(control_plane, cp_namespace):
    addons = load_devcluster().addons
    names = addons.install_inference_pool_crds(control_plane)
    assert "inferencepools.inference.networking.k8s.io" in names
    assert addons.install_inference_pool_crds(control_plane) == names  # idempotent: applied server-side

    ok = control_plane.kubectl("apply", "-n", cp_namespace, "-f", "-", input=yaml.safe_dump(pool("chat")))
    assert "created" in ok.stdout
    got = json.loads(control_plane.kubectl("get", "inferencepool", "chat", "-n", cp_namespace, "-o", "json").stdout)
    assert got["spec"]["endpointPickerRef"]["kind"] == "Service"  # the schema's default

    # two target ports: the published schema allows one (maxItems: 1)
    bad = pool("bad", targetPorts=[{"number": 8000}, {"number": 8001}])
    out = control_plane.kubectl("apply", "-n", cp_namespace, "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert out.returncode != 0 and "targetPorts" in out.stderr, out.stderr


def service(name: str, **spec: object) -> dict:
    body = {
        "model": {"uri": "hf://org/model"},
        "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "1Gi"},
        "mode": "disaggregated",
        "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
        "router": {"replicas": 1},
        "inferencePool": {"endpointPicker": {"name": f"{name}-epp"}},
        **spec,
    }
    return {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def inference_pool(cluster, namespace: str, name: str) -> dict | None:
    out = cluster.kubectl("get", POOLS, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def patch(cluster, namespace: str, kind: str, name: str, body: dict) -> None:
    cluster.kubectl("patch", kind, name, "-n", namespace, "--type=merge", "-p", json.dumps(body))


def test_operator_owns_the_pool_once_its_crd_appears(control_plane, cp_namespace, identity, tmp_path):
    addons = load_devcluster().addons
    crd = "crd/inferencepools.inference.networking.k8s.io"
    control_plane.kubectl("delete", crd, "--ignore-not-found", "--wait=true", timeout=90)
    recheck = ("--feature-recheck-seconds", "1")
    op = OperatorProcess(identity.kubeconfig, [cp_namespace], tmp_path / "operator.log", recheck)
    op.start()
    try:
        # Without the CRD: spec.inferencePool is accepted, the service serves, nothing else happens.
        name = "gw"
        control_plane.kubectl("apply", "-n", cp_namespace, "-f", "-", input=yaml.safe_dump(service(name)))
        wait_until(lambda: is_ready(get_isvc(control_plane, cp_namespace, name)), 120, "Ready without the CRD")

        addons.install_inference_pool_crds(control_plane)  # the operator's periodic discovery finds it
        pool = wait_until(lambda: inference_pool(control_plane, cp_namespace, name), 60, "the InferencePool")
        owner = get_isvc(control_plane, cp_namespace, name)
        assert [(r["kind"], r["uid"]) for r in pool["metadata"]["ownerReferences"]] == [
            ("InferenceService", owner["metadata"]["uid"])
        ]
        selector = pool["spec"]["selector"]["matchLabels"]
        assert selector == {"tidepool.dev/inferenceservice": name, "tidepool.dev/pool": "decode"}
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]
        assert pool["spec"]["endpointPickerRef"]["name"] == f"{name}-epp"
        # The selector picks exactly the decode pods (llm-d's role label agrees), never prefill or the router.
        chosen = pods(control_plane, cp_namespace, ",".join(f"{k}={v}" for k, v in selector.items()))
        assert len(chosen) == 2 and {p["metadata"]["labels"]["llm-d.ai/role"] for p in chosen} == {"decode"}

        # Drift is reverted; opting out deletes the pool; opting back in recreates it.
        patch(control_plane, cp_namespace, POOLS, name, {"spec": {"targetPorts": [{"number": 9999}]}})
        wait_until(
            lambda: (
                (inference_pool(control_plane, cp_namespace, name) or {}).get("spec", {}).get("targetPorts")
                == [{"number": 8000}]
            ),
            60,
            "the hand-edited port reverted",
        )
        patch(control_plane, cp_namespace, "inferenceservice", name, {"spec": {"inferencePool": {"enabled": False}}})
        wait_until(lambda: inference_pool(control_plane, cp_namespace, name) is None, 60, "the pool pruned")
        patch(control_plane, cp_namespace, "inferenceservice", name, {"spec": {"inferencePool": {"enabled": True}}})
        wait_until(lambda: inference_pool(control_plane, cp_namespace, name), 60, "the pool back")

        # The CRD goes away (and its pools with it): a spec change still reconciles, nothing stays Degraded;
        # installed again, the pool comes back with the new spec.
        control_plane.kubectl("delete", crd, "--wait=true", timeout=90)
        wait_until(lambda: "has_inference_pool=False" in op.log_text(), 60, "the operator noticing the CRD is gone")
        picker = {"spec": {"inferencePool": {"endpointPicker": {"name": f"{name}-epp", "port": 9003}}}}
        patch(control_plane, cp_namespace, "inferenceservice", name, picker)
        wait_until(lambda: is_ready(get_isvc(control_plane, cp_namespace, name)), 60, "Ready at the new generation")
        assert condition(get_isvc(control_plane, cp_namespace, name), "Degraded")["status"] == "False"
        addons.install_inference_pool_crds(control_plane)
        wait_until(
            lambda: (
                (inference_pool(control_plane, cp_namespace, name) or {}).get("spec", {}).get("endpointPickerRef")
                == {
                    "group": "",
                    "kind": "Service",
                    "name": f"{name}-epp",
                    "port": {"number": 9003},
                    "failureMode": "FailClose",
                }
            ),
            60,
            "the pool back, with the new picker port",
        )

        # Deleting the InferenceService garbage-collects the pool (owner reference, no operator action needed).
        op.stop()
        control_plane.kubectl("delete", "inferenceservice", name, "-n", cp_namespace, "--wait=true", timeout=90)
        wait_until(lambda: inference_pool(control_plane, cp_namespace, name) is None, 90, "the pool collected")
    finally:
        op.stop()
    # While its CRD terminates, the API server answers a create of the (just deleted) pool with "forbidden":
    # that is not RBAC.
    forbidden = [line for line in op.forbidden_lines() if "definition is terminating" not in line]
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])
    assert "Traceback" not in op.log_text()
