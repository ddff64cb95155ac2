"""Actuation of `autoscaling.idle: sleep`: the autoscaler's sleep decision (idle.py) carried out on the engine pods.

After each decision (`Autoscaler.tick`), `Sleeper.step` brings the serving engine pods of the service (containers
ready, not being deleted, rank 0 of a multi-node replica: the one that serves HTTP) to the decided state over
vLLM's sleep-mode API (paths and levels from tidepool.contract.sleep, the engine's own names):
- asleep: every serving pod is asked `GET /is_sleeping`, and one that is awake gets `POST /sleep?level=1`
  (level 1: the KV cache is freed and the weights stay in host memory, so the wake is fast). Level-triggered,
  so a pod that started (or restarted) while the service sleeps is put to sleep at the next tick;
- awake: when the decision wakes the pools (or an earlier state left them asleep: a mode switch, the spec no
  longer `idle: sleep`), every serving pod gets `POST /wake_up`; a pod it did not reach is tried again at
  every tick until it answers.
The calls go through the pod client the LoRA step uses (operator/lora/client.py: the pod's address from the
cache, or TIDEPOOL_POD_URL_TEMPLATE in tests), with `Authorization: Bearer` when the service has spec.auth.
An Event is posted when the state changes (`Sleeping`, `Woken`), never per tick.

Invariants: never raises for a pod's failure (it is logged when the set of failing pods changes, and retried);
all it remembers of a service is its `SleepMemory` (in the service's AutoscaleState; lost on restart, when the
level-triggered rules above rebuild what matters: status.autoscaling.asleepSince says the decided state).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from tidepool.contract.sleep import (
    DEFAULT_LEVEL,
    IS_SLEEPING_KEY,
    IS_SLEEPING_PATH,
    LEVEL_PARAM,
    SLEEP_PATH,
    WAKE_UP_PATH,
)
from tidepool.operator.cache import PodInfo
from tidepool.operator.lora.client import LIST_TIMEOUT_S, HttpReplicaApi, Reply, auth_headers

from .policy_types import Decision

logger = logging.getLogger("tidepool.operator.autoscaler")
SLEEP_TIMEOUT_S = 120.0  # level 1 copies a GPU's weights to host memory inside the call
WAKE_TIMEOUT_S = 120.0  # ... and back
SLEEPING_REASON, WOKEN_REASON = "Sleeping", "Woken"
NO_LONGER_ASLEEP = "the pools are no longer kept asleep (autoscaling mode or idle changed): waking them"
EventSink = Callable[[Mapping[str, Any], str, str, str, str | None], Awaitable[None]]  # obj, type, reason, msg, key


class SleepApi(Protocol):
    async def is_sleeping(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> bool | None: ...
    async def sleep(self, namespace: str, pod: PodInfo, level: int, api_key: str | None = None) -> Reply: ...
    async def wake_up(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> Reply: ...


class HttpSleepApi(HttpReplicaApi):
    """`SleepApi` over the LoRA step's pod client (same resolver, auth header and error reading)."""

    async def is_sleeping(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> bool | None:
        """The engine's answer; None when it could not be asked (unreachable, refused, no sleep mode: 404)."""
        base = self.resolve(namespace, pod)
        if base is None:
            return None
        try:
            response = await self.http.get(
                f"{base}{IS_SLEEPING_PATH}", headers=auth_headers(api_key), timeout=LIST_TIMEOUT_S
            )
            response.raise_for_status()
            value = response.json().get(IS_SLEEPING_KEY)
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return value if isinstance(value, bool) else None

    async def sleep(self, namespace: str, pod: PodInfo, level: int, api_key: str | None = None) -> Reply:
        path = f"{SLEEP_PATH}?{LEVEL_PARAM}={level}"
        return await self._post(self.resolve(namespace, pod), path, {}, SLEEP_TIMEOUT_S, api_key)

    async def wake_up(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> Reply:
        return await self._post(self.resolve(namespace, pod), WAKE_UP_PATH, {}, WAKE_TIMEOUT_S, api_key)


@dataclass(slots=True)
class SleepMemory:
    """What the sleep step keeps about one service (in its AutoscaleState)."""

    unwoken: set[str] = field(default_factory=set)  # pods a wake did not reach yet (tried again each tick)
    failures: frozenset[str] = frozenset()  # the failure lines last logged (logged again only when they change)

    def reset(self) -> None:
        self.unwoken.clear()
        self.failures = frozenset()


def serving_pods(pods: Sequence[PodInfo], pools: Sequence[str]) -> list[PodInfo]:
    """The engine pods that answer HTTP now: of the service's pools, containers ready, live, rank 0."""
    return [p for p in pods if p.pool in pools and p.is_serving and p.is_live and p.rank == 0]


class Sleeper:
    """Carries out the decisions' sleep state (see the module docstring); `api` None: sleep is unsupported."""

    def __init__(self, api: SleepApi | None, event: EventSink) -> None:
        self.api, self.event = api, event

    async def step(
        self,
        body: Mapping[str, Any],
        decision: Decision,
        was_asleep: bool,
        pods: Sequence[PodInfo],
        memory: SleepMemory,
        api_key: str | None = None,
    ) -> None:
        """Bring `pods` (the service's serving engine pods) to `decision.is_asleep`; `was_asleep`: status said
        asleep before this decision (so an awake decision must wake them)."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        must_wake = not decision.is_asleep and (was_asleep or decision.sleep_change == "wake")
        api = self.api
        if api is None:
            if decision.is_asleep or must_wake:
                logger.warning("[%s/%s] autoscaling.idle sleep: this operator has no pod client", namespace, name)
            return
        failures: dict[str, str] = {}
        if decision.is_asleep:
            memory.unwoken.clear()
            failures = await _sleep_all(api, namespace, pods, api_key)
        elif must_wake or memory.unwoken:
            targets = pods if must_wake else [p for p in pods if p.name in memory.unwoken]
            failures = await _wake_all(api, namespace, targets, api_key)
            memory.unwoken = set(failures)  # a pod that is gone is not tried again: a new pod starts awake
        self._log(namespace, name, failures, memory)
        done = f"{len(pods) - len(failures)}/{len(pods)} serving pod(s)"
        if decision.is_asleep and decision.sleep_change == "sleep":  # Events on change only, never per tick
            await self.event(body, "Normal", SLEEPING_REASON, f"{decision.sleep_reason} ({done})"[:1000], None)
        elif must_wake:
            why = decision.sleep_reason if decision.sleep_change == "wake" else NO_LONGER_ASLEEP
            await self.event(body, "Normal", WOKEN_REASON, f"{why} ({done})"[:1000], None)

    @staticmethod
    def _log(namespace: str, name: str, failures: Mapping[str, str], memory: SleepMemory) -> None:
        lines = frozenset(f"{pod}: {why}" for pod, why in failures.items())
        if lines and lines != memory.failures:
            logger.warning("[%s/%s] sleep mode: %s", namespace, name, "; ".join(sorted(lines)))
        memory.failures = lines


async def _sleep_all(api: SleepApi, namespace: str, pods: Sequence[PodInfo], api_key: str | None) -> dict[str, str]:
    """Every awake pod of `pods` put to sleep; {pod: why} for those that could not be."""

    async def one(pod: PodInfo) -> str | None:
        asleep = await api.is_sleeping(namespace, pod, api_key)
        if asleep:
            return None
        if asleep is None:
            return f"GET {IS_SLEEPING_PATH} failed (is the engine serving with sleep mode?)"
        reply = await api.sleep(namespace, pod, DEFAULT_LEVEL, api_key)
        return None if reply.ok else f"POST {SLEEP_PATH}: {reply.status} {reply.message}"

    results = await asyncio.gather(*(one(p) for p in pods))
    return {p.name: r for p, r in zip(pods, results, strict=True) if r is not None}


async def _wake_all(api: SleepApi, namespace: str, pods: Sequence[PodInfo], api_key: str | None) -> dict[str, str]:
    """Every pod of `pods` woken; {pod: why} for those that could not be."""
    replies = await asyncio.gather(*(api.wake_up(namespace, p, api_key) for p in pods))
    failed = [(p, r) for p, r in zip(pods, replies, strict=True) if not r.ok]
    return {p.name: f"POST {WAKE_UP_PATH}: {r.status} {r.message}" for p, r in failed}
