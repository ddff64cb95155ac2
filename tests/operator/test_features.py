"""Optional CRDs: discovery into ClusterFeatures, the kinds the caches watch, and a CRD going away
(its informers stop and its cached objects are forgotten, so the controller never prunes ghosts)."""

from __future__ import annotations

import asyncio

from fake_api import FakeApi

from tidepool.operator.builders import ClusterFeatures
from tidepool.operator.cache import Informer
from tidepool.operator.controller import Controller, ControllerOptions
from tidepool.operator.features import OPTIONAL_KINDS, detect_features, refused_optional, watched_kinds


class Discovery:
    def __init__(self, served: set[tuple[str, str]]) -> None:
        self.served = served

    async def has_kind(self, group_version: str, kind: str) -> bool:
        return (group_version, kind) in self.served


def test_discovery_sets_each_flag_and_keeps_the_options():
    base = ClusterFeatures(gpus_per_node=4, engine_image="img")
    served = {("inference.networking.k8s.io/v1", "InferencePool")}
    found = asyncio.run(detect_features(Discovery(served), base))  # type: ignore[arg-type]
    assert found == ClusterFeatures(gpus_per_node=4, engine_image="img", has_inference_pool=True)
    assert "InferencePool" in watched_kinds(found) and "LeaderWorkerSet" not in watched_kinds(found)
    everything = asyncio.run(detect_features(Discovery(set(OPTIONAL_KINDS.values())), base))  # type: ignore[arg-type]
    assert {kind for _, kind in OPTIONAL_KINDS.values()} <= set(watched_kinds(everything))
    assert set(watched_kinds(ClusterFeatures())).isdisjoint(kind for _, kind in OPTIONAL_KINDS.values())


def pool_child(name: str) -> dict:
    meta = {
        "name": name,
        "namespace": "ns",
        "uid": f"u-{name}",
        "resourceVersion": "5",
        "generation": 1,
        "labels": {"tidepool.dev/inferenceservice": name, "app.kubernetes.io/managed-by": "tidepool-operator"},
        "ownerReferences": [{"uid": "owner"}],
    }
    return {"kind": "InferencePool", "metadata": meta, "spec": {}}


def test_a_crd_going_away_stops_its_informer_and_forgets_its_objects():
    async def run() -> tuple[Controller, asyncio.Task]:
        controller = Controller(FakeApi(), ControllerOptions(), ["ns"])  # type: ignore[arg-type]
        informer = Informer(controller.client, controller.store, "InferencePool", "ns", None)
        informer.task = asyncio.create_task(asyncio.sleep(3600))
        controller.informers[("InferencePool", "ns")] = informer
        controller._tasks.append(informer.task)
        controller.store.put(pool_child("a"))
        controller.store.put(pool_child("b"))
        assert set(controller.store.children_of(("ns", "a"), "owner")) == {("InferencePool", "a")}
        await controller._stop_informers({"InferencePool"})
        return controller, informer.task

    controller, task = asyncio.run(run())
    assert task.cancelled() and task not in controller._tasks
    assert ("InferencePool", "ns") not in controller.informers
    assert not list(controller.store.keys_in_scope("InferencePool", "ns"))
    assert controller.store.children_of(("ns", "a"), "owner") == {}


def test_a_refused_optional_apply_asks_for_discovery_at_once():
    pool = {"kind": "InferencePool", "metadata": {"name": "a"}}
    deployment = {"kind": "Deployment", "metadata": {"name": "a-unified"}}
    assert refused_optional([pool, deployment], {("Deployment", "a-unified"): {}})
    assert not refused_optional([pool, deployment], {("InferencePool", "a"): {}})  # only the Deployment failed
    assert not refused_optional([deployment], {("Deployment", "a-unified"): {}})
