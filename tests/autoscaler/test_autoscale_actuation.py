"""Collector sources, the spec adapter and the kopf timer's actuation, without a cluster.

The timer runs against fakes of its collaborators (a KubeClient that records status patches, a
metrics source returning Prometheus text built by prometheus_client), so each branch is checked:
active mode feeds the reconcile seam and reconciles, advisory only writes status and an Event,
unschedulable pods set the ScalingLimited seam, disabling clears the seam.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from autoscale_helpers import engine_metrics_text

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.autoscaler import handlers
from tidepool.operator.autoscaler.collector import (
    Collector,
    EndpointsSource,
    PoolBodies,
    PrometheusSource,
    UrlTemplateSource,
    split_pod_blocks,
)
from tidepool.operator.autoscaler.config import config_from_spec, pool_names
from tidepool.operator.autoscaler.policy_types import PoolBounds

ROUTER = '# TYPE tidepool_router_held_requests gauge\ntidepool_router_held_requests{pool="unified"} 3\n'


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
            await collector.collect("ns", "svc", ("unified", "broken"), now=0.0)
            await collector.collect("ns", "svc", ("unified", "broken"), now=10.0)
            return collector.snapshots("ns", "svc", ("unified", "broken"))

    snaps = asyncio.run(run())
    unified = snaps["unified"]
    assert "/ns/svc/unified" in hits
    assert unified.num_pods_scraped == 1 and unified.num_pods_failed == 1  # p1 answered garbage
    assert unified.held_requests == 3 and unified.kv_cache_usage == 0.5
    assert unified.num_requests > 0 and unified.ttft_p95_s is not None
    assert snaps["broken"].num_pods_scraped == 0 and snaps["broken"].num_pods_failed == 1


def test_endpoints_source_scrapes_ready_endpoints_only():
    slices = {
        "kubernetes.io/service-name=svc-unified": [
            {
                "ports": [{"port": 8000}],
                "endpoints": [
                    {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": {"name": "pod-a"}},
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": False}, "targetRef": {"name": "pod-b"}},
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": True}, "targetRef": {"name": "pod-c"}},
                ],
            }
        ],
        "kubernetes.io/service-name=svc-router": [
            {"ports": [{"port": 8080}], "endpoints": [{"addresses": ["10.0.1.1"], "conditions": {"ready": True}}]}
        ],
    }

    class Kube:
        async def list(self, kind, namespace, selector):
            assert kind == "EndpointSlice" and namespace == "ns"
            return slices.get(selector, [])

    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.3":
            raise httpx.ConnectTimeout("timed out")
        if request.url.host == "10.0.1.1":
            return httpx.Response(200, text=ROUTER)
        return httpx.Response(200, text=engine_metrics_text(kv=0.25))

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(serve)) as http:
            return await EndpointsSource(Kube(), http).fetch("ns", "svc", ("unified",))

    got: PoolBodies = asyncio.run(run())["unified"]
    assert set(got.bodies) == {"pod-a"}
    assert got.num_failed == 1  # pod-c timed out; pod-b is not ready, so not expected
    assert got.router_bodies == [ROUTER]


def test_config_from_spec_reads_the_api_wire_names():
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
    config = config_from_spec(spec)
    assert pool_names(spec) == ("prefill", "decode")
    assert config.pools == {"prefill": PoolBounds(0, 3), "decode": PoolBounds(0, 8)}
    assert config.is_advisory and config.scale_to_zero and config.idle_seconds == 120
    assert (config.ttft_p95_s, config.itl_p95_s) == (0.8, 0.04)
    assert (config.kv_cache_target, config.queue_depth_target) == (0.7, 3.0)
    assert (config.up_seconds, config.down_seconds, config.max_step_percent) == (5.0, 60.0, 50.0)
    assert (config.pd_ratio_min, config.pd_ratio_max) == (0.2, 2.0)


class FakeKube:
    def __init__(self, pods=()):
        self.pods, self.patches = list(pods), []

    async def list(self, kind, namespace, selector):
        return self.pods

    async def patch_status(self, kind, namespace, name, status):
        self.patches.append(status)
        return {}


class FixedSource:
    def __init__(self, kv: float):
        self.kv, self.calls = kv, 0

    async def fetch(self, namespace, name, pools):
        self.calls += 1
        body = engine_metrics_text(ttft=[0.05] * 5 * self.calls, itl=[0.01] * 50 * self.calls, kv=self.kv)
        return {pool: PoolBodies({f"{pool}-{i}": body for i in range(2)}) for pool in pools}


def isvc(mode: str = "active", enabled: bool = True) -> dict:
    spec = {
        "model": {"uri": "hf://org/m"},  # required: the API server never hands over a body without it
        "mode": "unified",
        "pools": {"unified": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6}},
        "autoscaling": {"enabled": enabled, "mode": mode, "slo": {"ttftP95Ms": 500}, "kvCacheTarget": 0.5},
    }
    return {"metadata": {"namespace": "ns", "name": "svc"}, "spec": spec, "status": {}}


def run_timer(body: dict, kv: float, pods=(), monkeypatch=None, ticks: int = 2):
    kube = FakeKube(pods)
    memo = SimpleNamespace(
        tidepool=SimpleNamespace(client=kube, replicas_overrides={}, scaling_limits={}),
        tidepool_autoscaler=handlers.AutoscalerState(Collector(FixedSource(kv), 60.0), http=None),
    )
    events, reconciles = [], []
    monkeypatch.setattr(handlers.kopf, "event", lambda obj, **kw: events.append(kw))

    async def fake_reconcile(body, memo):
        reconciles.append(dict(memo.tidepool.replicas_overrides))

    import tidepool.operator.handlers as op_handlers

    monkeypatch.setattr(op_handlers, "reconcile_object", fake_reconcile)
    times = iter(range(0, 1000, 15))
    monkeypatch.setattr(handlers.time, "monotonic", lambda: float(next(times)))
    log = SimpleNamespace(info=lambda *a: None)
    for _ in range(ticks):
        asyncio.run(handlers.on_autoscale(body=body, memo=memo, logger=log))
    return memo, kube, events, reconciles


def test_active_mode_feeds_the_reconcile_seam_and_reports(monkeypatch):
    memo, kube, events, reconciles = run_timer(isvc(), kv=0.9, monkeypatch=monkeypatch)
    assert memo.tidepool.replicas_overrides[("ns", "svc")] == {"unified": 4}  # kv 0.9 / 0.5 on 2 pods
    assert reconciles == [{("ns", "svc"): {"unified": 4}}]
    assert [e["reason"] for e in events] == ["Scaled"]
    assert kube.patches[0]["autoscaling"]["lastScaleTime"]  # the tick that scaled
    status = kube.patches[-1]["autoscaling"]
    assert status["mode"] == "active"
    assert status["pools"]["unified"]["desiredReplicas"] == 4
    assert status["pools"]["unified"]["inputs"]["kvCacheUsage"] == 0.9
    assert "kv_cache 0.90" in status["lastDecision"]


def test_advisory_mode_changes_only_status(monkeypatch):
    memo, kube, events, reconciles = run_timer(isvc("advisory"), kv=0.9, monkeypatch=monkeypatch)
    assert memo.tidepool.replicas_overrides == {} and reconciles == []
    assert {e["reason"] for e in events} == {"AdvisoryScale"}
    status = kube.patches[-1]["autoscaling"]
    assert status["mode"] == "advisory" and status["lastScaleTime"] is None
    assert status["pools"]["unified"]["desiredReplicas"] == 4


def test_unschedulable_pods_set_scaling_limited(monkeypatch):
    pending = {
        "metadata": {"name": "svc-unified-x", "labels": {"tidepool.dev/pool": "unified"}},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "reason": "Unschedulable", "message": "0/2 nodes: Insufficient nvidia.com/gpu"}
            ],
        },
    }
    memo, _, _, reconciles = run_timer(isvc(), kv=0.9, pods=[pending], monkeypatch=monkeypatch)
    assert memo.tidepool.replicas_overrides[("ns", "svc")] == {"unified": 2}  # no growth
    _, message = memo.tidepool.scaling_limits[("ns", "svc")]
    assert "Insufficient nvidia.com/gpu" in message
    assert reconciles  # the ScalingLimited condition is written by reconcile


@pytest.mark.parametrize(
    "body", [isvc(enabled=False), {**isvc(), "metadata": {**isvc()["metadata"], "deletionTimestamp": "x"}}]
)
def test_disabled_or_deleted_clears_the_seam(monkeypatch, body):
    kube = FakeKube()
    memo = SimpleNamespace(
        tidepool=SimpleNamespace(
            client=kube, replicas_overrides={("ns", "svc"): {"unified": 5}}, scaling_limits={("ns", "svc"): ("a", "b")}
        )
    )
    asyncio.run(handlers.on_autoscale(body=body, memo=memo, logger=None))
    assert memo.tidepool.replicas_overrides == {} and memo.tidepool.scaling_limits == {} and kube.patches == []


def test_after_a_restart_current_replicas_come_from_status_not_spec(monkeypatch):
    body = isvc()
    body["status"] = {"pools": {"unified": {"replicas": 5, "readyReplicas": 5, "desiredReplicas": 5}}}
    memo, _, events, _ = run_timer(body, kv=0.5, monkeypatch=monkeypatch, ticks=1)  # at target: hold
    assert memo.tidepool.replicas_overrides[("ns", "svc")] == {"unified": 5}  # not the spec's 2
    assert events == []


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
            await collector.collect("ns", "svc", ("prefill", "decode"), now=0.0)
            return collector.snapshots("ns", "svc", ("prefill", "decode"))

    snaps = asyncio.run(run())
    assert 'namespace="ns"' in seen["match"] and 'pod=~"svc-.+"' in seen["match"]
    assert snaps["decode"].num_pods_scraped == 2 and snaps["decode"].kv_cache_usage == pytest.approx(0.6)
    assert snaps["decode"].held_requests == 2 and snaps["prefill"].held_requests == 0
    assert snaps["prefill"].num_pods_scraped == 1 and snaps["prefill"].kv_cache_usage == 0.1
