"""The operator on the real control plane, as the chart's ServiceAccount (never admin), in namespaces
enforcing Pod Security "restricted", with its production defaults (a 10-minute resync: everything
below is driven by watch events): samples become Ready with every child, spec changes roll out,
hand edits are reverted, deletion garbage-collects everything, and no request is ever forbidden."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from operator_kit import (
    bind_claims,
    children,
    claims_in,
    condition,
    get_isvc,
    is_ready,
    load_example,
    pod_is_ready,
    pods,
    wait_until,
)

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.builders import ServiceView, desired_state

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

SAMPLES = ("inferenceservice-unified.yaml", "inferenceservice-disaggregated.yaml")


def expected_children(name: str, namespace: str, spec: dict[str, Any]) -> set[tuple[str, str]]:
    view = ServiceView.from_spec(InferenceServiceSpec.model_validate(spec).to_wire())
    return {(c["kind"], c["metadata"]["name"]) for c in desired_state(name, namespace, view).children}


def apply_isvc(cluster, namespace: str, obj: dict[str, Any]) -> None:
    bind_claims(cluster, namespace, claims_in(obj["spec"]))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def wait_ready(cluster, namespace: str, name: str, timeout_s: float = 120) -> dict[str, Any]:
    # What users run; then re-read to check the generation the condition is about.
    cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", f"inferenceservice/{name}", f"--timeout={int(timeout_s)}s",
        timeout=timeout_s + 10,
    )  # fmt: skip
    return wait_until(lambda: (o := get_isvc(cluster, namespace, name)) and is_ready(o) and o, 60, f"{name} Ready")


def wait_complete(cluster, namespace: str, name: str, timeout_s: float = 120) -> dict[str, Any]:
    """Ready, and every replica up on the current spec (Progressing=False): Ready alone needs minReplicas."""
    wait_ready(cluster, namespace, name, timeout_s)

    def complete() -> dict[str, Any] | None:
        obj = get_isvc(cluster, namespace, name)
        done = is_ready(obj) and (condition(obj, "Progressing") or {}).get("status") == "False"
        return obj if done else None

    return wait_until(complete, timeout_s, f"{name} complete")


def events_of(cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.kind=InferenceService,involvedObject.name={name}",
    )  # fmt: skip
    return json.loads(out.stdout)["items"]


def test_samples_create_every_child_and_become_ready(control_plane, cp_namespace, operator):
    ns = cp_namespace
    samples = [load_example(f) for f in SAMPLES]
    for obj in samples:
        apply_isvc(control_plane, ns, obj)
    gpu_nodes = json.loads(control_plane.kubectl("get", "nodes", "-l", "type=kwok", "-o", "json").stdout)["items"]
    products = {n["metadata"]["name"]: n["metadata"]["labels"]["nvidia.com/gpu.product"] for n in gpu_nodes}

    for obj in samples:
        name, spec = obj["metadata"]["name"], obj["spec"]
        isvc = wait_complete(control_plane, ns, name)
        model = InferenceServiceSpec.model_validate(spec)
        found = children(control_plane, ns, name)
        assert set(found) == expected_children(name, ns, spec), f"{name}: children differ from the builders' plan"
        for child in found.values():
            if child["kind"] == "PersistentVolumeClaim":  # a cache claim is never owned (test_cp_cache_claims.py)
                assert not child["metadata"].get("ownerReferences"), child["metadata"]
                continue
            refs = child["metadata"]["ownerReferences"]
            assert [r["uid"] for r in refs] == [isvc["metadata"]["uid"]], child["metadata"]["name"]

        status = isvc["status"]
        for pool in model.pool_names():
            want = model.pool_replicas(pool)
            assert status["pools"][pool] == {
                "replicas": want,
                "readyReplicas": want,
                "updatedReplicas": want,
                "desiredReplicas": want,
            }
            pool_pods = pods(control_plane, ns, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool={pool}")
            assert len(pool_pods) == want and all(pod_is_ready(p) for p in pool_pods), pool
            for pod in pool_pods:
                assert pod["spec"]["nodeName"] in products  # a KWOK GPU node
                engine = pod["spec"]["containers"][0]
                assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(model.gpus_per_pod())
                if model.resources.gpu_product:
                    assert products[pod["spec"]["nodeName"]] == model.resources.gpu_product
        assert status["replicas"] == model.pool_replicas(model.scaled_pool())
        assert status["selector"] == f"tidepool.dev/inferenceservice={name},tidepool.dev/pool={model.scaled_pool()}"
        assert status["url"] == f"http://{name}-router.{ns}.svc"
        for type_, want in (("Progressing", "False"), ("Degraded", "False"), ("ScalingLimited", "False")):
            assert condition(isvc, type_)["status"] == want, (type_, condition(isvc, type_))
        assert any(e["reason"] == "Created" for e in events_of(control_plane, ns, name))

    table = control_plane.kubectl("get", "inferenceservices", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODE", "READY", "REPLICAS", "URL", "AGE"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert rows["smollm"][1:5] == ["unified", "True", "1", f"http://smollm-router.{ns}.svc"]
    assert rows["llama-8b"][1:5] == ["disaggregated", "True", "2", f"http://llama-8b-router.{ns}.svc"]


def test_rollout_revert_and_delete(control_plane, cp_namespace, operator):
    ns, kubectl = cp_namespace, control_plane.kubectl
    obj = load_example("inferenceservice-unified.yaml")
    name = obj["metadata"]["name"]
    obj["spec"]["pools"]["unified"]["replicas"] = 2
    apply_isvc(control_plane, ns, obj)
    wait_complete(control_plane, ns, name)
    deploy = f"{name}-unified"
    selector = f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified"
    old_hash = children(control_plane, ns, name)[("Deployment", deploy)]["spec"]["template"]["metadata"]["labels"][
        "tidepool.dev/spec-hash"
    ]

    # Spec change -> rollout: every pod ends up with the new hash, the old ones are gone.
    kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":64}}}')
    isvc = wait_until(
        lambda: (o := get_isvc(control_plane, ns, name)) and o["metadata"]["generation"] == 2 and is_ready(o) and o,
        120,
        "Ready at generation 2",
    )
    dep = children(control_plane, ns, name)[("Deployment", deploy)]
    new_hash = dep["spec"]["template"]["metadata"]["labels"]["tidepool.dev/spec-hash"]
    assert new_hash != old_hash
    assert "--max-num-seqs" in (args := dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args[args.index("--max-num-seqs") + 1] == "64"

    def rolled() -> list | None:
        current = pods(control_plane, ns, selector)
        hashes = [p["metadata"]["labels"]["tidepool.dev/spec-hash"] for p in current]
        return current if hashes == [new_hash, new_hash] and all(map(pod_is_ready, current)) else None

    wait_until(rolled, 90, "2 ready pods, all with the new spec hash")
    assert any(e["reason"] == "RollingOut" for e in events_of(control_plane, ns, name))
    assert isvc["status"]["observedGeneration"] == 2

    # Hand edits to fields the operator owns, and a deleted child, are reverted at once: their watch
    # events wake the operator (the resync is 10 minutes away).
    kubectl("scale", "deployment", deploy, "-n", ns, "--replicas=4")
    kubectl("patch", "rolebinding", f"{name}-router", "-n", ns, "--type=merge", "-p", '{"subjects":[]}')
    kubectl("delete", "poddisruptionbudget", deploy, "-n", ns)

    def reverted() -> bool:
        found = children(control_plane, ns, name)
        return (
            found[("Deployment", deploy)]["spec"]["replicas"] == 2
            and found[("RoleBinding", f"{name}-router")].get("subjects")
            and ("PodDisruptionBudget", deploy) in found
        )

    wait_until(reverted, 60, "hand edits reverted")
    assert any(e["reason"] == "DriftCorrected" for e in events_of(control_plane, ns, name))
    wait_ready(control_plane, ns, name)

    # Delete -> every child (and its pods) garbage-collected through owner references; the cache claim
    # (reclaimPolicy Retain, never owned) stays: test_cp_cache_claims.py.
    uid = isvc["metadata"]["uid"]
    kubectl("delete", "inferenceservice", name, "-n", ns, "--wait=true", "--timeout=60s", timeout=70)
    wait_until(
        lambda: all(k[0] == "PersistentVolumeClaim" for k in children(control_plane, ns, name)),
        90,
        "children garbage-collected",
    )
    wait_until(lambda: not pods(control_plane, ns, f"tidepool.dev/inferenceservice={name}"), 90, "pods gone")
    leftovers = json.loads(kubectl("get", "all", "-n", ns, "-o", "json").stdout)["items"]
    assert not [o for o in leftovers if uid in json.dumps(o.get("metadata", {}).get("ownerReferences", []))]


def test_a_cache_claim_keeps_what_kubernetes_cannot_change(control_plane, cp_namespace, operator):
    """A smaller modelCache size and other access modes for an existing (statically bound) claim: the claim keeps
    them, a Warning says why, and the rest of the new spec rolls out; no apply refused in a retry loop."""
    ns = cp_namespace
    obj = load_example("inferenceservice-unified.yaml")
    name, claim = "claimed", obj["spec"]["modelCache"]["persistentVolumeClaim"]["claimName"]
    obj["metadata"]["name"] = name
    apply_isvc(control_plane, ns, obj)
    wait_ready(control_plane, ns, name)
    patch = {
        "spec": {
            "engine": {"maxNumSeqs": 64},
            "modelCache": {"persistentVolumeClaim": {"size": "1Gi", "accessModes": ["ReadWriteOnce"]}},
        }
    }
    control_plane.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))

    def settled() -> dict[str, Any] | None:
        o = get_isvc(control_plane, ns, name)
        return o if o and o["status"].get("observedGeneration") == 2 and is_ready(o) else None

    settled_obj = wait_until(settled, 120, "generation 2 applied and Ready")
    assert (condition(settled_obj, "Degraded") or {}).get("status") != "True", settled_obj["status"]
    found = children(control_plane, ns, name)
    kept = found[("PersistentVolumeClaim", claim)]["spec"]
    assert kept["resources"]["requests"]["storage"] == "5Gi" and kept["accessModes"] == ["ReadWriteMany"]
    args = found[("Deployment", f"{name}-unified")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "64"
    warnings = [e["message"] for e in events_of(control_plane, ns, name) if e["reason"] == "ClaimKept"]
    assert warnings and "cannot shrink" in warnings[0] and "accessModes" in warnings[0], warnings
    assert "ApplyFailed" not in operator.log_text()


def test_invalid_spec_that_passes_admission_reports_why(control_plane, cp_namespace, operator):
    """tensor 16 is valid API-wise but exceeds one node's GPUs (the operator's --gpus-per-node 8): Degraded."""
    ns = cp_namespace
    obj = load_example("inferenceservice-unified.yaml")
    obj["metadata"]["name"] = "from-host"
    obj["spec"]["parallelism"] = {"tensor": 16}
    obj["spec"]["resources"]["gpusPerReplica"] = 16
    obj["spec"].pop("modelCache")
    apply_isvc(control_plane, ns, obj)

    def degraded():
        cond = condition(get_isvc(control_plane, ns, "from-host"), "Degraded")
        return cond if cond and cond["status"] == "True" else None

    cond = wait_until(degraded, 60, "Degraded=True")
    assert cond["reason"] == "InvalidSpec"
    assert "tensor parallelism stays within a node" in cond["message"]
    assert condition(get_isvc(control_plane, ns, "from-host"), "Ready")["status"] == "False"
    assert not children(control_plane, ns, "from-host")
