"""The LoRA step against fake replicas (`ReplicaApi`) and a fake API server: loads, unloads, the readiness
gate, failures and their retry; and the HTTP client against a stub engine (httpx.MockTransport).

The real engines behind real pods are in tests/controlplane/test_cp_lora.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from tidepool.operator.builders import ServiceView
from tidepool.operator.builders.lora import LORA_GATE
from tidepool.operator.cache import PodInfo, pod_info
from tidepool.operator.lora.client import HttpReplicaApi, Reply, template_resolver
from tidepool.operator.lora.sync import RETRY_S, LoraState, LoraSync

KEY = ("ns", "svc")
SPEC: dict[str, Any] = {
    "model": {"uri": "hf://org/base"},
    "resources": {"gpusPerReplica": 1},
    "pools": {"unified": {"replicas": 2}},
    "lora": {"adapters": [{"name": "a", "source": "hf://org/a"}], "maxCpuAdapters": 4},
}


def spec_with(*adapters: tuple[str, str]) -> ServiceView:
    lora = {**SPEC["lora"], "adapters": [{"name": n, "source": s} for n, s in adapters]}
    return ServiceView.from_spec({**SPEC, "lora": lora})


def pod(name: str, gate: bool | None = False, rank: int = 0, serving: bool = True) -> PodInfo:
    group = None if rank == 0 else "0"
    return PodInfo(name, "unified", "h", group, rank, False, False, "10.0.0.1", (), None, serving, gate)


@dataclass
class FakeReplicas:
    """Engines that hold adapters; `refuse` maps an adapter name to the engine's 400 message."""

    held: dict[str, dict[str, str]] = field(default_factory=dict)
    refuse: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    hold: asyncio.Event | None = None  # when set: loads wait for it

    async def adapters(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> dict[str, str] | None:
        return dict(self.held.setdefault(pod.name, {}))

    async def load(self, namespace: str, pod: PodInfo, name: str, path: str, api_key: str | None = None) -> Reply:
        self.calls.append(("load", pod.name, name))
        if self.hold is not None:
            await self.hold.wait()
        if name in self.refuse:
            return Reply(400, self.refuse[name])
        self.held.setdefault(pod.name, {})[name] = path
        return Reply(200, f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, namespace: str, pod: PodInfo, name: str, api_key: str | None = None) -> Reply:
        self.calls.append(("unload", pod.name, name))
        return Reply(200, "ok") if self.held.get(pod.name, {}).pop(name, None) else Reply(404, "not loaded")


@dataclass
class FakeKube:
    patches: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "") -> dict[str, Any]:
        assert (method, content_type) == ("PATCH", "application/strategic-merge-patch+json")
        self.patches.append((path, body))
        return {}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[LoraSync, FakeReplicas, FakeKube, Clock, list[tuple[str, str]]]:
    replicas, kube, clock, requeued = FakeReplicas(), FakeKube(), Clock(), []
    sync = LoraSync(replicas, kube, requeued.append, clock)  # type: ignore[arg-type]
    return sync, replicas, kube, clock, requeued


async def settle(sync: LoraSync, view: ServiceView, pods: list[PodInfo], state: LoraState):  # type: ignore[no-untyped-def]
    """One step, then wait for its background loads, then another step (as the re-queued key would)."""
    await sync.step(KEY, view, pods, state)
    await asyncio.gather(*list(state.tasks.values()))
    return await sync.step(KEY, view, pods, state)


def test_loads_on_every_serving_replica_then_opens_the_gate() -> None:
    async def run() -> None:
        sync, replicas, kube, _, requeued = make()
        state = LoraState()
        router = PodInfo("r0", "router", "h", None, 0, True, False, "10.0.0.2", (), None, True, None)
        pods = [pod("u0"), pod("u1"), pod("starting", serving=False), pod("u0-w1", rank=1), router]
        first = await sync.step(KEY, spec_with(("a", "hf://org/a")), pods, state)
        assert first.status is not None and first.status[0].state == "Loading"
        assert [p for p, _ in kube.patches] == ["/api/v1/namespaces/ns/pods/u0-w1/status"]  # a worker rank
        await asyncio.gather(*list(state.tasks.values()))
        assert requeued == [KEY, KEY]
        outcome = await sync.step(KEY, spec_with(("a", "hf://org/a")), pods, state)
        assert replicas.held == {"u0": {"a": "hf://org/a"}, "u1": {"a": "hf://org/a"}}  # not the router
        assert outcome.status is not None and outcome.status[0].state == "Ready"
        assert outcome.status[0].pools[0].held_by == ["u0", "u1"] and outcome.failures == []
        gated = {p.rsplit("/", 2)[1]: b["status"]["conditions"][0] for p, b in kube.patches}
        assert set(gated) == {"u0", "u1", "u0-w1"}
        assert all(c["type"] == LORA_GATE and c["status"] == "True" for c in gated.values())

    asyncio.run(run())


def test_an_adapter_removed_from_the_spec_is_unloaded_and_one_added_is_loaded() -> None:
    async def run() -> None:
        sync, replicas, _, clock, _ = make()
        state = LoraState()
        pods = [pod("u0", gate=True)]
        await settle(sync, spec_with(("a", "hf://org/a")), pods, state)
        clock.now += 1
        outcome = await settle(sync, spec_with(("b", "hf://org/b")), pods, state)
        assert replicas.held == {"u0": {"b": "hf://org/b"}}
        assert ("unload", "u0", "a") in replicas.calls
        assert outcome.status is not None and [a.name for a in outcome.status] == ["b"]

    asyncio.run(run())


def test_a_refused_adapter_is_reported_opens_the_gate_and_is_retried_later() -> None:
    async def run() -> None:
        sync, replicas, kube, clock, _ = make()
        replicas.refuse["big"] = "adapter rank 64 is above --max-lora-rank 16"
        state = LoraState()
        view = spec_with(("a", "hf://org/a"), ("big", "hf://org/big"))
        outcome = await settle(sync, view, [pod("u0")], state)
        assert outcome.status is not None
        assert [a.state for a in outcome.status] == ["Ready", "Failed"]
        assert outcome.failures == [
            "LoRA adapter 'big' failed to load (unified): pod u0: adapter rank 64 is above --max-lora-rank 16"
        ]
        assert outcome.wake_s == RETRY_S
        assert len(kube.patches) == 1  # the gate opens: the replica serves the base model and adapter a
        loads = replicas.calls.count(("load", "u0", "big"))
        clock.now += RETRY_S / 2
        state.listings.clear()
        await sync.step(KEY, view, [pod("u0", gate=True)], state)
        assert replicas.calls.count(("load", "u0", "big")) == loads  # not yet
        clock.now += RETRY_S
        state.listings.clear()
        del replicas.refuse["big"]
        outcome = await settle(sync, view, [pod("u0", gate=True)], state)
        assert outcome.status is not None and [a.state for a in outcome.status] == ["Ready", "Ready"]
        assert outcome.failures == [] and outcome.wake_s is None

    asyncio.run(run())


def test_a_restarted_replica_gets_its_adapters_again() -> None:
    async def run() -> None:
        sync, replicas, _, clock, _ = make()
        state = LoraState()
        view = spec_with(("a", "hf://org/a"))
        await settle(sync, view, [pod("u0", gate=True)], state)
        sync.client.patches.clear()  # type: ignore[attr-defined]
        await sync.step(KEY, view, [pod("u0", gate=True, serving=False)], state)  # the container restarts
        ((_, closed),) = sync.client.patches  # type: ignore[attr-defined]
        assert closed["status"]["conditions"][0]["status"] == "False"  # out of the Services until reloaded
        replicas.held["u0"] = {}
        clock.now += 1
        outcome = await settle(sync, view, [pod("u0", gate=False)], state)
        assert replicas.held["u0"] == {"a": "hf://org/a"}
        assert sync.client.patches[-1][1]["status"]["conditions"][0]["status"] == "True"  # type: ignore[attr-defined]
        assert outcome.status is not None and outcome.status[0].state == "Ready"

    asyncio.run(run())


def test_without_spec_lora_nothing_is_called() -> None:
    async def run() -> None:
        sync, replicas, kube, _, _ = make()
        view = ServiceView.from_spec({k: v for k, v in SPEC.items() if k != "lora"})
        outcome = await sync.step(KEY, view, [pod("u0", gate=None)], LoraState())
        assert (outcome.status, outcome.failures, replicas.calls, kube.patches) == (None, [], [], [])

    asyncio.run(run())


def test_pod_info_reads_the_gate_and_container_readiness() -> None:
    obj = {
        "metadata": {"name": "p", "labels": {}},
        "spec": {"readinessGates": [{"conditionType": LORA_GATE}]},
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "ContainersReady", "status": "True"}, {"type": "Ready", "status": "False"}],
        },
    }
    info = pod_info(obj)
    assert (info.is_serving, info.is_ready, info.lora_gate) == (True, False, False)
    obj["status"]["conditions"].append({"type": LORA_GATE, "status": "True"})
    assert pod_info(obj).lora_gate is True
    assert pod_info({**obj, "spec": {}}).lora_gate is None


def test_http_client_speaks_vllms_api() -> None:
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((f"{request.method} {request.url}", body))
        if request.url.path.endswith("/v1/models"):
            data = [{"id": "svc", "root": "/models/base"}, {"id": "a", "root": "hf://org/a", "parent": "svc"}]
            return httpx.Response(200, json={"object": "list", "data": data})
        if request.url.path.endswith("/v1/load_lora_adapter") and body["lora_name"] == "bad":
            error = {"message": "adapter_model.safetensors is missing", "type": "BadRequestError", "code": 400}
            return httpx.Response(400, json={"error": error})
        return httpx.Response(200, text="Success: LoRA adapter 'a' added successfully.")

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            api = HttpReplicaApi(http, template_resolver("http://feed/{namespace}/{pod}"))
            target = pod("u0")
            assert await api.adapters("ns", target) == {"a": "hf://org/a"}
            assert (await api.load("ns", target, "a", "hf://org/a")).ok
            refused = await api.load("ns", target, "bad", "/x")
            assert (refused.status, refused.message) == (400, "adapter_model.safetensors is missing")
            assert (await api.unload("ns", target, "a")).ok

    asyncio.run(run())
    assert seen[0][0] == "GET http://feed/ns/u0/v1/models"
    assert seen[1] == ("POST http://feed/ns/u0/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "hf://org/a"})
    assert seen[-1] == ("POST http://feed/ns/u0/v1/unload_lora_adapter", {"lora_name": "a"})


def test_a_list_that_predates_a_finished_load_causes_no_second_load() -> None:
    """A load that ends while the replica's list is under way: the stale list must not cause a second load."""

    async def run() -> None:
        sync, replicas, _, _, _ = make()
        replicas.hold = asyncio.Event()
        state = LoraState()
        view = spec_with(("a", "hf://org/a"))
        await sync.step(KEY, view, [pod("u0", gate=True)], state)  # starts the load, which waits
        (task,) = state.tasks.values()
        stale_once = [True]
        listed = replicas.adapters

        async def racing(namespace: str, target: PodInfo, api_key: str | None = None) -> dict[str, str] | None:
            held = await listed(namespace, target)  # taken while the load is still under way
            if stale_once.pop() if stale_once else False:
                assert replicas.hold is not None
                replicas.hold.set()
                await task  # the load ends while this list is on the wire: its answer is stale
            return held

        replicas.adapters = racing  # type: ignore[method-assign]
        state.listings.clear()
        await sync.step(KEY, view, [pod("u0", gate=True)], state)
        assert replicas.calls == [("load", "u0", "a")]  # one load, no duplicate
        outcome = await sync.step(KEY, view, [pod("u0", gate=True)], state)  # the key re-queued by the load
        assert replicas.calls == [("load", "u0", "a")]
        assert outcome.status is not None and outcome.status[0].state == "Ready"

    asyncio.run(run())
