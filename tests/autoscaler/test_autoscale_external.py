"""`autoscaling.mode: external`: HPA/KEDA own the scale subresource; Tidepool's autoscaler does nothing.

Checked at the seams the controller uses, in its order: `ServiceView.is_autoscaled` (whether it ticks),
the tick itself (no scrape, no status write, no Event even when called), `applied_replicas` (what the
reconcile applies) and `reconcile.desire` (the children it builds): the scaled pool's replicas follow
`spec.replicas` as a scale-subresource writer sets them, whatever an earlier active mode decided.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from tidepool.operator.api import InferenceServiceSpec, ServiceView
from tidepool.operator.autoscaler import handlers
from tidepool.operator.builders import ClusterFeatures, Desired
from tidepool.operator.reconcile import desire

# status.autoscaling as an earlier active mode left it: it must not be applied any more.
STALE = {"mode": "active", "pools": {"unified": {"desiredReplicas": 7}, "decode": {"desiredReplicas": 7}}}


def service(mode: str, disaggregated: bool = False, replicas: int | None = 5) -> dict[str, Any]:
    if disaggregated:
        pools = {
            "prefill": {"replicas": 2, "minReplicas": 1, "maxReplicas": 8},
            "decode": {"replicas": 3, "minReplicas": 0, "maxReplicas": 8},
        }
    else:
        pools = {"unified": {"replicas": 2, "minReplicas": 0, "maxReplicas": 8}}
    spec: dict[str, Any] = {
        "model": {"uri": "hf://org/m"},
        "mode": "disaggregated" if disaggregated else "unified",
        "pools": pools,
        "autoscaling": {"enabled": True, "mode": mode},
    }
    if replicas is not None:
        spec["replicas"] = replicas  # what `kubectl scale` / an HPA writes through the scale subresource
    meta = {"namespace": "ns", "name": "svc", "uid": "u-1", "generation": 1, "resourceVersion": "1"}
    return {"metadata": meta, "spec": spec, "status": {"autoscaling": copy.deepcopy(STALE)}}


def applied(body: dict[str, Any]) -> tuple[dict[str, int] | None, tuple[str, str] | None]:
    return handlers.applied_replicas(ServiceView.from_body(body), body["status"])


def built(body: dict[str, Any], replicas: dict[str, int] | None) -> Desired:
    return desire(ServiceView.from_body(body), body["metadata"], ClusterFeatures(), replicas)


class Untouchable:
    """A metrics source and a status client that record any use."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def fetch(self, namespace: str, name: str, pools: Any) -> dict:
        self.calls.append("scrape")
        return {}

    async def patch_status(self, *args: Any, **kwargs: Any) -> dict:
        self.calls.append("status")
        return {}


def test_the_api_accepts_external_and_the_autoscaler_is_off():
    body = service("external")
    spec = InferenceServiceSpec.model_validate(body["spec"])
    assert spec.autoscaling.mode == "external" and spec.scaled_pool() == "unified"
    assert not ServiceView.from_body(body).is_autoscaled
    assert all(ServiceView.from_body(service(mode)).is_autoscaled for mode in ("advisory", "active"))


def test_a_tick_in_external_mode_scrapes_and_writes_nothing():
    body = service("external")
    fake = Untouchable()
    events: list[str] = []

    async def event(*args: Any) -> None:
        events.append(args[2])

    auto = handlers.Autoscaler(fake, lambda ns, n: [], event, fake, 15.0, 60.0, clock=lambda: 1_000_000.0)
    state = handlers.AutoscaleState()
    assert asyncio.run(auto.tick(("ns", "svc"), ServiceView.from_body(body), body, state)) is body
    assert fake.calls == [] and events == []
    assert body["status"]["autoscaling"] == STALE  # nothing written


@pytest.mark.parametrize("disaggregated", [False, True])
def test_the_scaled_pool_follows_the_scale_subresource(disaggregated: bool):
    for spec_replicas in (5, 1, 0):  # an HPA/KEDA writer moving spec.replicas, down to zero
        body = service("external", disaggregated, spec_replicas)
        replicas, limited = applied(body)
        assert (replicas, limited) == (None, None)  # the stale active decision is never applied
        desired = built(body, replicas)
        counts = {pool.name: pool.desired for pool in desired.pools}
        scaled = "decode" if disaggregated else "unified"
        assert desired.scaled_pool == scaled and counts[scaled] == spec_replicas
        (workload,) = (
            c for c in desired.children if c["kind"] == "Deployment" and c["metadata"]["name"] == f"svc-{scaled}"
        )
        assert workload["spec"]["replicas"] == spec_replicas
        if disaggregated:
            assert counts["prefill"] == 2  # not driven by the scale subresource: its own replicas


def test_active_mode_with_the_same_status_applies_its_decision():
    """The contrast that makes the external test meaningful: active mode applies status, not spec.replicas."""
    body = service("active")
    replicas, _ = applied(body)
    assert replicas == {"unified": 7}
    counts = {pool.name: pool.desired for pool in built(body, replicas).pools}
    assert counts["unified"] == 7
