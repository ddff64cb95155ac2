"""GitOps on the real control plane: what Flux (kstatus) and Argo CD (the chart's health.lua) conclude from
the InferenceService objects the operator writes, and a CRD that client-side apply can store.

- `kubectl apply -f crds/...` (client-side, kubectl's default and Argo CD's without ServerSideApply=true)
  succeeds: the whole CRD fits the last-applied-configuration annotation (256 KiB), and that annotation holds
  exactly the file's object.
- `kubectl delete all --all` leaves InferenceServices alone (the CRD is not in the `all` category).
- Through a first start, a rollout held back by a full node (KWOK makes every scheduled pod Ready at once, so
  a new template's pod is held back the way a real cluster holds it: no room, until the test adds a node) and
  a failing model download (the real `tidepool download` against a Hub stub answering 401, its termination
  message written into the pod's status as the kubelet writes it), every version of the object the test
  sees is judged by the kstatus port (tests/gitops_health.py) and by health.lua in a Lua runtime:
  Current/Healthy only once the new generation serves on its own pods with the old ones gone;
  InProgress/Progressing while it is held back; Failed/Degraded on the failing download, naming it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from gitops_health import CURRENT, FAILED, IN_PROGRESS, ArgoHealth, kstatus
from operator_kit import CRD_FILE, condition, get_isvc, load_example, pod_is_ready, pods, wait_until
from test_cp_model_source import report_init_failure, run_download_against_401

from controlplane_fixture import load_devcluster
from tidepool.operator.api import CRD_NAME
from tidepool.operator.pod_problems import DOWNLOAD_FAILED

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(600)]
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
NODE_LABEL = "tidepool.dev/test-pool"
HASH = "tidepool.dev/spec-hash"
ARGO_FOR = {CURRENT: "Healthy", IN_PROGRESS: "Progressing", FAILED: "Degraded"}


def test_client_side_apply_of_the_crd_succeeds(control_plane):
    control_plane.kubectl("apply", "-f", str(CRD_FILE))  # client-side: no --server-side
    crd = json.loads(control_plane.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    stored = json.loads(crd["metadata"]["annotations"][LAST_APPLIED])
    assert stored["metadata"].pop("annotations", {}) == {}  # kubectl records the (empty) map it adds its own to
    assert stored == yaml.safe_load(CRD_FILE.read_text())
    assert "all" not in crd["spec"]["names"]["categories"]


def test_delete_all_leaves_inference_services(control_plane, cp_namespace, identity, tmp_path):
    body = load_example("inferenceservice-unified.yaml")
    control_plane.kubectl("apply", "-n", cp_namespace, "-f", "-", input=yaml.safe_dump(body))
    name = body["metadata"]["name"]
    # A fresh discovery cache: a cached one could still list the category from an earlier CRD.
    out = control_plane.kubectl("delete", "all", "--all", "-n", cp_namespace, "--wait=false",
                                f"--cache-dir={tmp_path / 'kube-cache'}")  # fmt: skip
    assert "inferenceservice" not in out.stdout.lower(), out.stdout
    assert get_isvc(control_plane, cp_namespace, name) is not None


@pytest.fixture
def gpu_nodes(control_plane, cp_namespace) -> Iterator[Callable[[], str]]:
    """Adds a KWOK node with 8 GPUs that only this test's engine pods select; all removed afterwards."""
    devcluster = load_devcluster()
    made: list[str] = []

    def add() -> str:
        name = f"{cp_namespace[:40]}-{len(made)}"
        node = devcluster.gpu_node(name)
        node["metadata"]["labels"][NODE_LABEL] = cp_namespace
        control_plane.kubectl("create", "-f", "-", input=yaml.safe_dump(node))
        made.append(name)
        ready = "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
        wait_until(lambda: control_plane.kubectl("get", "node", name, "-o", ready).stdout.strip() == "True",
                   60, f"node {name} Ready")  # fmt: skip
        return name

    yield add
    for name in made:
        control_plane.kubectl("delete", "node", name, "--wait=false", check=False)


def service(name: str, namespace: str, max_num_seqs: int) -> dict[str, Any]:
    """A service whose one replica fills one whole 8-GPU node of this test."""
    spec = {
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
        "engine": {"maxNumSeqs": max_num_seqs},
        "resources": {"gpusPerReplica": 8, "cpu": "1", "memory": "4Gi"},
        "parallelism": {"tensor": 8, "pipeline": 1},
        "mode": "unified",
        "pools": {"unified": {"replicas": 1}},
        "pod": {"nodeSelector": {NODE_LABEL: namespace}},
    }
    return {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}


class Seen:
    """Every version of one InferenceService the test reads (by resourceVersion), in order."""

    def __init__(self, cluster, namespace: str, name: str) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.objects: list[dict[str, Any]] = []

    def poll(self) -> dict[str, Any] | None:
        obj = get_isvc(self.cluster, self.namespace, self.name)
        if (
            obj is not None
            and obj.get("status")
            and (
                not self.objects
                or self.objects[-1]["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]
            )
        ):
            self.objects.append(obj)
        return obj

    def until(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            obj = self.poll()
            return obj if obj is not None and obj.get("status") and predicate(obj) else None

        return wait_until(check, timeout_s, what, interval_s=0.2)


def judged(generation: int, verdict: str) -> Callable[[dict[str, Any]], bool]:
    return lambda o: o["metadata"]["generation"] == generation and kstatus(o).status == verdict


def engine_pods(cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return pods(cluster, namespace, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified")


def assert_serves_alone(cluster, namespace: str, name: str, obj: dict[str, Any], old_hash: str | None) -> str:
    """At the moment kstatus says Current: a pod of the current template is Ready, none of an older one is left."""
    ready = condition(obj, "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == obj["metadata"]["generation"], ready
    live = [p for p in engine_pods(cluster, namespace, name) if not p["metadata"].get("deletionTimestamp")]
    assert len({p["metadata"]["labels"][HASH] for p in live}) == 1 and all(map(pod_is_ready, live)), live
    current = live[0]["metadata"]["labels"][HASH]
    assert current != old_hash
    return current


def test_kstatus_and_argo_health_through_a_rollout_and_a_failing_download(
    control_plane, cp_namespace, operator, gpu_nodes, tmp_path
):
    ns, name = cp_namespace, "gitops"
    seen = Seen(control_plane, ns, name)
    gpu_nodes()
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service(name, ns, 128)))
    first = seen.until(judged(1, CURRENT), 180, "generation 1 Current")
    first_hash = assert_serves_alone(control_plane, ns, name, first, None)

    # Generation 2: its pod finds no room. Observed and applied, the old pod serving: InProgress, not Failed.
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service(name, ns, 64)))
    held = seen.until(
        lambda o: (
            judged(2, IN_PROGRESS)(o)
            and o["status"].get("observedGeneration") == 2
            and (condition(o, "ScalingLimited") or {}).get("status") == "True"
        ),
        120,
        "generation 2 applied, its pod waiting for room",
    )
    assert condition(held, "Reconciling")["status"] == "True" and condition(held, "Stalled")["status"] == "False"
    assert condition(held, "Ready")["observedGeneration"] == 1  # still serving on generation 1's pod
    for _ in range(5):  # a wrong Current would show within a second or two: give it the chance
        assert kstatus(seen.poll()).status == IN_PROGRESS
        time.sleep(1)

    gpu_nodes()  # room for the new pod
    second = seen.until(judged(2, CURRENT), 180, "generation 2 Current")
    assert_serves_alone(control_plane, ns, name, second, first_hash)

    # The model download of generation 2's pod fails (401): Stalled, Failed, naming the cause.
    exit_code, message = run_download_against_401(tmp_path)
    (pod,) = [p for p in engine_pods(control_plane, ns, name) if not p["metadata"].get("deletionTimestamp")]
    report_init_failure(control_plane, ns, pod, exit_code, message)
    failed = seen.until(judged(2, FAILED), 60, "Failed on the failing download")
    stalled = condition(failed, "Stalled")
    assert stalled["reason"] == DOWNLOAD_FAILED and "401 Unauthorized" in stalled["message"], stalled
    assert kstatus(failed).message == stalled["message"]

    for obj in seen.objects:  # every version seen: never both, and Current only when the generation serves
        flags = [(condition(obj, t) or {}).get("status") for t in ("Reconciling", "Stalled")]
        assert flags != ["True", "True"], obj["status"]
        if kstatus(obj).status == CURRENT:
            ready = condition(obj, "Ready")
            assert ready["reason"] == "MinimumReplicasReady" and ready["status"] == "True"
            assert ready["observedGeneration"] == obj["metadata"]["generation"] == obj["status"]["observedGeneration"]

    health = ArgoHealth()
    for obj in seen.objects:
        verdict, argo = kstatus(obj), health(obj)
        assert argo.status == ARGO_FOR[verdict.status], (verdict, argo, obj["status"])
    assert health(failed).message == f"{DOWNLOAD_FAILED}: {stalled['message']}"
