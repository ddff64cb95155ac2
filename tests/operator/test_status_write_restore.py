"""Writing status.autoscaling only on change loses nothing a restart needs: after long quiet stretches (no status
write for many minutes), a restarted autoscaler neither scales down nor scales to zero earlier than one that kept
running. This is what `restore_history` guarantees by taking the newest recommendation, and activity seen by the
tick that wrote, as still holding (autoscaler/handlers.py). Restoring their recorded times instead would let a
restart after ten quiet minutes scale to zero at once (checked by mutation: the zero test then fails); a
scale-down is also held by the restarted autoscaler's first tick, whose empty metrics window never shrinks.

The autoscaler runs on a fake clock against a fake status subresource and a metrics source whose load the test
sets; the reconcile's part (recording the replicas it applied in status.pools) is played by the test.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from tidepool.contract import metrics_names as names
from tidepool.operator.api import ServiceView
from tidepool.operator.autoscaler import handlers
from tidepool.operator.autoscaler.collector import PoolBodies

STEP_S = 15.0


class Source:
    """`num_pods` pods sharing KV demand `kv_total` (each at kv_total / num_pods); while `requests`, the TTFT
    counter grows by 10 per scrape."""

    def __init__(self) -> None:
        self.kv_total, self.num_pods, self.requests, self.total = 1.8, 2, True, 0

    async def fetch(self, namespace: str, name: str, pools: tuple[str, ...]) -> dict[str, PoolBodies]:
        self.total += 10 if self.requests else 0
        registry = CollectorRegistry()
        label = [names.MODEL_NAME_LABEL]
        ttft = Histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "t", label, buckets=(0.05, 0.25, 1.0), registry=registry)
        for _ in range(self.total):
            ttft.labels("m").observe(0.1)
        kv = self.kv_total / max(self.num_pods, 1)
        Gauge(names.KV_CACHE_USAGE_PERC, "kv", label, registry=registry).labels("m").set(kv)
        Gauge(names.NUM_REQUESTS_RUNNING, "r", label, registry=registry).labels("m").set(2 if self.requests else 0)
        Gauge(names.NUM_REQUESTS_WAITING, "w", label, registry=registry).labels("m").set(0)
        body = generate_latest(registry).decode()
        return {pool: PoolBodies({f"{pool}-{i}": body for i in range(self.num_pods)}) for pool in pools}


class Cluster:
    """One InferenceService's body; status patches merged into it; the clock and the metrics shared by every
    autoscaler (operator process) the test starts."""

    def __init__(self, autoscaling: dict[str, Any]) -> None:
        spec = {
            "model": {"uri": "hf://org/m"},
            "mode": "unified",
            "pools": {"unified": {"replicas": 2, "minReplicas": 0, "maxReplicas": 8}},
            "autoscaling": {"enabled": True, "kvCacheTarget": 0.5, **autoscaling},
        }
        self.body: dict[str, Any] = {
            "metadata": {"namespace": "ns", "name": "svc", "resourceVersion": "1"},
            "spec": spec,
            "status": {},
        }
        self.now, self.source, self.num_patches = 1_000_000.0, Source(), 0

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict, resource_version=None) -> dict:
        assert resource_version == self.body["metadata"]["resourceVersion"]
        self.num_patches += 1
        auto = self.body["status"].setdefault("autoscaling", {})
        for key, value in copy.deepcopy(status["autoscaling"]).items():
            if value is None:
                auto.pop(key, None)
            else:
                auto[key] = value
        self.body["metadata"]["resourceVersion"] = str(int(self.body["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(self.body)

    def operator(self) -> tuple[handlers.Autoscaler, handlers.AutoscaleState]:
        """A (re)started operator's autoscaler: nothing in memory."""

        async def event(*_: Any) -> None:
            return None

        auto = handlers.Autoscaler(self, lambda ns, n: [], event, self.source, STEP_S, 60.0, clock=lambda: self.now)
        return auto, handlers.AutoscaleState()

    def tick(self, running: tuple[handlers.Autoscaler, handlers.AutoscaleState]) -> int:
        auto, state = running
        self.body = dict(asyncio.run(auto.tick(("ns", "svc"), ServiceView.from_body(self.body), self.body, state)))
        self.now += STEP_S
        replicas = handlers.applied_replicas(ServiceView.from_body(self.body), self.body["status"])[0]["unified"]
        self.body["status"]["pools"] = {"unified": {"desiredReplicas": replicas}}  # the reconcile's part
        self.source.num_pods = replicas
        return replicas


def ticks_until(cluster: Cluster, running: Any, done: Any, limit: int = 80) -> int:
    for n in range(1, limit):
        if done(cluster.tick(running)):
            return n
    raise AssertionError("never happened")


def quiet_then(autoscaling: dict[str, Any], change: Any, done: Any, restart: bool) -> tuple[int, int]:
    """Grow to 4 replicas, hold 10 quiet minutes, `change` the load, (restart), count ticks until `done`; returns
    (those ticks, status writes during the quiet minutes)."""
    cluster = Cluster(autoscaling)
    running = cluster.operator()
    assert [cluster.tick(running) for _ in range(3)][-1] == 4  # KV 0.9 / 0.5 on 2 pods; 0.45 on 4: holds
    quiet_from = cluster.num_patches
    for _ in range(40):
        assert cluster.tick(running) == 4
    quiet_writes = cluster.num_patches - quiet_from
    change(cluster.source)
    return ticks_until(cluster, cluster.operator() if restart else running, done), quiet_writes


def test_a_restart_after_quiet_minutes_scales_down_no_earlier():
    autoscaling = {"stabilization": {"upSeconds": 0, "downSeconds": 120}}

    def less_load(source: Source) -> None:
        source.kv_total = 0.2

    kept, quiet_writes = quiet_then(autoscaling, less_load, lambda r: r < 4, restart=False)
    restarted, _ = quiet_then(autoscaling, less_load, lambda r: r < 4, restart=True)
    assert quiet_writes == 0  # ten steady minutes: not one status write
    assert kept >= 120 / STEP_S  # the down window holds the old recommendation
    assert restarted >= kept and restarted >= 120 / STEP_S


def test_a_restart_after_quiet_minutes_scales_to_zero_no_earlier():
    autoscaling = {"scaleToZero": {"enabled": True, "idleSeconds": 300}}

    def no_requests(source: Source) -> None:
        source.requests = False

    kept, quiet_writes = quiet_then(autoscaling, no_requests, lambda r: r == 0, restart=False)
    restarted, _ = quiet_then(autoscaling, no_requests, lambda r: r == 0, restart=True)
    assert quiet_writes == 0
    assert kept >= 300 / STEP_S
    # The last request came with the load change, and the restart with it: idleSeconds from there, never less.
    # (The operator that kept running goes a metrics window later: its window still held the last requests.)
    assert restarted >= 300 / STEP_S
