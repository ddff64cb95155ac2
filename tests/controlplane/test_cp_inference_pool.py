"""The Gateway API Inference Extension's CRDs (from sigs.k8s.io/gateway-api-inference-extension, copied
by build.sh) install on the dev cluster, and the API server enforces their published schema."""

from __future__ import annotations

import json

import pytest
import yaml

from controlplane_fixture import load_devcluster

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(240)]


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
