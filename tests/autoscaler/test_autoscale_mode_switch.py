"""Switching `autoscaling.mode` leaves nothing stale: status.autoscaling and the per-service metric series.

active -> external (or disabled): `Autoscaler.clear` removes status.autoscaling (one conditional write,
none when there is nothing to remove) and every series labelled with the service. active <-> advisory:
the next tick starts afresh (no stabilization state, lastScaleTime or series of the other mode).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from prometheus_client import REGISTRY
from test_autoscale_actuation import FakeKube, FixedSource, isvc

from tidepool.operator.api import ServiceView
from tidepool.operator.autoscaler import handlers


def service(name: str, mode: str) -> dict[str, Any]:
    """isvc() under its own name: the registry is process-wide, and other tests tick `svc`."""
    body = isvc(mode)
    body["metadata"]["name"] = name
    return body


def series_of(name: str) -> list[tuple[str, dict[str, str]]]:
    """Every operator autoscaler sample labelled with this service."""
    return [
        (s.name, s.labels)
        for metric in REGISTRY.collect()
        if metric.name.startswith("tidepool_autoscaler_")
        for s in metric.samples
        if s.labels.get("namespace") == "ns" and s.labels.get("name") == name
    ]


class ClearingKube(FakeKube):
    """FakeKube that also takes `{"autoscaling": None}` (removing the field)."""

    async def patch_status(self, kind, namespace, name, status, resource_version=None):
        if status.get("autoscaling") is None:
            assert resource_version == self.body["metadata"]["resourceVersion"]
            self.patches.append(copy.deepcopy(status))
            self.body["status"].pop("autoscaling", None)
            self.body["metadata"]["resourceVersion"] = str(int(self.body["metadata"]["resourceVersion"]) + 1)
            return copy.deepcopy(self.body)
        return await super().patch_status(kind, namespace, name, status, resource_version)


def tick(auto: handlers.Autoscaler, key: tuple[str, str], body: Any, state: handlers.AutoscaleState) -> Any:
    return asyncio.run(auto.tick(key, ServiceView.from_body(body), body, state))


def applied(body: Any) -> Any:
    return handlers.applied_replicas(ServiceView.from_body(body), body["status"])


def autoscaler(kube: FakeKube, now: list[float]) -> handlers.Autoscaler:
    async def event(*_: Any) -> None:
        return None

    return handlers.Autoscaler(kube, lambda ns, n: [], event, FixedSource(0.9), 15.0, 60.0, clock=lambda: now[0])


def test_active_to_external_clears_status_and_series():
    key = ("ns", "to-external")
    body = service(key[1], "active")
    kube = ClearingKube(body)
    auto, state = autoscaler(kube, [1_000_000.0]), handlers.AutoscaleState()
    body = tick(auto, key, body, state)
    assert body["status"]["autoscaling"]["mode"] == "active"
    assert applied(body)[0] == {"unified": 4}
    names = {n for n, _ in series_of(key[1])}
    assert {"tidepool_autoscaler_desired_replicas", "tidepool_autoscaler_decisions_total"} <= names

    body = copy.deepcopy(body)
    body["spec"]["autoscaling"]["mode"] = "external"
    body["spec"]["replicas"] = 4  # external mode needs the scale subresource's field (the API server insists)
    kube.body = body
    assert not ServiceView.from_body(body).is_autoscaled
    cleared = asyncio.run(auto.clear(key, body, state))
    assert "autoscaling" not in cleared["status"]
    assert kube.patches[-1] == {"autoscaling": None}
    assert series_of(key[1]) == []
    writes = len(kube.patches)
    assert asyncio.run(auto.clear(key, cleared, state)) is cleared  # nothing stale: no write
    assert len(kube.patches) == writes


def test_active_to_advisory_starts_afresh():
    key = ("ns", "to-advisory")
    body = service(key[1], "active")
    now = [1_000_000.0]
    kube = ClearingKube(body)
    auto, state = autoscaler(kube, now), handlers.AutoscaleState()
    for _ in range(2):
        body = tick(auto, key, body, state)
        now[0] += 15.0
    before = body["status"]["autoscaling"]
    assert before["mode"] == "active" and before["lastScaleTime"] and before["recommendations"]
    assert {labels["mode"] for _, labels in series_of(key[1]) if "mode" in labels} == {"active"}

    body = copy.deepcopy(body)
    body["spec"]["autoscaling"]["mode"] = "advisory"
    kube.body = body
    after = tick(auto, key, body, state)["status"]["autoscaling"]
    assert after["mode"] == "advisory"
    assert "lastScaleTime" not in after  # the active mode's scale is not the advisory mode's
    assert [r["time"] for r in after["recommendations"]] == [handlers._rfc3339(now[0])]  # only this tick's
    assert applied(kube.body) == (None, None)  # advisory: nothing applied
    assert {labels["mode"] for _, labels in series_of(key[1]) if "mode" in labels} == {"advisory"}


def test_reset_drops_the_series_of_a_deleted_service():
    key = ("ns", "gone")
    body = service(key[1], "active")
    state = handlers.AutoscaleState()
    tick(autoscaler(ClearingKube(body), [1_000_000.0]), key, body, state)
    assert series_of(key[1]) and state.history is not None and state.windows
    state.reset()  # what the controller does when the service is gone (ServiceSync.forget)
    assert series_of(key[1]) == []
    assert (state.history, state.next_tick, state.windows) == (None, 0.0, {})
