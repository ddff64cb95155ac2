"""Ready tells the truth on the real control plane, with the operator's production defaults.

KWOK makes every scheduled pod Ready at once, so a new template's pods are held back the way a
real cluster holds them: no room. Each test gets its own KWOK GPU nodes (a label only its
InferenceService selects); the new pods stay Pending until the test adds a node. Checked:
- after a spec change, `kubectl wait --for=condition=Ready` keeps waiting while only the old
  template's pods serve (and the service stays Ready=True for the generation it was ready at), and
  returns once pods with the new template hash are Ready;
- a mode switch (unified -> disaggregated) keeps the old pool running and serving until the new
  pools serve, then removes it (make before break).
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest
import yaml
from operator_kit import (
    children,
    condition,
    get_isvc,
    is_ready,
    pod_is_ready,
    pods,
    wait_until,
)

from controlplane_fixture import load_devcluster

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(600)]
NODE_LABEL = "tidepool.dev/test-pool"
HASH = "tidepool.dev/spec-hash"


@pytest.fixture
def nodes(control_plane, cp_namespace):
    """add() creates a KWOK node with 8 GPUs that only this test's pods select; all removed afterwards."""
    devcluster = load_devcluster()
    made: list[str] = []

    def add() -> str:
        name = f"{cp_namespace[:40]}-{len(made)}"
        node = devcluster.gpu_node(name)
        node["metadata"]["labels"][NODE_LABEL] = cp_namespace
        control_plane.kubectl("create", "-f", "-", input=yaml.safe_dump(node))
        made.append(name)
        wait_until(lambda: _node_ready(control_plane, name), 60, f"node {name} Ready")
        return name

    yield add
    for name in made:
        control_plane.kubectl("delete", "node", name, "--wait=false", check=False)


def _node_ready(cluster, name: str) -> bool:
    out = cluster.kubectl("get", "node", name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}")
    return out.stdout.strip() == "True"


def service(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """A service whose every replica fills one whole 8-GPU node of this test."""
    body = {
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
        "engine": {"maxNumSeqs": 128},
        "resources": {"gpusPerReplica": 8, "cpu": "1", "memory": "4Gi"},
        "parallelism": {"tensor": 8, "pipeline": 1},
        "mode": "unified",
        "pools": {"unified": {"replicas": 1}},
        "router": {"replicas": 1},
        "pod": {"nodeSelector": {NODE_LABEL: namespace}},
        **spec,
    }
    return {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def apply(cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def complete(cluster, namespace: str, name: str, generation: int) -> dict[str, Any] | None:
    obj = get_isvc(cluster, namespace, name)
    ok = (
        obj is not None
        and obj["metadata"]["generation"] == generation
        and is_ready(obj)
        and (condition(obj, "Progressing") or {}).get("status") == "False"
    )
    return obj if ok else None


def pool_pods(cluster, namespace: str, name: str, pool: str) -> list[dict[str, Any]]:
    return pods(cluster, namespace, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool={pool}")


def test_kubectl_wait_returns_only_when_the_new_template_serves(control_plane, cp_namespace, operator, nodes):
    ns, name = cp_namespace, "rollout"
    nodes()
    apply(control_plane, ns, service(name, ns))
    wait_until(lambda: complete(control_plane, ns, name, 1), 180, "generation 1 complete")
    (old_pod,) = pool_pods(control_plane, ns, name, "unified")
    old_hash = old_pod["metadata"]["labels"][HASH]

    control_plane.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge",
                          "-p", '{"spec":{"engine":{"maxNumSeqs":64}}}')  # fmt: skip
    wait = subprocess.Popen(
        [str(control_plane.bin_dir / "kubectl"), f"--kubeconfig={control_plane.kubeconfig}", "wait", "-n", ns,
         "--for=condition=Ready", f"inferenceservice/{name}", "--timeout=400s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # The operator applied generation 2 and its pod waits for room (the only node is full).
        def new_pod_pending() -> list[dict[str, Any]] | None:
            obj = get_isvc(control_plane, ns, name)
            fresh = [
                p for p in pool_pods(control_plane, ns, name, "unified") if p["metadata"]["labels"][HASH] != old_hash
            ]
            applied = obj and (obj.get("status") or {}).get("observedGeneration") == 2
            return fresh if applied and fresh and not any(map(pod_is_ready, fresh)) else None

        wait_until(new_pod_pending, 120, "generation 2 applied, its pod Pending")
        wait_until(lambda: (condition(get_isvc(control_plane, ns, name), "ScalingLimited") or {}).get("status")
                   == "True", 60, "ScalingLimited while the new pod cannot be scheduled")  # fmt: skip
        for _ in range(10):  # a wrong Ready would end the wait within a second or two: give it the chance
            assert wait.poll() is None, f"kubectl wait returned before the new template served: {wait.stdout.read()}"
            ready = condition(get_isvc(control_plane, ns, name), "Ready")
            # Still serving on the old pod: Ready stays True, about generation 1 (so `kubectl wait` waits).
            assert ready["status"] == "True" and ready["observedGeneration"] == 1, ready
            assert [pod_is_ready(p) for p in pool_pods(control_plane, ns, name, "unified") if
                    p["metadata"]["labels"][HASH] == old_hash] == [True]  # fmt: skip
            time.sleep(1)

        nodes()  # room for the new pod
        _, err = wait.communicate(timeout=420)
        assert wait.returncode == 0, err
        served = [
            p for p in pool_pods(control_plane, ns, name, "unified")
            if p["metadata"]["labels"][HASH] != old_hash and pod_is_ready(p)
        ]  # fmt: skip
        assert served, "kubectl wait returned but no pod with the new template hash is Ready"
        obj = get_isvc(control_plane, ns, name)
        assert is_ready(obj) and condition(obj, "Ready")["observedGeneration"] == 2
    finally:
        if wait.poll() is None:
            wait.kill()
            wait.wait()
    wait_until(lambda: complete(control_plane, ns, name, 2), 180, "generation 2 complete, old pod gone")
    assert {p["metadata"]["labels"][HASH] for p in pool_pods(control_plane, ns, name, "unified")} != {old_hash}


def test_mode_switch_keeps_the_old_pool_until_the_new_pools_serve(control_plane, cp_namespace, operator, nodes):
    ns, name = cp_namespace, "switch"
    nodes()
    apply(control_plane, ns, service(name, ns))
    wait_until(lambda: complete(control_plane, ns, name, 1), 180, "unified complete")

    pools = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    apply(control_plane, ns, service(name, ns, mode="disaggregated", pools=pools))

    def waiting_for_room() -> bool:
        obj = get_isvc(control_plane, ns, name)
        found = children(control_plane, ns, name)
        return bool(
            obj
            and (obj.get("status") or {}).get("observedGeneration") == 2
            and ("Deployment", f"{name}-prefill") in found
            and ("Deployment", f"{name}-decode") in found
        )

    wait_until(waiting_for_room, 120, "the new pools applied")
    for _ in range(5):  # the old pool keeps serving while the new pools cannot run
        found = children(control_plane, ns, name)
        assert ("Deployment", f"{name}-unified") in found and ("Service", f"{name}-unified") in found
        assert all(map(pod_is_ready, pool_pods(control_plane, ns, name, "unified")))
        ready = condition(get_isvc(control_plane, ns, name), "Ready")
        assert ready["status"] == "True" and ready["observedGeneration"] == 1, ready
        time.sleep(1)

    nodes()
    nodes()  # room for prefill and decode
    wait_until(lambda: complete(control_plane, ns, name, 2), 240, "disaggregated complete")

    def old_pool_gone() -> bool:
        found = children(control_plane, ns, name)
        return not any(k[1] == f"{name}-unified" for k in found) and not pool_pods(control_plane, ns, name, "unified")

    wait_until(old_pool_gone, 120, "the unified pool removed")
