"""`tidepool.dev/paused: "true"` on a real control plane: a paused service's children are not changed (a new
spec waits, observedGeneration stays), status is still observed and says Progressing=Unknown reason Paused (as a
paused Deployment does); a paused new service creates nothing; removing the annotation resumes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from operator_kit import children, condition, get_isvc, is_ready, wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

PAUSED = "tidepool.dev/paused"


def service(name: str, image: str, paused: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if paused:
        meta["annotations"] = {PAUSED: "true"}
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": meta,
        "spec": {
            "model": {"uri": "hf://example/model"},
            "engine": {"image": image},
            "resources": {"gpusPerReplica": 0, "cpu": "100m", "memory": "128Mi"},
            "pools": {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}},
            "router": {"replicas": 1},
        },
    }


def apply(cluster, ns: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))


def paused_at(cluster, ns: str, name: str, generation: int) -> dict[str, Any] | None:
    """The object once status says Paused for `generation` (written by the sync that held its changes back)."""
    obj = get_isvc(cluster, ns, name)
    progressing = condition(obj, "Progressing")
    if progressing and progressing["reason"] == "Paused" and progressing.get("observedGeneration") == generation:
        return obj
    return None


def engine(cluster, ns: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "deployment", f"{name}-unified", "-n", ns, "-o", "json")
    return json.loads(out.stdout)


def test_pause_holds_every_change_and_resumes(control_plane, cp_namespace, operator):
    ns, name = cp_namespace, "held"
    apply(control_plane, ns, service(name, "example.com/tidepool:1"))
    wait_until(lambda: is_ready(get_isvc(control_plane, ns, name)), 120, "Ready")
    before = engine(control_plane, ns, name)

    apply(control_plane, ns, service(name, "example.com/tidepool:2", paused=True))  # generation 2, paused
    obj = wait_until(lambda: paused_at(control_plane, ns, name, 2), 60, "Progressing reason Paused")
    progressing = condition(obj, "Progressing")
    assert progressing["status"] == "Unknown"
    assert "Deployment/held-unified" in progressing["message"], progressing["message"]
    assert obj["status"]["observedGeneration"] == 1  # generation 2 is not applied
    assert condition(obj, "Ready")["status"] == "True"  # still observed: serving the earlier spec
    after = engine(control_plane, ns, name)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"]["template"] == before["spec"]["template"]
    events = control_plane.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    assert any(e["reason"] == "Paused" for e in json.loads(events)["items"])

    control_plane.kubectl("annotate", "inferenceservice", name, "-n", ns, f"{PAUSED}-")  # resume
    wait_until(lambda: is_ready(get_isvc(control_plane, ns, name)), 120, "Ready at generation 2")
    image = engine(control_plane, ns, name)["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "example.com/tidepool:2"
    assert condition(get_isvc(control_plane, ns, name), "Progressing")["reason"] != "Paused"


def test_a_paused_new_service_creates_nothing(control_plane, cp_namespace, operator):
    ns, name = cp_namespace, "born-paused"
    apply(control_plane, ns, service(name, "example.com/tidepool:1", paused=True))
    obj = wait_until(lambda: paused_at(control_plane, ns, name, 1), 60, "Progressing reason Paused")
    assert condition(obj, "Ready")["status"] == "False"
    assert children(control_plane, ns, name) == {}
    control_plane.kubectl("annotate", "inferenceservice", name, "-n", ns, f"{PAUSED}-")
    wait_until(lambda: is_ready(get_isvc(control_plane, ns, name)), 120, "Ready once resumed")
