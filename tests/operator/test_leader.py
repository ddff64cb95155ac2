"""Lease-based leader election against an in-memory Lease with compare-and-swap, on a fake clock."""

from __future__ import annotations

import asyncio
import copy
import itertools
from typing import Any

from tidepool.operator.k8s import ApiError
from tidepool.operator.leader import LeaderElector, LeaseConfig


class LeaseApi:
    """One Lease object; create fails if it exists, replace fails unless the resourceVersion matches."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.rv = itertools.count(1)
        self.down = False
        self.writes = 0

    def _check(self) -> None:
        if self.down:
            raise ApiError(503, "unavailable")

    async def get_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._check()
        return copy.deepcopy(self.lease)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._check()
        if self.lease is not None:
            raise ApiError(409, "already exists", "AlreadyExists")
        self.lease = copy.deepcopy(obj)
        self.lease["metadata"]["resourceVersion"] = str(next(self.rv))
        self.writes += 1
        return copy.deepcopy(self.lease)

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._check()
        assert self.lease is not None
        if obj["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "the object has been modified", "Conflict")
        self.lease = copy.deepcopy(obj)
        self.lease["metadata"]["resourceVersion"] = str(next(self.rv))
        self.writes += 1
        return copy.deepcopy(self.lease)

    @property
    def holder(self) -> str | None:
        return (self.lease or {}).get("spec", {}).get("holderIdentity")


def elector(api: LeaseApi, identity: str, now: list[float]) -> LeaderElector:
    config = LeaseConfig(namespace="ops", name="tp", identity=identity)
    return LeaderElector(api, config, clock=lambda: now[0])  # type: ignore[arg-type]


def round_(e: LeaderElector) -> bool:
    return asyncio.run(e.try_acquire_or_renew())


def test_one_leader_and_the_standby_takes_over_only_after_the_lease_expires():
    api, now = LeaseApi(), [0.0]
    a, b = elector(api, "a", now), elector(api, "b", now)
    assert round_(a) and api.holder == "a"
    a.is_leader = True
    assert not round_(b)  # held and fresh
    for t in (5.0, 10.0):  # a renews: b keeps seeing a changing record, never expired
        now[0] = t
        assert round_(a)
        assert not round_(b)
    # a dies (no more renewals): b takes over lease_duration after it first saw the last record
    now[0] = 20.0
    assert not round_(b)
    now[0] = 25.1
    assert round_(b) and api.holder == "b"
    assert api.lease["spec"]["leaseTransitions"] == 1
    # the old leader, back, sees b holding it and its own renew fails
    assert not round_(a)


def test_a_released_lease_is_taken_at_once():
    api, now = LeaseApi(), [0.0]
    a, b = elector(api, "a", now), elector(api, "b", now)
    assert round_(a)
    a.is_leader = True
    asyncio.run(a.release())
    assert api.holder is None and not a.is_leader
    assert round_(b) and api.holder == "b"


def test_concurrent_candidates_cannot_both_win():
    api, now = LeaseApi(), [0.0]
    candidates = [elector(api, f"c{i}", now) for i in range(5)]

    async def race() -> list[bool]:
        return list(await asyncio.gather(*(c.try_acquire_or_renew() for c in candidates)))

    assert sum(asyncio.run(race())) == 1


def test_a_leader_that_cannot_renew_gives_up_after_the_renew_deadline():
    api, now = LeaseApi(), [0.0]

    async def sleep(seconds: float) -> None:  # the fake clock advances as the elector sleeps
        now[0] += seconds

    config = LeaseConfig(namespace="ops", name="tp", identity="a")
    a = LeaderElector(api, config, clock=lambda: now[0], sleep=sleep)  # type: ignore[arg-type]
    asyncio.run(a.acquire())
    assert a.is_leader
    api.down = True
    asyncio.run(asyncio.wait_for(a.hold(), timeout=10))  # returns: leadership lost
    assert not a.is_leader and config.renew_deadline_s < now[0] <= config.renew_deadline_s + 2 * config.retry_period_s


def test_a_leader_that_sees_another_holder_stops_at_once():
    api, now = LeaseApi(), [0.0]

    async def sleep(seconds: float) -> None:
        now[0] += seconds

    a = LeaderElector(api, LeaseConfig("ops", "tp", "a"), clock=lambda: now[0], sleep=sleep)  # type: ignore[arg-type]
    asyncio.run(a.acquire())
    api.lease["spec"]["holderIdentity"] = "b"  # somebody took it (e.g. after a long pause of ours)
    api.lease["metadata"]["resourceVersion"] = "99"
    asyncio.run(asyncio.wait_for(a.hold(), timeout=10))
    assert not a.is_leader and now[0] == a.config.retry_period_s
