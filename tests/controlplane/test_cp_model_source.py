"""Model credentials and a failing download on the real control plane, with the operator as the chart's
ServiceAccount in a Pod Security "restricted" namespace.

(a) An InferenceService with `spec.model.credentials` renders pods whose download init container gets
the Secret's keys by secretKeyRef, and the Secret's value (a distinctive string) appears nowhere in the
CR, its status, its children, the namespace's events or the operator's log.
(b) A bad token: the real `tidepool download` runs against a stub Hub on 127.0.0.1 that answers 401;
its exit code and termination message are written into the KWOK pod's status as the kubelet would
(initContainerStatuses: CrashLoopBackOff now, lastState terminated) through the pods/status
subresource, and the InferenceService's conditions carry the actionable 401 reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from typing import Any

import pytest
import yaml
from download_stub import REPO, StubHub
from kubernetes import client
from operator_kit import (
    TIDEPOOL,
    OperatorProcess,
    condition,
    get_isvc,
    is_ready,
    load_example,
    pods,
    wait_until,
)

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]
SECRET = "hf-token"
SECRET_VALUE = f"hf_tidepoolcp_{uuid.uuid4().hex}"  # distinctive: must never leave the Secret


@pytest.fixture
def hf_token_secret(control_plane, cp_namespace) -> str:
    """The Secret holding the distinctive HF_TOKEN, created before the operator starts; its name."""
    core = client.CoreV1Api(control_plane.api_client())
    secret = {"metadata": {"name": SECRET}, "stringData": {"HF_TOKEN": SECRET_VALUE}, "type": "Opaque"}
    core.create_namespaced_secret(cp_namespace, secret)
    return SECRET


def isvc_with_credentials(name: str) -> dict[str, Any]:
    obj = load_example("inferenceservice-unified.yaml")
    obj["metadata"]["name"] = name
    obj["spec"]["model"] = {"uri": f"hf://{REPO}", "credentials": {"secretName": SECRET}}
    obj["spec"].pop("modelCache", None)  # the default: a per-pod emptyDir with a sizeLimit
    obj["spec"]["pools"]["unified"].update(replicas=1, minReplicas=1)
    obj["spec"].pop("replicas", None)
    obj["spec"]["autoscaling"] = {"enabled": False}
    return obj


def apply(cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def engine_pods(cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return pods(cluster, namespace, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified")


def everything_visible(cluster, namespace: str, name: str, op: OperatorProcess) -> str:
    """The CR (spec and status), every object in the namespace but Secrets, the events, the operator's log."""
    kinds = "deployments,replicasets,pods,services,configmaps,serviceaccounts,persistentvolumeclaims,events"
    objects = cluster.kubectl("get", kinds, "-n", namespace, "-o", "json").stdout
    return json.dumps(get_isvc(cluster, namespace, name)) + objects + op.log_text()


def test_credentials_reach_the_download_step_by_reference_only(control_plane, cp_namespace, hf_token_secret, operator):
    ns, name = cp_namespace, "creds"
    apply(control_plane, ns, isvc_with_credentials(name))
    wait_until(lambda: is_ready(get_isvc(control_plane, ns, name)), 120, f"{name} Ready")
    (pod,) = engine_pods(control_plane, ns, name)
    (init,) = pod["spec"]["initContainers"]
    assert init["command"] == ["tidepool", "download"] and init["terminationMessagePolicy"] == "File"
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": SECRET, "key": "HF_TOKEN", "optional": True}
    assert pod["spec"]["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    cache = next(v for v in pod["spec"]["volumes"] if v["name"] == "model-cache")
    assert cache["emptyDir"]["sizeLimit"]  # never unbounded
    visible = everything_visible(control_plane, ns, name, operator)
    assert SECRET in visible  # the reference is there...
    assert SECRET_VALUE not in visible  # ...the value nowhere


def run_download_against_401(tmp_path) -> tuple[int, str]:
    """The real `tidepool download`, as its init container runs it, against a Hub that answers 401."""
    log = tmp_path / "termination-log"
    with StubHub({}) as hub:
        hub.status = 401
        env = {
            **os.environ,
            "HF_TOKEN": SECRET_VALUE,
            "TIDEPOOL_CREDENTIALS_SECRET": SECRET,
            "HF_ENDPOINT": hub.endpoint,
        }
        proc = subprocess.run(
            [str(TIDEPOOL), "download", f"hf://{REPO}", "--dest", str(tmp_path / "models"), "--retries", "0",
             "--termination-log", str(log)],
            cwd="/tmp", env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert SECRET_VALUE not in proc.stdout + proc.stderr
    return proc.returncode, log.read_text()


def report_init_failure(cluster, namespace: str, pod: dict[str, Any], exit_code: int, message: str) -> None:
    """What the kubelet writes when an init container keeps failing. The phase stays Running: KWOK's
    pod-ready stage would make a Pending pod Ready again (a real kubelet keeps such a pod Pending)."""
    now = pod["status"].get("startTime")
    init = pod["spec"]["initContainers"][0]
    status = pod["status"]
    status["conditions"] = [
        {**c, "status": "False", "reason": "ContainersNotInitialized"} if c["type"] != "PodScheduled" else c
        for c in status["conditions"]
    ]
    status["initContainerStatuses"] = [
        {
            "name": init["name"], "image": init["image"], "imageID": "", "ready": False, "restartCount": 3,
            "started": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off 40s restarting {init['name']}"}},
            "lastState": {"terminated": {
                "exitCode": exit_code, "reason": "Error", "message": message, "startedAt": now, "finishedAt": now,
            }},
        }
    ]  # fmt: skip
    status["containerStatuses"] = [
        {"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "restartCount": 0,
         "started": False, "state": {"waiting": {"reason": "PodInitializing"}}}
        for c in pod["spec"]["containers"]
    ]  # fmt: skip
    core = client.CoreV1Api(cluster.api_client())
    core.replace_namespaced_pod_status(pod["metadata"]["name"], namespace, pod)


def test_a_bad_token_surfaces_as_an_actionable_condition(
    control_plane, cp_namespace, hf_token_secret, operator, tmp_path
):
    exit_code, message = run_download_against_401(tmp_path)
    assert exit_code == 1
    assert f"the token in Secret {SECRET} key HF_TOKEN is missing or invalid" in message

    ns, name = cp_namespace, "badtoken"
    apply(control_plane, ns, isvc_with_credentials(name))
    wait_until(lambda: is_ready(get_isvc(control_plane, ns, name)), 120, f"{name} Ready")
    (pod,) = engine_pods(control_plane, ns, name)
    report_init_failure(control_plane, ns, pod, exit_code, message)

    def failed() -> dict[str, Any] | None:
        obj = get_isvc(control_plane, ns, name)
        ready = condition(obj, "Ready")
        return obj if ready and ready["reason"] == "ModelDownloadFailed" else None

    obj = wait_until(failed, 60, "Ready reason ModelDownloadFailed")
    ready, degraded = condition(obj, "Ready"), condition(obj, "Degraded")
    pod_name = pod["metadata"]["name"]
    assert ready["status"] == "False"
    assert ready["message"].startswith(f"pod {pod_name}: model download failed: 401 Unauthorized for {REPO}@main")
    assert f"Secret {SECRET} key HF_TOKEN is missing or invalid" in ready["message"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ModelDownloadFailed")
    assert message in degraded["message"]
    assert SECRET_VALUE not in everything_visible(control_plane, ns, name, operator)
