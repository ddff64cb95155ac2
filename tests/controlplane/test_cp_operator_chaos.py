"""Chaos: the operator (production defaults) is SIGKILLed 20 times at random points while services are
created, updated, deleted and autoscaled. After the last restart everything converges: Ready at the
latest generation, exactly the planned children, exactly the desired pods on the current template,
deleted services leave nothing behind. An autoscaled service under steady load keeps the replicas the
autoscaler gave it across every restart: its Deployment's replicas never go down (a watch records
every change). The seed is printed; TIDEPOOL_CHAOS_SEED=<seed> replays the same sequence."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import pytest
import yaml
from autoscale_feed import Feed, feed_server
from kubernetes import client, watch
from operator_kit import (
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
from tidepool.operator.builders import ServiceView, desired_state

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(900)]

NAMES = ("alpha", "bravo", "charlie", "delta")
AUTOSCALED, MAX_REPLICAS = "echo", 3
NUM_KILLS = 20


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


def autoscaled_spec() -> dict[str, Any]:
    spec = small_spec(random.Random(0))
    spec["pools"]["unified"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": MAX_REPLICAS}
    spec["autoscaling"] = {"enabled": True, "kvCacheTarget": 0.5, "stabilization": {"upSeconds": 0}}
    return spec


def apply(cluster, namespace: str, name: str, spec: dict[str, Any]) -> None:
    obj = {"apiVersion": "tidepool.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))


def planned(name: str, namespace: str, spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    view = ServiceView.from_spec(InferenceServiceSpec.model_validate(spec).to_wire())
    return {(c["kind"], c["metadata"]["name"]): c for c in desired_state(name, namespace, view).children}


def converged(cluster, namespace: str, live: dict[str, dict[str, Any]]) -> str | None:
    """None when converged, else what is still wrong (the last value is shown on timeout)."""
    found = children(cluster, namespace)
    for name in (*NAMES, AUTOSCALED):
        obj = get_isvc(cluster, namespace, name)
        mine = {k: v for k, v in found.items() if v["metadata"]["labels"]["tidepool.dev/inferenceservice"] == name}
        if name not in live:
            if obj is not None or mine:
                return f"{name}: deleted but {'object' if obj else 'children'} remain ({sorted(mine)[:3]})"
            continue
        if not is_ready(obj):
            status = (obj or {}).get("status", {})
            gen = (obj or {}).get("metadata", {}).get("generation")
            return (
                f"{name}: not Ready at generation {gen}: {status.get('observedGeneration')}, {status.get('conditions')}"
            )
        plan = planned(name, namespace, live[name])
        if set(mine) != set(plan):
            return f"{name}: children {sorted(set(mine) ^ set(plan))} differ from the plan"
        want_hash = plan[("Deployment", f"{name}-unified")]["spec"]["template"]["metadata"]["labels"][
            "tidepool.dev/spec-hash"
        ]
        want = MAX_REPLICAS if name == AUTOSCALED else live[name]["pools"]["unified"]["replicas"]
        if mine[("Deployment", f"{name}-unified")]["spec"]["replicas"] != want:
            return (
                f"{name}: Deployment replicas {mine[('Deployment', f'{name}-unified')]['spec']['replicas']} != {want}"
            )
        engine_pods = pods(cluster, namespace, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified")
        hashes = sorted(p["metadata"]["labels"]["tidepool.dev/spec-hash"] for p in engine_pods)
        if hashes != [want_hash] * want or not all(map(pod_is_ready, engine_pods)):
            return f"{name}: engine pods {hashes} not {want} x {want_hash} ready"  # no duplicates, none missing
    return None


class ReplicaRecorder:
    """Every spec.replicas the autoscaled service's engine Deployment ever had, from a watch.

    The watch runs in short rounds, each resumed from the last resourceVersion (no event is lost
    between rounds), so that leaving the `with` stops the thread within one round and joins it. A
    thread left behind kept re-watching after the control plane had stopped, into interpreter
    shutdown, where CPython 3.11 ends a daemon thread that wants the GIL back with pthread_exit;
    inside a kubernetes client call (pydantic-core's Rust frames, which cannot unwind) that aborts
    the whole pytest process, silently, after every test passed.
    """

    ROUND_S = 5  # server-side timeout of one watch request

    def __init__(self, cluster, namespace: str) -> None:
        self.apps = client.AppsV1Api(cluster.api_client())
        self.namespace, self.values = namespace, []
        self._stopping = threading.Event()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, name="replica-recorder", daemon=True)

    def _run(self) -> None:
        selector = f"metadata.name={AUTOSCALED}-unified"
        resource_version: str | None = None  # None: list afresh (ADDED repeats the current value)
        while not self._stopping.is_set():
            self._watch = watch.Watch()
            kwargs: dict[str, Any] = {"field_selector": selector, "timeout_seconds": self.ROUND_S}
            kwargs["_request_timeout"] = (10, self.ROUND_S + 20)  # a hung connection cannot outlive the test
            if resource_version:
                kwargs["resource_version"] = resource_version
            try:
                for event in self._watch.stream(self.apps.list_namespaced_deployment, self.namespace, **kwargs):
                    if event["type"] in ("ADDED", "MODIFIED"):
                        replicas = event["object"].spec.replicas
                        if not self.values or self.values[-1] != replicas:
                            self.values.append(replicas)
                resource_version = self._watch.resource_version
            except Exception:  # a dropped or expired (410) watch: list again (a missed value only weakens the check)
                resource_version = None
                self._stopping.wait(0.5)

    def __enter__(self) -> ReplicaRecorder:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopping.set()
        self._watch.stop()
        self._thread.join(60)
        if self._thread.is_alive():
            raise RuntimeError("the replica recorder's watch thread did not stop within 60 s")


def operate(cluster, namespace: str, rng: random.Random, live: dict[str, dict[str, Any]], log: list, step: int):
    """One random create, update or delete of the plain services."""
    name = rng.choice(NAMES)
    if name not in live:
        live[name] = small_spec(rng)
        apply(cluster, namespace, name, live[name])
        log.append(f"{step}: create {name}")
    elif rng.random() < 0.3:
        cluster.kubectl("delete", "inferenceservice", name, "-n", namespace, "--wait=false")
        del live[name]
        log.append(f"{step}: delete {name}")
    else:
        live[name] = small_spec(rng)
        apply(cluster, namespace, name, live[name])
        log.append(f"{step}: update {name}")


def test_operator_killed_at_random_points_converges(control_plane, cp_namespace, tmp_path, monkeypatch):
    seed = int(os.environ.get("TIDEPOOL_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"chaos seed {seed} (TIDEPOOL_CHAOS_SEED={seed} replays it)")
    rng = random.Random(seed)
    ns = cp_namespace
    install_crd(control_plane)
    identity = operator_identity(control_plane, tmp_path)
    restricted_namespace(control_plane, ns)
    feed = Feed(control_plane)
    feed.set("unified", kv=0.9, requests=5)  # steady load: the autoscaled service wants more than it may have
    with feed_server(feed) as url, NodeLeaseKeeper(control_plane), ReplicaRecorder(control_plane, ns) as recorder:
        monkeypatch.setenv("TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE", url + "/{namespace}/{name}/{pool}")
        monkeypatch.setenv("TIDEPOOL_AUTOSCALE_INTERVAL", "2")
        monkeypatch.setenv("TIDEPOOL_AUTOSCALE_WINDOW", "6")
        # A short Lease: each SIGKILLed leader's Lease must expire before the next start leads (with the
        # default 15 s that is 20 restarts x ~20 s of waiting); HA timing is tested with the defaults.
        # The renew deadline still leaves a busy machine's API server 6 s per renewal: a leader that
        # misses it exits (leader.py), and the run would lose its only operator.
        lease = ("--lease-duration-seconds", "8", "--renew-deadline-seconds", "6", "--retry-period-seconds", "1")
        op = OperatorProcess(identity.kubeconfig, [ns], tmp_path / "operator.log", extra_args=lease)
        live: dict[str, dict[str, Any]] = {AUTOSCALED: autoscaled_spec()}
        log: list[str] = []
        apply(control_plane, ns, AUTOSCALED, live[AUTOSCALED])
        try:
            for step in range(NUM_KILLS):
                op.start()
                wait_until(lambda: "caches synced" in op.log_text().rsplit("---- start", 1)[-1], 60, "leading")
                operate(control_plane, ns, rng, live, log, step)
                time.sleep(rng.uniform(0.0, 3.0))  # somewhere in the reconciles that operation started
                op.kill()
                log.append(f"{step}: operator SIGKILLed ({AUTOSCALED} replicas so far {recorder.values})")
                if rng.random() < 0.3:
                    operate(control_plane, ns, rng, live, log, step)  # a change while no operator runs
            op.start()
            print("\n".join(log))
            last: list[str | None] = ["not checked"]

            def done() -> bool:
                last[0] = converged(control_plane, ns, live)
                return last[0] is None

            t0 = time.monotonic()
            try:
                wait_until(done, 240, "convergence", interval_s=1)
            except AssertionError as exc:
                raise AssertionError(f"not converged: {last[0]}") from exc
            print(f"converged {time.monotonic() - t0:.1f}s after the last restart; {op.num_starts} operator starts")
            time.sleep(10)  # stays converged (the autoscaler keeps deciding meanwhile)
            assert converged(control_plane, ns, live) is None
        finally:
            op.stop()
    print(f"{AUTOSCALED} replicas over the run: {recorder.values}")
    assert op.num_starts == NUM_KILLS + 1
    assert recorder.values[-1] == MAX_REPLICAS
    assert recorder.values == sorted(recorder.values), f"autoscaled replicas went down: {recorder.values}"
    forbidden = op.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])
