"""`autoscaling.idle: sleep` carried out by the autoscaler's tick (operator/autoscaler/sleep.py), without a cluster.

The tick runs against fakes (a client applying status patches, a metrics source of idle engine pods and a router
whose held requests the test sets, a fake clock) and a fake of the engines' sleep API that records every call, so
what is asked of the pods, what status says and which Events are posted are checked tick by tick.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
from autoscale_helpers import engine_metrics_text

from tidepool.contract.router_metrics_names import HELD_REQUESTS, POOL_LABEL
from tidepool.operator.api import ServiceView
from tidepool.operator.autoscaler import handlers
from tidepool.operator.autoscaler.collector import PoolBodies
from tidepool.operator.autoscaler.sleep import HttpSleepApi, serving_pods
from tidepool.operator.cache import PodInfo
from tidepool.operator.lora.client import Reply

IDLE_S = 60
STEP_S = 15.0


def pod(name: str, pool: str = "unified", serving: bool = True, rank: int = 0) -> PodInfo:
    return PodInfo(name, pool, "h", None, rank, serving, False, "10.0.0.1", (), is_serving=serving)


class FakeKube:
    """Applies status merge patches to the body it holds."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body, self.patches = body, []

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict, resource_version=None) -> dict:
        self.patches.append(copy.deepcopy(status))
        auto = self.body.setdefault("status", {}).setdefault("autoscaling", {})
        for key, value in status["autoscaling"].items():
            if value is None:
                auto.pop(key, None)
            else:
                auto[key] = copy.deepcopy(value)
        return copy.deepcopy(self.body)


class IdleSource:
    """Every engine pod idle (no request, nothing running); the router holds `held` requests for the pool."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.held = cluster, 0

    async def fetch(self, namespace: str, name: str, pools: tuple[str, ...]) -> dict[str, PoolBodies]:
        router = f'{HELD_REQUESTS}{{{POOL_LABEL}="unified"}} {self.held}\n'
        engines = {p.name: engine_metrics_text() for p in self.cluster.pods}
        return {pool: PoolBodies(engines, 0, [router]) for pool in pools}


class FakeSleepApi:
    """The engines' sleep endpoints: each pod's state, every call recorded, `failing` pods unreachable."""

    def __init__(self) -> None:
        self.asleep: dict[str, bool] = {}
        self.calls: list[tuple[str, str, str | None]] = []
        self.failing: set[str] = set()

    async def is_sleeping(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> bool | None:
        self.calls.append(("is_sleeping", pod.name, api_key))
        return None if pod.name in self.failing else self.asleep.get(pod.name, False)

    async def sleep(self, namespace: str, pod: PodInfo, level: int, api_key: str | None = None) -> Reply:
        assert level == 1
        return self._set("sleep", pod, True, api_key)

    async def wake_up(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> Reply:
        return self._set("wake_up", pod, False, api_key)

    def _set(self, verb: str, pod: PodInfo, asleep: bool, api_key: str | None) -> Reply:
        self.calls.append((verb, pod.name, api_key))
        if pod.name in self.failing:
            return Reply(0, "ConnectError")
        self.asleep[pod.name] = asleep
        return Reply(200, "")

    def take(self, verb: str) -> list[str]:
        """The pods `verb` was called on since the last take (of any verb)."""
        names = [name for v, name, _ in self.calls if v == verb]
        self.calls.clear()
        return names


class Cluster:
    """One InferenceService with `autoscaling.idle: sleep`, its engine pods, a fake clock and a running autoscaler."""

    def __init__(self, **autoscaling: Any) -> None:
        spec = {
            "model": {"uri": "hf://org/m"},
            "pools": {"unified": {"replicas": 2, "minReplicas": 2, "maxReplicas": 4}},
            "autoscaling": {"enabled": True, "idle": "sleep", "scaleToZero": {"idleSeconds": IDLE_S}, **autoscaling},
        }
        body = {"metadata": {"namespace": "ns", "name": "svc", "resourceVersion": "1"}, "spec": spec, "status": {}}
        self.kube, self.api, self.now = FakeKube(body), FakeSleepApi(), 1_000_000.0
        self.pods = [pod("svc-unified-a"), pod("svc-unified-b")]
        self.source = IdleSource(self)
        self.events: list[tuple[str, str]] = []
        self.restart()

    def restart(self) -> None:
        """A (re)started operator: nothing in memory."""

        async def event(obj: Any, type_: str, reason: str, message: str, key: str | None = None) -> None:
            self.events.append((reason, message))

        self.auto = handlers.Autoscaler(
            self.kube, lambda ns, n: list(self.pods), event, self.source, STEP_S, 60.0,
            clock=lambda: self.now, sleep_api=self.api,
        )  # fmt: skip
        self.state = handlers.AutoscaleState()

    @property
    def auto_status(self) -> dict[str, Any]:
        return self.kube.body["status"].get("autoscaling") or {}

    def tick(self, api_key: str | None = None) -> None:
        body = self.kube.body
        view = ServiceView.from_body(body)
        self.kube.body = dict(asyncio.run(self.auto.tick(("ns", "svc"), view, body, self.state, api_key)))
        self.now += STEP_S

    def tick_until_asleep(self) -> int:
        for n in range(1, 20):
            self.tick()
            if "asleepSince" in self.auto_status:
                return n
        raise AssertionError("never went to sleep")


def test_an_idle_service_sleeps_once_and_a_held_request_wakes_it() -> None:
    cluster = Cluster()
    ticks = cluster.tick_until_asleep()
    assert ticks * STEP_S >= IDLE_S
    assert sorted(cluster.api.take("sleep")) == ["svc-unified-a", "svc-unified-b"]
    assert [r for r, _ in cluster.events] == ["Sleeping"] and "2/2 serving pod(s)" in cluster.events[0][1]
    assert cluster.auto_status["pools"]["unified"]["desiredReplicas"] == 2  # replicas kept, not zero
    writes = len(cluster.kube.patches)
    for _ in range(20):  # five minutes asleep: checked, never slept again, no Event, no status write
        cluster.tick()
        assert cluster.api.take("sleep") == []
    assert len(cluster.events) == 1 and len(cluster.kube.patches) == writes
    cluster.source.held = 2
    cluster.tick()
    assert sorted(cluster.api.take("wake_up")) == ["svc-unified-a", "svc-unified-b"]
    assert [r for r, _ in cluster.events] == ["Sleeping", "Woken"] and "asleepSince" not in cluster.auto_status
    assert "router holds requests" in cluster.auto_status["lastDecision"]


def test_a_pod_that_starts_while_asleep_is_put_to_sleep() -> None:
    cluster = Cluster()
    cluster.tick_until_asleep()
    cluster.api.take("sleep")
    cluster.pods.append(pod("svc-unified-c"))
    cluster.pods.append(pod("svc-unified-d", serving=False))  # not answering yet: left alone
    cluster.tick()
    assert cluster.api.take("sleep") == ["svc-unified-c"]
    assert len(cluster.events) == 1


def test_a_failed_wake_is_retried_until_the_pod_answers() -> None:
    cluster = Cluster()
    cluster.tick_until_asleep()
    cluster.api.failing.add("svc-unified-b")
    cluster.source.held = 1
    cluster.tick()
    assert sorted(cluster.api.take("wake_up")) == ["svc-unified-a", "svc-unified-b"]
    cluster.tick()
    assert cluster.api.take("wake_up") == ["svc-unified-b"]
    cluster.api.failing.clear()
    cluster.tick()
    assert cluster.api.take("wake_up") == ["svc-unified-b"]
    cluster.tick()
    assert cluster.api.take("wake_up") == []
    assert cluster.api.asleep == {"svc-unified-a": False, "svc-unified-b": False}


def test_the_api_key_goes_with_every_call() -> None:
    cluster = Cluster()
    for _ in range(10):
        cluster.tick(api_key="k-1")
    assert cluster.api.calls and {key for _, _, key in cluster.api.calls} == {"k-1"}


def test_a_restarted_operator_keeps_the_pools_asleep_without_telling_again() -> None:
    cluster = Cluster()
    cluster.tick_until_asleep()
    cluster.api.take("sleep")
    cluster.restart()
    cluster.tick()
    assert cluster.api.take("sleep") == [] and len(cluster.events) == 1 and "asleepSince" in cluster.auto_status


def test_switching_to_advisory_wakes_a_sleeping_service() -> None:
    cluster = Cluster()
    cluster.tick_until_asleep()
    cluster.api.take("sleep")
    cluster.kube.body["spec"]["autoscaling"]["mode"] = "advisory"
    cluster.tick()
    assert sorted(cluster.api.take("wake_up")) == ["svc-unified-a", "svc-unified-b"]
    assert [r for r, _ in cluster.events] == ["Sleeping", "Woken"] and "asleepSince" not in cluster.auto_status
    assert "no longer kept asleep" in cluster.events[1][1]
    for _ in range(10):  # advisory: reported, never carried out
        cluster.tick()
    assert cluster.api.take("sleep") == [] and "asleepSince" not in cluster.auto_status


def test_without_idle_sleep_no_pod_is_called() -> None:
    cluster = Cluster(idle="scaleToZero")
    for _ in range(20):
        cluster.tick()
    assert cluster.api.calls == [] and cluster.events == []


def test_serving_pods_are_the_answering_rank_zero_engines() -> None:
    pods = [pod("a"), pod("b", serving=False), pod("c", rank=1), pod("r", pool="router"), pod("p", pool="prefill")]
    assert [p.name for p in serving_pods(pods, ("unified",))] == ["a"]


def test_http_sleep_api_speaks_the_engine_contract() -> None:
    """Paths, the level and the bearer key as the engine's sleep contract names them (tidepool.contract.sleep)."""
    seen: list[tuple[str, str, str | None]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), request.headers.get("authorization")))
        if request.url.path == "/is_sleeping":
            return httpx.Response(200, json={"is_sleeping": True})
        if request.url.path == "/wake_up":
            return httpx.Response(503, json={"error": {"message": "still loading"}})
        return httpx.Response(200)

    async def run() -> tuple[Any, ...]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
            api = HttpSleepApi(http, lambda ns, p: f"http://{p.name}:8000")
            target = pod("e")
            return (
                await api.is_sleeping("ns", target, "k"),
                await api.sleep("ns", target, 1, "k"),
                await api.wake_up("ns", target, None),
            )

    asleep, slept, woke = asyncio.run(run())
    assert asleep is True and slept.ok and (woke.status, woke.message) == (503, "still loading")
    assert seen == [
        ("GET", "http://e:8000/is_sleeping", "Bearer k"),
        ("POST", "http://e:8000/sleep?level=1", "Bearer k"),
        ("POST", "http://e:8000/wake_up", None),
    ]
