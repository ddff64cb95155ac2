"""Quiet at scale, without a cluster: an autoscaled service in advisory mode under steady load costs no status
write and no new Event once steady, however many autoscaler ticks and safety-net resyncs pass.

The controller's own sync (autoscaler tick, reconcile, status write, Events) runs against the in-memory API
server of fake_api.py with a metrics source whose load never changes (KV usage above target on every pod, so
the advisory recommendation differs from the replicas, which nothing external changes: the case that used to
post an AdvisoryScale Event every tick and refresh status every 60 s). Ticks are explicit (a fake clock moved
one autoscale interval per sync), so the counts do not depend on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from fake_api import NAME, NS, SPEC, FakeApi
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from tidepool.contract import metrics_names as names
from tidepool.operator.autoscaler.collector import PoolBodies
from tidepool.operator.autoscaler.handlers import Autoscaler
from tidepool.operator.controller import Controller, ControllerOptions

KEY = (NS, NAME)
INTERVAL_S = 15.0  # the autoscaler's production interval
RESYNC_TICKS = 40  # a full (safety-net) reconcile every 40 ticks: the production 10 minutes


class SteadyLoad:
    """Every Ready pod: KV usage `kv`, 10 requests per scrape with TTFT 0.1 s (counters grow, the rate holds)."""

    def __init__(self, api: FakeApi, kv: float) -> None:
        self.api, self.kv, self.num_scrapes = api, kv, 0

    def body(self) -> str:
        registry = CollectorRegistry()
        label = [names.MODEL_NAME_LABEL]
        ttft = Histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "ttft", label, buckets=(0.05, 0.25, 1.0), registry=registry)
        for _ in range(10 * self.num_scrapes):
            ttft.labels("m").observe(0.1)
        Gauge(names.KV_CACHE_USAGE_PERC, "kv", label, registry=registry).labels("m").set(self.kv)
        Gauge(names.NUM_REQUESTS_RUNNING, "r", label, registry=registry).labels("m").set(4)
        Gauge(names.NUM_REQUESTS_WAITING, "w", label, registry=registry).labels("m").set(0)
        return generate_latest(registry).decode()

    async def fetch(self, namespace: str, name: str, pools: tuple[str, ...]) -> dict[str, PoolBodies]:
        self.num_scrapes += 1
        out = {}
        for pool in pools:
            pods = [
                k[1]
                for k, p in self.api.objects.items()
                if k[0] == "Pod" and p["metadata"]["labels"]["tidepool.dev/pool"] == pool
            ]
            out[pool] = PoolBodies({pod: self.body() for pod in pods})
        return out


def advisory_spec(mode: str) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"] = {"enabled": True, "mode": "advisory", "kvCacheTarget": 0.5, "slo": {"ttftP95Ms": 500}}
    if mode == "disaggregated":
        spec["mode"] = "disaggregated"
        spec["pools"] = {
            "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 8},
            "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 8},
        }
    return spec


class EventsKept(FakeApi):
    """fake_api's server, keeping the Events it creates as objects too, so that the recorder can patch them."""

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Event":
            self.objects[("Event", obj["metadata"]["name"])] = copy.deepcopy(obj)
        return await super().create(obj)

    def event_objects(self, reason: str) -> list[dict[str, Any]]:
        return [o for (kind, _), o in self.objects.items() if kind == "Event" and o["reason"] == reason]


class Ticks:
    """One service under the controller, its autoscaler on a fake clock moved one interval per sync."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.now = [1_000_000.0]
        self.api = EventsKept()
        self.ctrl = Controller(self.api, ControllerOptions(), [NS], lambda: self.now[0])  # type: ignore[arg-type]
        self.api.store = self.ctrl.store
        self.api.put_service(spec)
        self.source = SteadyLoad(self.api, kv=0.9)
        services = self.ctrl.services
        clock = lambda: self.now[0]  # noqa: E731
        services.autoscaler = Autoscaler(
            self.api, self.ctrl.store.pods_in, services.events.post, self.source, INTERVAL_S, 60.0, clock=clock
        )
        self.num_ticks = 0

    def run(self, num_ticks: int) -> None:
        for _ in range(num_ticks):
            self.num_ticks += 1
            asyncio.run(self.ctrl.services.sync(KEY, full=self.num_ticks % RESYNC_TICKS == 0))
            self.now[0] += INTERVAL_S

    def all_pods_ready(self) -> None:
        for (kind, name), obj in list(self.api.objects.items()):
            if kind == "Deployment":
                pool = obj["metadata"]["labels"]["tidepool.dev/pool"]
                for i in range(int(obj["spec"]["replicas"])):
                    self.api.add_pod(f"{name}-p{i}", pool, self.api.hash_of(name))


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
def test_advisory_steady_state_writes_no_status_and_tells_one_event(mode: str):
    ticks = Ticks(advisory_spec(mode))
    ticks.run(1)  # children created
    ticks.all_pods_ready()
    ticks.run(8)  # Ready; the metrics window (60 s) fills; the recommendation settles
    api = ticks.api
    auto = api.service()["status"]["autoscaling"]
    assert auto["mode"] == "advisory" and auto["pools"][list(auto["pools"])[-1]]["desiredReplicas"] > 2, auto
    assert api.condition("Ready")["status"] == "True"
    writes, events = api.calls["patch_status"], len(api.events)
    advisory = [e for e in api.events if e["reason"] == "AdvisoryScale"]
    assert len(advisory) == 1, [e["message"] for e in advisory]

    ticks.run(3 * RESYNC_TICKS)  # 30 minutes of ticks, three safety-net resyncs among them
    assert api.calls["patch_status"] == writes, api.status_patches[-3:]
    assert len(api.events) == events
    assert api.service()["status"]["autoscaling"] == auto  # nothing refreshed: the same decision, the same state
    assert ticks.source.num_scrapes >= 3 * RESYNC_TICKS  # every tick decided (and scraped)


def test_a_changed_recommendation_is_written_and_updates_the_same_event():
    ticks = Ticks(advisory_spec("unified"))
    ticks.source.kv = 0.6  # 2 replicas at 0.6 / 0.5: 3 recommended
    ticks.run(1)
    ticks.all_pods_ready()
    ticks.run(8)
    api = ticks.api
    assert api.service()["status"]["autoscaling"]["pools"]["unified"]["desiredReplicas"] == 3
    writes = api.calls["patch_status"]
    ticks.source.kv = 0.9  # more load: 4 recommended
    ticks.run(8)
    assert api.service()["status"]["autoscaling"]["pools"]["unified"]["desiredReplicas"] == 4
    assert api.calls["patch_status"] > writes
    (event,) = api.event_objects("AdvisoryScale")  # one object, updated with the news
    assert event["count"] == 2 and "2->4" in event["message"], event
