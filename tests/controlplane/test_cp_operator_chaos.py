"""Chaos: the operator is SIGKILLed at random points during 20 create/update/delete operations; after a
final restart everything converges (Ready at the latest generation, exactly the planned children, the
desired pods and no more) and deleted services leave nothing behind. The seed is printed; rerun with
TIDEPOOL_CHAOS_SEED=<seed> to replay the same sequence."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest
import yaml
from test_cp_operator_support import (
    NodeLeaseKeeper,
    OperatorProcess,
    children,
    get_isvc,
    install_crd,
    is_ready,
    operator_identity,
    pod_is_ready,
    pods,
    restricted_namespace,
    wait_until,
)

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.builders import ServiceView, build_children

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(420)]

NAMES = ("alpha", "bravo", "charlie", "delta")
NUM_OPERATIONS = 20


def small_spec(rng: random.Random) -> dict[str, Any]:
    """A one-GPU unified service; fields the operations below vary."""
    return {
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
        "engine": {"maxNumSeqs": rng.choice([32, 64, 128])},
        "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "4Gi"},
        "mode": "unified",
        "pools": {"unified": {"replicas": rng.randint(1, 2), "minReplicas": 1, "maxReplicas": 4}},
        "router": {"replicas": 1, "policy": rng.choice(["prefix-aware", "least-load", "round-robin"])},
    }


def apply(cluster, namespace: str, name: str, spec: dict[str, Any]) -> None:
    obj = {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def planned(name: str, namespace: str, spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    view = ServiceView.from_spec(InferenceServiceSpec.model_validate(spec).to_wire())
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(name, namespace, view)}


def converged(cluster, namespace: str, live: dict[str, dict[str, Any]]) -> str | None:
    """None when converged, else what is still wrong (the last value is shown on timeout)."""
    found = children(cluster, namespace)
    for name in NAMES:
        obj = get_isvc(cluster, namespace, name)
        mine = {k: v for k, v in found.items() if v["metadata"]["labels"]["tidepool.dev/inferenceservice"] == name}
        if name not in live:
            if obj is not None or mine:
                return f"{name}: deleted but {'object' if obj else 'children'} remain ({sorted(mine)[:3]})"
            continue
        if not is_ready(obj):
            status = (obj or {}).get("status", {})
            ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
            gen = (obj or {}).get("metadata", {}).get("generation")
            return (
                f"{name}: not Ready at generation {gen}: observedGeneration {status.get('observedGeneration')}, {ready}"
            )
        plan = planned(name, namespace, live[name])
        if set(mine) != set(plan):
            return f"{name}: children {sorted(set(mine) ^ set(plan))} differ from the plan"
        deploy = plan[("Deployment", f"{name}-unified")]
        want_hash = deploy["spec"]["template"]["metadata"]["labels"]["tidepool.dev/spec-hash"]
        engine_pods = pods(cluster, namespace, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified")
        hashes = sorted(p["metadata"]["labels"]["tidepool.dev/spec-hash"] for p in engine_pods)
        if hashes != [want_hash] * deploy["spec"]["replicas"] or not all(map(pod_is_ready, engine_pods)):
            return f"{name}: engine pods {hashes} not {deploy['spec']['replicas']} x {want_hash} ready"
    return None


def test_operator_killed_at_random_points_converges(control_plane, cp_namespace, tmp_path):
    seed = int(os.environ.get("TIDEPOOL_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"chaos seed {seed} (TIDEPOOL_CHAOS_SEED={seed} replays it)")
    rng = random.Random(seed)
    install_crd(control_plane)
    identity = operator_identity(control_plane, tmp_path)
    restricted_namespace(control_plane, cp_namespace)
    op = OperatorProcess(identity.kubeconfig, [cp_namespace], tmp_path / "operator.log", resync_seconds=3)
    live: dict[str, dict[str, Any]] = {}
    log: list[str] = []
    keeper = NodeLeaseKeeper(control_plane).__enter__()
    op.start()
    try:
        for step in range(NUM_OPERATIONS):
            # A name deleted while the operator was down stays Terminating (our finalizer) until it
            # returns; applying it again would only edit the dying object, so it is not reused until gone.
            def usable() -> list[str]:
                return [n for n in NAMES if n in live or get_isvc(control_plane, cp_namespace, n) is None]

            if not usable():  # every name is Terminating: only a running operator can release them
                if not op.is_alive():
                    op.start()
                    log.append(f"{step}: operator restarted (all names terminating)")
                wait_until(usable, 60, "a name to become free")
            name = rng.choice(usable())
            if name not in live:
                live[name] = small_spec(rng)
                apply(control_plane, cp_namespace, name, live[name])
                log.append(f"{step}: create {name}")
            elif rng.random() < 0.3:
                control_plane.kubectl(
                    "delete", "inferenceservice", name, "-n", cp_namespace, "--wait=false", "--ignore-not-found"
                )
                del live[name]
                log.append(f"{step}: delete {name}")
            else:
                live[name] = small_spec(rng)
                apply(control_plane, cp_namespace, name, live[name])
                log.append(f"{step}: update {name}")
            time.sleep(rng.uniform(0.0, 1.5))  # let the operator get part-way through
            never_killed = not any("SIGKILL" in line for line in log)
            if op.is_alive() and (rng.random() < 0.4 or (step == NUM_OPERATIONS // 2 and never_killed)):
                op.kill()
                log.append(f"{step}: operator SIGKILLed")
            elif not op.is_alive() and rng.random() < 0.6:
                op.start()
                log.append(f"{step}: operator restarted")
        if not op.is_alive():
            op.start()
            log.append("end: operator restarted")
        print("\n".join(log))
        last: list[str | None] = ["not checked"]

        def done() -> bool:
            last[0] = converged(control_plane, cp_namespace, live)
            return last[0] is None

        t0 = time.monotonic()
        try:
            wait_until(done, 180, "convergence", interval_s=1)
        except AssertionError as exc:
            raise AssertionError(f"not converged: {last[0]}") from exc
        print(f"converged {time.monotonic() - t0:.1f}s after the last operation; {op.num_starts} operator starts")
        time.sleep(4)  # stable: still converged after another resync round
        assert converged(control_plane, cp_namespace, live) is None
        assert op.num_starts >= 2
    finally:
        op.stop()
        keeper.__exit__()
    forbidden = op.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])
