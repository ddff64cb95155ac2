"""Collector sources, the spec adapter and the autoscaler's tick, without a cluster.

The tick runs against fakes of its collaborators (a client that applies status patches to a body,
a metrics source returning Prometheus text built by prometheus_client, a fake clock), so each
branch is checked: active mode records replicas in status for the reconcile, advisory only writes
status and an Event, unschedulable pods set `limited`, and a restarted autoscaler resumes from
status without scaling down.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest
from autoscale_helpers import engine_metrics_text

from tidepool.operator.api import InferenceServiceSpec, ServiceView
from tidepool.operator.autoscaler import handlers
from tidepool.operator.autoscaler.collector import (
    Collector,
    PodsSource,
    PoolBodies,
    PrometheusSource,
    UrlTemplateSource,
    snapshots,
    split_pod_blocks,
)
from tidepool.operator.autoscaler.config import config_from_view
from tidepool.operator.autoscaler.policy_types import PoolBounds
from tidepool.operator.cache import PodInfo

ROUTER = '# TYPE tidepool_router_held_requests gauge\ntidepool_router_held_requests{pool="unified"} 3\n'


def tick(auto: handlers.Autoscaler, body: Any, state: handlers.AutoscaleState) -> dict[str, Any]:
    """One tick for the service `body` as the controller runs it: the spec parsed once, the service's own state."""
    return dict(asyncio.run(auto.tick(("ns", "svc"), ServiceView.from_body(body), body, state)))


def applied(body: dict[str, Any]) -> tuple[dict[str, int] | None, tuple[str, str] | None]:
    """What the reconcile applies from this object's status."""
    return handlers.applied_replicas(ServiceView.from_body(body), body.get("status") or {})


def feed(pods: dict[str, str], router: str = "") -> str:
    text = "".join(f"# pod: {name}\n{body}\n" for name, body in pods.items())
    return text + (f"# pod: router-0\n{router}\n" if router else "")


def test_split_pod_blocks():
    blocks = split_pod_blocks("junk\n# pod: a\nx 1\n# pod: b\ny 2\nz 3\n")
    assert blocks == {"a": "x 1", "b": "y 2\nz 3"}


def test_url_template_source_and_collector_windows():
    hits = []

    def serve(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.path)
        if request.url.path.endswith("/broken"):
            return httpx.Response(500)
        n = len(hits)
        pods = {"p0": engine_metrics_text(ttft=[0.05] * 10 * n, kv=0.5), "p1": "garbage line here {"}
        return httpx.Response(200, text=feed(pods, ROUTER))

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(serve)) as http:
            collector = Collector(UrlTemplateSource("http://feed/{namespace}/{name}/{pool}", http), window_s=30)
            windows: dict = {}
            await collector.collect(windows, "ns", "svc", ("unified", "broken"), now=0.0)
            await collector.collect(windows, "ns", "svc", ("unified", "broken"), now=10.0)
            return snapshots(windows, ("unified", "broken"))

    snaps = asyncio.run(run())
    unified = snaps["unified"]
    assert "/ns/svc/unified" in hits
    assert unified.num_pods_scraped == 1 and unified.num_pods_failed == 1  # p1 answered garbage
    assert unified.held_requests == 3 and unified.kv_cache_usage == 0.5
    assert unified.num_requests > 0 and unified.ttft_p95_s is not None
    assert snaps["broken"].num_pods_scraped == 0 and snaps["broken"].num_pods_failed == 1


def pod(name: str, ip: str, pool: str = "unified", ready: bool = True, rank: int = 0, group: str | None = None):
    return PodInfo(name, pool, "h", group, rank, ready, False, ip, ())


def test_pods_source_scrapes_ready_leaders_only():
    pods = [
        pod("pod-a", "10.0.0.1"),
        pod("pod-b", "10.0.0.2", ready=False),
        pod("pod-c", "10.0.0.3"),
        pod("pod-d", "10.0.0.4", rank=1, group="0"),  # rank 1 of a multi-node replica serves no HTTP
        pod("router-x", "10.0.1.1", pool="router"),
    ]
    hits = []

    def serve(request: httpx.Request) -> httpx.Response:
        hits.append((request.url.host, request.url.port))
        if request.url.host == "10.0.0.3":
            raise httpx.ConnectTimeout("timed out")
        if request.url.host == "10.0.1.1":
            return httpx.Response(200, text=ROUTER)
        return httpx.Response(200, text=engine_metrics_text(kv=0.25))

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(serve)) as http:
            return await PodsSource(lambda ns, name: pods, http).fetch("ns", "svc", ("unified",))

    got: PoolBodies = asyncio.run(run())["unified"]
    assert set(got.bodies) == {"pod-a"}
    assert got.num_failed == 1  # pod-c timed out; pod-b is not ready, so not expected
    assert got.router_bodies == [ROUTER]
    assert ("10.0.1.1", 8080) in hits and ("10.0.0.1", 8000) in hits and not any(h == "10.0.0.4" for h, _ in hits)


def test_config_from_view_reads_the_api_wire_names():
    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "hf://org/m"},
            "mode": "disaggregated",
            "pools": {
                "prefill": {"replicas": 1, "minReplicas": 0, "maxReplicas": 3},
                "decode": {"replicas": 2, "minReplicas": 0, "maxReplicas": 8},
            },
            "router": {"replicas": 1},
            "autoscaling": {
                "enabled": True,
                "mode": "advisory",
                "slo": {"ttftP95Ms": 800, "itlP95Ms": 40},
                "kvCacheTarget": 0.7,
                "queueDepthTarget": 3,
                "scaleToZero": {"enabled": True, "idleSeconds": 120},
                "stabilization": {"upSeconds": 5, "downSeconds": 60},
                "maxStepPercent": 50,
                "prefillDecodeRatio": {"min": 0.2, "max": 2.0},
            },
        }
    ).to_wire()
    config = config_from_view(ServiceView.from_spec(spec))
    assert config.pools == {"prefill": PoolBounds(0, 3), "decode": PoolBounds(0, 8)}
    assert config.is_advisory and config.scale_to_zero and config.idle_seconds == 120
    assert (config.ttft_p95_s, config.itl_p95_s) == (0.8, 0.04)
    assert (config.kv_cache_target, config.queue_depth_target) == (0.7, 3.0)
    assert (config.up_seconds, config.down_seconds, config.max_step_percent) == (5.0, 60.0, 50.0)
    assert (config.pd_ratio_min, config.pd_ratio_max) == (0.2, 2.0)


class FakeKube:
    """Applies status merge patches to the body it was given, checking the resourceVersion."""

    def __init__(self, body: dict):
        self.body, self.patches = body, []

    async def patch_status(self, kind, namespace, name, status, resource_version=None):
        assert resource_version == self.body["metadata"]["resourceVersion"]
        self.patches.append(copy.deepcopy(status))
        auto = self.body.setdefault("status", {}).setdefault("autoscaling", {})
        for key, value in status["autoscaling"].items():
            if value is None:
                auto.pop(key, None)
            else:
                auto[key] = copy.deepcopy(value)
        self.body["metadata"]["resourceVersion"] = str(int(self.body["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(self.body)


class FixedSource:
    """Every pod: 5 requests and 50 tokens per scrape (15 s apart in the tests), `kv` KV usage, 10 running."""

    def __init__(self, kv: float, num_pods: int = 2):
        self.kv, self.calls, self.num_pods = kv, 0, num_pods

    async def fetch(self, namespace, name, pools):
        self.calls += 1
        body = engine_metrics_text(
            ttft=[0.05] * 5 * self.calls,
            itl=[0.01] * 50 * self.calls,
            kv=self.kv,
            running=10,
            prompt_tokens=500 * self.calls,
            generation_tokens=50 * self.calls,
        )
        return {pool: PoolBodies({f"{pool}-{i}": body for i in range(self.num_pods)}) for pool in pools}


def isvc(mode: str = "active", enabled: bool = True) -> dict:
    spec = {
        "model": {"uri": "hf://org/m"},  # required: the API server never hands over a body without it
        "mode": "unified",
        "pools": {"unified": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6}},
        "autoscaling": {"enabled": enabled, "mode": mode, "slo": {"ttftP95Ms": 500}, "kvCacheTarget": 0.5},
    }
    return {"metadata": {"namespace": "ns", "name": "svc", "resourceVersion": "1"}, "spec": spec, "status": {}}


class Recorded(list[tuple[str, str]]):
    """The (reason, message) of each Event posted, and the aggregation key each was posted under (`keys`)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str | None] = []


def run_ticks(
    body: dict, kv: float, pods=(), ticks: int = 2, start: float = 1_000_000.0, step: float = 15.0, num_pods: int = 2
):
    """Ticks of one Autoscaler on a fake clock; returns (final body, the fake client, the events)."""
    kube = FakeKube(body)
    events = Recorded()
    now = [start]

    async def event(obj: Any, type_: str, reason: str, message: str, key: str | None = None) -> None:
        events.append((reason, message))
        events.keys.append(key)

    auto = handlers.Autoscaler(
        kube,
        lambda ns, name: list(pods),
        event,
        FixedSource(kv, num_pods),
        interval_s=step,
        window_s=60.0,
        clock=lambda: now[0],
    )
    current, state = body, handlers.AutoscaleState()
    for _ in range(ticks):
        current = tick(auto, current, state)
        now[0] += step
    return current, kube, events


def test_active_mode_records_the_replicas_for_the_reconcile():
    body, kube, events = run_ticks(isvc(), kv=0.9)
    replicas, limited = applied(body)
    assert replicas == {"unified": 4} and limited is None  # kv 0.9 / 0.5 on 2 pods
    assert [e[0] for e in events] == ["Scaled"]
    # an active scaling is its own Event per transition (history kept), not the service's one advisory Event
    assert events.keys == [events[0][1].split(":", 1)[0]]
    assert events.keys[0].startswith("unified ") and "->" in events.keys[0]
    assert kube.patches[0]["autoscaling"]["lastScaleTime"]  # the tick that scaled
    status = body["status"]["autoscaling"]
    assert status["mode"] == "active"
    assert status["pools"]["unified"]["desiredReplicas"] == 4
    assert status["pools"]["unified"]["inputs"]["kvCacheUsage"] == 0.9
    assert "kv_cache 0.90" in status["lastDecision"]
    assert status["recommendations"] and status["lastActiveTime"]


def test_status_shows_the_forecast_and_learned_capacity_behind_the_decision():
    """After a few ticks of steady traffic the decision carries anticipation's inputs, in status and reason (status
    is written when the decision changes: here when KV usage doubles after the forecast was learned)."""
    h = Harness(isvc())
    running = h.autoscaler()
    assert {h.tick(running, kv=0.4, num_pods=2) for _ in range(8)} == {2}
    assert h.tick(running, kv=0.9, num_pods=2) == 4
    body = h.kube.body
    inputs = body["status"]["autoscaling"]["pools"]["unified"]["inputs"]
    # 2 pods x 50 generated tokens per 15 s scrape = 6.67 tokens/s; 2 pods x 500 prompt tokens = 66.7 tokens/s:
    # the prefill channel (the larger demand per replica at its capacity) or the decode one binds.
    assert inputs["forecastTokensPerSecond"] in (pytest.approx(100 / 15, rel=0.01), pytest.approx(1000 / 15, rel=0.01))
    assert (
        inputs["capacityTokensPerSecond"] > 0
        and inputs["capacityLimitTokensPerSecond"] >= inputs["capacityTokensPerSecond"]
    )
    assert inputs["lookaheadSeconds"] >= 120 and inputs["headroom"] >= 1.0
    assert inputs["predictedReplicas"] >= 1
    assert "forecast" in body["status"]["autoscaling"]["lastDecision"]


def test_advisory_mode_changes_only_status():
    body, _, events = run_ticks(isvc("advisory"), kv=0.9)
    assert applied(body) == (None, None)  # the reconcile keeps the spec's replicas
    assert {e[0] for e in events} == {"AdvisoryScale"}
    status = body["status"]["autoscaling"]
    assert status["mode"] == "advisory" and "lastScaleTime" not in status
    assert status["pools"]["unified"]["desiredReplicas"] == 4


def test_unschedulable_pods_hold_and_set_limited():
    stuck = PodInfo("svc-unified-x", "unified", "h", None, 0, False, False, None,
                    (("Unschedulable", "0/2 nodes: Insufficient nvidia.com/gpu"),))  # fmt: skip
    body, _, _ = run_ticks(isvc(), kv=0.9, pods=[stuck])
    replicas, limited = applied(body)
    assert replicas == {"unified": 2}  # no growth
    assert limited is not None and "Insufficient nvidia.com/gpu" in limited[1]


def test_status_is_written_on_change_only():
    """A decision that does not change writes nothing, however long it holds (no periodic refresh)."""
    _, kube, _ = run_ticks(isvc(), kv=0.5, ticks=3)  # at target: the same decision three times, 15 s apart
    assert len(kube.patches) == 1
    _, kube, _ = run_ticks(isvc(), kv=0.5, ticks=40, step=60.0)  # 40 minutes of the same decision
    assert len(kube.patches) == 1


def test_advisory_scale_is_told_once_while_the_recommendation_holds():
    body, kube, events = run_ticks(isvc("advisory"), kv=0.9, ticks=20)
    assert [e[0] for e in events] == ["AdvisoryScale"] and len(kube.patches) == 1
    body, _, events = run_ticks(body, kv=1.5, ticks=3)  # more load: a different recommendation, told again
    assert [e[0] for e in events] == ["AdvisoryScale"]
    assert body["status"]["autoscaling"]["pools"]["unified"]["desiredReplicas"] == 6


Running = tuple[handlers.Autoscaler, handlers.AutoscaleState]  # an operator's autoscaler and its memory of `svc`


class Harness:
    """One InferenceService body in a fake cluster and a fake clock shared by successive autoscalers."""

    def __init__(self, body: dict) -> None:
        self.kube = FakeKube(body)
        self.now = [1_000_000.0]
        self.source = FixedSource(0.0)

    def autoscaler(self) -> Running:  # a (re)started operator: nothing in memory
        async def event(*_: Any) -> None:
            return None

        clock = lambda: self.now[0]  # noqa: E731
        auto = handlers.Autoscaler(self.kube, lambda ns, n: [], event, self.source, 15.0, 60.0, clock=clock)
        return auto, handlers.AutoscaleState()

    def tick(self, running: Running, kv: float, num_pods: int) -> int:
        self.source.kv, self.source.num_pods = kv, num_pods
        self.kube.body = tick(running[0], self.kube.body, running[1])
        self.now[0] += 15.0
        replicas = applied(self.kube.body)[0]["unified"]
        self.kube.body["status"]["pools"] = {"unified": {"desiredReplicas": replicas}}  # the reconcile's part
        return replicas

    def ticks_until_below(self, auto: Running, replicas: int) -> int:
        for n in range(1, 40):
            if self.tick(auto, kv=0.05, num_pods=replicas) < replicas:
                return n
        raise AssertionError("never scaled down")


def test_a_restarted_autoscaler_resumes_from_status_without_scaling_down():
    """After a restart the decided replicas and the stabilization state come from status: the pool keeps
    its autoscaled size and is never scaled down earlier than without the restart."""
    spec = isvc()
    spec["spec"]["autoscaling"]["stabilization"] = {"upSeconds": 0, "downSeconds": 120}

    def grown() -> tuple[Harness, Running]:
        h = Harness(copy.deepcopy(spec))
        auto = h.autoscaler()
        assert [h.tick(auto, kv=0.9, num_pods=2) for _ in range(2)] == [4, 4]  # kv 0.9 / 0.5 on 2 pods
        return h, auto

    h, auto = grown()
    uninterrupted = h.ticks_until_below(auto, 4)
    h, _ = grown()
    restarted = h.autoscaler()
    assert h.tick(restarted, kv=0.05, num_pods=4) == 4  # not the spec's 2
    assert 1 + h.ticks_until_below(restarted, 4) >= uninterrupted

    h, _ = grown()
    h.kube.body["status"] = {}  # an operator that kept its decisions in memory lost them with the process
    assert h.tick(h.autoscaler(), kv=0.05, num_pods=4) < 4


def test_restored_times_are_never_earlier_than_the_truth():
    """The newest recommendation, and activity seen by the tick that wrote, still hold when restored: they are
    as of now. Older recommendations, and activity that had stopped when status was written, keep their times."""
    t0 = 1767225600.0  # 2026-01-01T00:00:00Z
    recs = [{"time": "2026-01-01T00:00:00Z", "replicas": {"unified": 5}},
            {"time": "2026-01-01T00:01:00Z", "replicas": {"unified": 3}}]  # fmt: skip
    active = {"recommendations": recs, "lastActiveTime": "2026-01-01T00:01:00Z"}
    history = handlers.restore_history(active, now=t0 + 1000)
    assert history.recommendations == ((t0, {"unified": 5}), (t0 + 1000, {"unified": 3}))
    assert history.last_active_time == t0 + 1000
    idle = {"recommendations": recs, "lastActiveTime": "2026-01-01T00:00:30Z"}
    assert handlers.restore_history(idle, now=t0 + 1000).last_active_time == t0 + 30
    assert handlers.restore_history(idle, now=t0 + 10).last_active_time == t0 + 10  # never in the future


def test_prometheus_federate_source_splits_series_by_pod_label():
    federate = "\n".join(
        [
            "# TYPE vllm:kv_cache_usage_perc untyped",
            'vllm:kv_cache_usage_perc{model_name="m",namespace="ns",pod="svc-decode-5c9-a"} 0.5 1700000000000',
            'vllm:kv_cache_usage_perc{model_name="m",namespace="ns",pod="svc-decode-5c9-b"} 0.7 1700000000000',
            'vllm:kv_cache_usage_perc{model_name="m",namespace="ns",pod="svc-prefill-77-a"} 0.1 1700000000000',
            'tidepool_router_held_requests{namespace="ns",pod="svc-router-1-x",pool="decode"} 2 1700000000000',
        ]
    )
    seen = {}

    def serve(request: httpx.Request) -> httpx.Response:
        seen["match"] = request.url.params["match[]"]
        return httpx.Response(200, text=federate)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(serve)) as http:
            collector = Collector(PrometheusSource("http://prom:9090/", http), 60.0)
            windows: dict = {}
            await collector.collect(windows, "ns", "svc", ("prefill", "decode"), now=0.0)
            return snapshots(windows, ("prefill", "decode"))

    snaps = asyncio.run(run())
    assert 'namespace="ns"' in seen["match"] and 'pod=~"svc-.+"' in seen["match"]
    assert snaps["decode"].num_pods_scraped == 2 and snaps["decode"].kv_cache_usage == pytest.approx(0.6)
    assert snaps["decode"].held_requests == 2 and snaps["prefill"].held_requests == 0
    assert snaps["prefill"].num_pods_scraped == 1 and snaps["prefill"].kv_cache_usage == 0.1
