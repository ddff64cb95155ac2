"""A multi-node pool's control-channel key on the real control plane, with the chart's RBAC (create only).

The operator creates the pool's Secret once, owned by the InferenceService; every rank's pod (created by the
LeaderWorkerSet or StatefulSet controller from the operator's template, run by KWOK) mounts it and names the
key file; a spec edit changes the template (still mounting it) but leaves the key as it was; deleting the
service garbage-collects the Secret. The operator fixture fails the test if the chart's RBAC refused any
request (it never reads Secrets). The roll of the pods themselves is the workload controller's (LWS's rolling
update did not progress under KWOK in our runs: its surge group was never created), so it is not waited for.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml
from operator_kit import get_isvc, is_ready, pod_is_ready, pods, wait_until

from tidepool.contract.wire import CONTROL_KEY_FILE_ENV, CONTROL_KEY_MOUNT_PATH, MIN_KEY_BYTES

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

NAME = "mnkey"
SECRET = f"{NAME}-unified-control-key"
SELECTOR = f"tidepool.dev/inferenceservice={NAME},tidepool.dev/pool=unified"


def service(max_num_seqs: int) -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "hf://example/model"},
            "parallelism": {"tensor": 1, "pipeline": 2},
            "resources": {"gpusPerReplica": 2},
            "engine": {"maxNumSeqs": max_num_seqs},
            "pools": {"unified": {"replicas": 1}},
        },
    }


def secret(cluster, ns: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", "secret", SECRET, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def ranks_ready(cluster, ns: str) -> list[dict[str, Any]] | None:
    """Both ranks' pods Ready, and the service Ready about its first generation."""
    isvc = get_isvc(cluster, ns, NAME)
    found = [p for p in pods(cluster, ns, SELECTOR) if not p["metadata"].get("deletionTimestamp")]
    return found if is_ready(isvc) and len(found) == 2 and all(map(pod_is_ready, found)) else None


def applied_templates(cluster, ns: str, generation: int) -> list[dict[str, Any]] | None:
    """The pod templates of the operator's workloads for the pool, once it has applied `generation`."""
    isvc = get_isvc(cluster, ns, NAME)
    if ((isvc or {}).get("status") or {}).get("observedGeneration") != generation:
        return None
    out = []
    for kind in ("leaderworkersets.leaderworkerset.x-k8s.io", "statefulsets.apps"):
        found = cluster.kubectl("get", kind, "-n", ns, "-l", SELECTOR, "-o", "json", check=False)
        items = json.loads(found.stdout)["items"] if found.returncode == 0 else []  # no LWS CRD: none
        for obj in items:
            if obj["metadata"].get("ownerReferences", [{}])[0].get("kind") != "InferenceService":
                continue  # a StatefulSet the LWS controller made
            spec = obj["spec"]
            out.append(
                spec["leaderWorkerTemplate"]["workerTemplate"] if "leaderWorkerTemplate" in spec else spec["template"]
            )
    return out or None


def assert_mounts_the_key(pod: dict[str, Any]) -> None:
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    assert env[CONTROL_KEY_FILE_ENV] == CONTROL_KEY_MOUNT_PATH, pod["metadata"]["name"]
    (mount,) = [m for m in engine["volumeMounts"] if CONTROL_KEY_MOUNT_PATH.startswith(m["mountPath"] + "/")]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == SECRET and volume["secret"]["defaultMode"] == 0o400


def test_multi_node_pool_gets_an_owned_key_that_survives_spec_edits(control_plane, cp_namespace, operator):
    ns = cp_namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service(32)))
    found = wait_until(lambda: ranks_ready(control_plane, ns), 180, "two Ready ranks")
    isvc = get_isvc(control_plane, ns, NAME)
    first = secret(control_plane, ns)
    assert first is not None, f"no Secret {SECRET}"
    (owner,) = first["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("InferenceService", NAME, isvc["metadata"]["uid"])
    assert first["immutable"] is True and list(first["data"]) == [CONTROL_KEY_MOUNT_PATH.rsplit("/", 1)[1]]
    key = base64.b64decode(next(iter(first["data"].values())))
    assert len(key.strip()) >= MIN_KEY_BYTES
    for pod in found:
        assert_mounts_the_key(pod)

    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service(64)))
    templates = wait_until(lambda: applied_templates(control_plane, ns, 2), 120, "generation 2 applied")
    old_hash = found[0]["metadata"]["labels"]["tidepool.dev/spec-hash"]
    for template in templates:
        assert template["metadata"]["labels"]["tidepool.dev/spec-hash"] != old_hash  # the pods' template changed
        assert_mounts_the_key(template)
    after = secret(control_plane, ns)
    assert after is not None and after["metadata"]["uid"] == first["metadata"]["uid"]
    assert after["data"] == first["data"]  # the same key: created once, never re-applied

    control_plane.kubectl("delete", "inferenceservice", NAME, "-n", ns, "--wait=false")
    wait_until(lambda: secret(control_plane, ns) is None, 120, "the Secret garbage-collected with its service")
