"""A pool of engine replicas: membership, health state, load, and holding requests while none is ready.

States: a replica found by discovery starts `unready`; the health checker makes it `ready`
when its `/ready` answers 200 (and records the load it scrapes), `unready` when `/ready`
answers otherwise (loading, draining), and `ejected` after `max_failures` consecutive
failures (probe or proxied request; a refused connection ejects at once). An ejected replica
is readmitted by a successful probe no sooner than `eject_s` after its ejection.

LoRA affinity: `set_models` records what a replica's `/v1/models` lists (see `lora`); `acquire`
given the request's `model` chooses among the ready replicas holding that adapter when there are
any (an affinity hit), else among all by load (a miss); base-model requests are routed as before.

Holding: `acquire` waits (asyncio, no polling) while the pool has no ready replica, counting
the waiter in `num_held` (exported as `tidepool_router_held_requests`), until a replica is
ready or the hold deadline passes.

Invariants: only `ready` replicas are chosen; `num_inflight` is incremented by `acquire` and
decremented exactly once by `release`; the pool's event loop is the only writer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from .lora import ReplicaModels, adapter_holders
from .policy import Choice, Policy, ReplicaLoad, least_loaded

logger = logging.getLogger(__name__)


class ReplicaState(enum.StrEnum):
    READY = "ready"
    UNREADY = "unready"
    EJECTED = "ejected"


@dataclass(slots=True, frozen=True)
class Endpoint:
    url: str  # base URL, e.g. http://10.0.0.5:8000
    kv_addr: str | None = None  # host:port of the replica's KV-transfer listener (decode pools)


@dataclass(slots=True)
class Replica:
    endpoint: Endpoint
    state: ReplicaState = ReplicaState.UNREADY
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_inflight: int = 0
    num_dispatched: int = 0
    num_failures: int = 0  # consecutive failures
    ejected_at: float | None = None
    models: ReplicaModels | None = None  # from its last /v1/models (None: unknown)

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def label(self) -> str:
        return self.url.split("://", 1)[-1]

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(
            self.url, self.num_waiting, self.num_running, self.kv_usage, self.num_inflight, self.num_dispatched
        )


class NoReplicaError(Exception):
    """No replica to send to: the pool stayed empty past the hold deadline, or every ready one was tried."""

    def __init__(self, message: str, is_timeout: bool) -> None:
        super().__init__(message)
        self.is_timeout = is_timeout


class Pool:
    def __init__(self, name: str, policy: Policy, max_failures: int = 3, eject_s: float = 5.0) -> None:
        self.name = name
        self.policy = policy
        self.max_failures = max_failures
        self.eject_s = eject_s
        self.replicas: dict[str, Replica] = {}
        self.num_held = 0
        self._changed = asyncio.Event()  # set (and replaced) whenever a replica becomes ready

    # --- membership (discovery) -------------------------------------------------------------
    def set_members(self, endpoints: Iterable[Endpoint]) -> list[Replica]:
        """Replace the membership; keeps the state of replicas still present. Returns the new ones."""
        wanted = {e.url: e for e in endpoints}
        for url in list(self.replicas):
            if url not in wanted:
                logger.info("pool %s: replica %s removed by discovery", self.name, url)
                del self.replicas[url]
        added = []
        for url, endpoint in wanted.items():
            replica = self.replicas.get(url)
            if replica is None:
                logger.info("pool %s: replica %s discovered", self.name, url)
                replica = self.replicas[url] = Replica(endpoint)
                added.append(replica)
            elif replica.endpoint != endpoint:
                replica.endpoint = endpoint  # e.g. its kv port changed
        return added

    # --- health -------------------------------------------------------------------------------
    def mark_ready(self, url: str, num_waiting: int, num_running: int, kv_usage: float) -> None:
        replica = self.replicas.get(url)
        if replica is None:
            return
        replica.num_waiting, replica.num_running, replica.kv_usage = num_waiting, num_running, kv_usage
        if replica.state is ReplicaState.EJECTED and time.monotonic() - (replica.ejected_at or 0.0) < self.eject_s:
            return
        replica.num_failures = 0
        if replica.state is not ReplicaState.READY:
            logger.info("pool %s: replica %s is ready", self.name, url)
            replica.state = ReplicaState.READY
            replica.ejected_at = None
            self._changed.set()
            self._changed = asyncio.Event()

    def mark_unready(self, url: str, reason: str) -> None:
        replica = self.replicas.get(url)
        if replica is not None and replica.state is ReplicaState.READY:
            logger.info("pool %s: replica %s not ready (%s)", self.name, url, reason)
            replica.state = ReplicaState.UNREADY

    def record_failure(self, url: str, reason: str, is_fatal: bool = False) -> None:
        """A failed probe or request; `is_fatal` (connection refused) ejects at once."""
        replica = self.replicas.get(url)
        if replica is None:
            return
        replica.num_failures += 1
        if replica.state is not ReplicaState.EJECTED and (is_fatal or replica.num_failures >= self.max_failures):
            logger.warning(
                "pool %s: ejecting replica %s after %d failure(s): %s", self.name, url, replica.num_failures, reason
            )
            replica.state = ReplicaState.EJECTED
            replica.ejected_at = time.monotonic()

    def set_models(self, url: str, models: ReplicaModels | None) -> None:
        replica = self.replicas.get(url)
        if replica is not None:
            replica.models = models

    def record_success(self, url: str) -> None:
        replica = self.replicas.get(url)
        if replica is not None:
            replica.num_failures = 0

    # --- choosing -----------------------------------------------------------------------------
    def ready(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state is ReplicaState.READY]

    def count_by_state(self) -> dict[ReplicaState, int]:
        counts = dict.fromkeys(ReplicaState, 0)
        for replica in self.replicas.values():
            counts[replica.state] += 1
        return counts

    def choose(self, candidates: list[Replica], key: bytes | None, policy: Policy, model: Any = None) -> Choice:
        """The policy's choice among `candidates`, narrowed to the holders of adapter `model` when any holds it."""
        holders = adapter_holders(model, {r.url: r.models for r in self.replicas.values()})
        if holders is None:
            return policy.choose([r.load() for r in candidates], key)
        held = [r for r in candidates if r.url in holders]
        if held:
            return replace(policy.choose([r.load() for r in held], key), affinity="hit")
        return Choice(least_loaded([r.load() for r in candidates]).replica_id, "least_load", "miss")

    async def acquire(
        self,
        key: bytes | None,
        deadline: float,
        exclude: frozenset[str] = frozenset(),
        policy: Policy | None = None,
        model: Any = None,
    ) -> tuple[Replica, Choice]:
        """A ready replica not in `exclude` (counted in flight), holding while the pool has none ready;
        `model` is the request's (an adapter name gets LoRA affinity, see `choose`).

        Raises NoReplicaError when the deadline (time.monotonic()) passes with no ready replica,
        or at once when every ready replica is in `exclude`.
        """
        held = False
        try:
            while True:
                ready = self.ready()
                candidates = [r for r in ready if r.url not in exclude]
                if candidates:
                    choice = self.choose(candidates, key, policy or self.policy, model)
                    replica = self.replicas[choice.replica_id]
                    replica.num_inflight += 1
                    replica.num_dispatched += 1
                    return replica, choice
                if ready:
                    raise NoReplicaError(f"every ready replica of pool '{self.name}' failed this request", False)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NoReplicaError(f"no ready replica in pool '{self.name}'", True)
                if not held:
                    held = True
                    self.num_held += 1
                    logger.info("pool %s: no ready replica, holding a request (%d held)", self.name, self.num_held)
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    continue
        finally:
            if held:
                self.num_held -= 1

    def release(self, replica: Replica) -> None:
        replica.num_inflight -= 1
