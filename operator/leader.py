"""Leader election on a coordination.k8s.io/v1 Lease (client-go's algorithm), so several operator
replicas can run and exactly one reconciles.

Why a Lease and not kopf peering: a Lease is the cluster's own lock (compare-and-swap on its
resourceVersion), needs no extra CRD, lives in the operator's namespace (a namespaced Role that may
create leases and get/update only the one named lease: least privilege), and is what admins already
read (`kubectl get lease`). kopf peering is a presence protocol with priorities, not a lock: it needs
its own cluster-scoped CRD in all-namespace mode and pauses rather than fences.

Algorithm: a candidate GETs the Lease every `retry_period_s`; it may take it when nobody holds it or
when the holder's record has not changed for `lease_duration_s` as measured by the candidate's own
clock since it first saw that record (so clocks of different nodes never need to agree). The leader
renews every `retry_period_s` with a PUT carrying the last resourceVersion it saw (any concurrent
writer makes it fail); if it cannot renew for `renew_deadline_s` it has lost and must stop at once
(the caller exits the process, as controller-runtime does). A clean shutdown releases the Lease
(holder cleared), so the stand-by takes over on its next poll instead of waiting for expiry.
With the defaults (15 s / 10 s / 5 s) a stand-by takes over within ~20 s of the leader's death, and
the pair costs the API server ~24 requests a minute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tidepool.operator.k8s import ApiError, KubeClient

logger = logging.getLogger("tidepool.operator.leader")


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.lease_duration_s > self.renew_deadline_s > self.retry_period_s > 0:
            raise ValueError("leader election needs lease duration > renew deadline > retry period > 0")


def micro_time(t: float | None = None) -> str:
    """A metav1.MicroTime: RFC 3339 with microseconds, UTC."""
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        client: KubeClient,
        config: LeaseConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.client, self.config, self.clock, self.sleep = client, config, clock, sleep
        self.is_leader = False
        self._lease: dict[str, Any] | None = None  # the Lease as we last read or wrote it
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, duration) last seen
        self._observed_at = 0.0  # our clock when that record was first seen

    def _observe(self, lease: dict[str, Any]) -> dict[str, Any]:
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        self._lease = lease
        return spec

    def _spec(self, previous: dict[str, Any]) -> dict[str, Any]:
        now = micro_time()
        spec = {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": int(self.config.lease_duration_s),
            "renewTime": now,
            "acquireTime": previous.get("acquireTime") or now,
            "leaseTransitions": int(previous.get("leaseTransitions") or 0),
        }
        if previous.get("holderIdentity") != self.config.identity:
            spec["acquireTime"] = now
            spec["leaseTransitions"] += 1 if previous else 0
        return spec

    async def try_acquire_or_renew(self) -> bool:
        """One round: True when we hold the Lease afterwards."""
        cfg = self.config
        if self.is_leader and self._lease is not None:  # fast path: renew what we last wrote
            lease = {**self._lease, "spec": self._spec(self._lease.get("spec") or {})}
            try:
                self._observe(await self.client.replace(lease))
                return True
            except ApiError as exc:
                logger.info("renewing lease %s/%s failed (%s); re-reading it", cfg.namespace, cfg.name, exc.status)
        lease = await self.client.get_object("Lease", cfg.namespace, cfg.name)
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                "spec": self._spec({}),
            }
            try:
                self._observe(await self.client.create(body))
            except ApiError as exc:
                if exc.status == 409:  # another candidate created it first
                    return False
                raise
            return True
        spec = self._observe(lease)
        holder = spec.get("holderIdentity")
        duration = float(spec.get("leaseDurationSeconds") or cfg.lease_duration_s)
        if holder and holder != cfg.identity and self.clock() < self._observed_at + duration:
            return False  # held, and the holder renewed within its duration (by our clock)
        lease = {**lease, "kind": "Lease", "apiVersion": "coordination.k8s.io/v1", "spec": self._spec(spec)}
        try:
            self._observe(await self.client.replace(lease))
        except ApiError as exc:
            if exc.status == 409:  # somebody wrote it between our read and write
                return False
            raise
        if holder and holder != cfg.identity:
            logger.info("lease %s/%s: took over from %s (expired)", cfg.namespace, cfg.name, holder)
        return True

    async def _round(self) -> bool:
        try:
            return await asyncio.wait_for(self.try_acquire_or_renew(), timeout=self.config.renew_deadline_s)
        except (ApiError, OSError, TimeoutError) as exc:
            logger.warning("leader election round failed: %r", exc)
            return False
        except Exception as exc:  # aiohttp errors and the like: one failed round, not a crash
            logger.warning("leader election round failed: %r", exc)
            return False

    async def acquire(self) -> None:
        """Return once we are the leader (polls every retry period)."""
        cfg = self.config
        logger.info("waiting for leadership: lease %s/%s as %s", cfg.namespace, cfg.name, cfg.identity)
        while not await self._round():
            await self.sleep(cfg.retry_period_s)
        self.is_leader = True
        logger.info("became the leader (lease %s/%s)", cfg.namespace, cfg.name)

    async def hold(self) -> None:
        """Renew until leadership is lost (returns then); cancel it to stop renewing."""
        cfg = self.config
        last_renewed = self.clock()
        while True:
            await self.sleep(cfg.retry_period_s)
            if await self._round():
                last_renewed = self.clock()
                continue
            holder = (self._observed or (None,))[0]
            if holder not in (None, "", cfg.identity) or self.clock() - last_renewed > cfg.renew_deadline_s:
                self.is_leader = False
                logger.error("lost leadership of lease %s/%s (holder now %s)", cfg.namespace, cfg.name, holder)
                return

    async def release(self) -> None:
        """Give the Lease up (clean shutdown) so a stand-by need not wait for it to expire."""
        if not self.is_leader or self._lease is None:
            return
        self.is_leader = False
        spec = {**(self._lease.get("spec") or {}), "holderIdentity": None, "leaseDurationSeconds": 1}
        spec["renewTime"] = micro_time()
        try:
            await asyncio.wait_for(self.client.replace({**self._lease, "spec": spec}), timeout=5)
            logger.info("released lease %s/%s", self.config.namespace, self.config.name)
        except Exception as exc:  # best effort: the lease expires anyway
            logger.warning("releasing lease failed: %r", exc)
