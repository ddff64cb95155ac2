"""The LoRA step of one InferenceService's sync: bring every serving replica to the declared adapters.

Why the operator drives it (and not an in-pod watcher): the operator already keeps every pod's address
and readiness in its watch-fed cache and already reaches pods over HTTP (the autoscaler's scrape); it is
the one place that sees all replicas, so status.lora, the Degraded condition and the readiness gate come
from the same observations that drive the loads, with no extra container, image, RBAC or Secret in the
pods. The engine API it uses is vLLM's (`/v1/load_lora_adapter`), so nothing operator-specific runs in pods.

Each sync (`LoraSync.step`), for the replicas whose containers are ready (rank 0 of a multi-node replica):
1. list what each holds (`GET /v1/models`), at most once per `relist_s` per replica unless something
   changed (the declared adapters, a load that finished, the pod's readiness);
2. unload what is no longer declared (quick: the engine drops a name), start the loads that are missing
   as background tasks (a load may fetch files for minutes); a finished load re-queues the key;
3. open the pod's readiness gate (`tidepool.dev/lora-adapters`, a pod status condition) once every declared
   adapter was tried on it; ranks > 0 of a multi-node replica get it when their containers are ready; a
   rank 0 whose containers stop being ready (its engine restarts and loses its adapters) gets it closed
   again, so it returns to the Services only once its adapters are back;
4. return status.lora, the failure lines for Degraded, and when to sync again (a failed load is retried
   after `retry_s`).

Invariants: all memory of a service is its `LoraState` (in its `ServiceState`; lost on restart, rebuilt
from what the replicas list); at most one load per (pod, adapter) in flight; never raises for a replica's
failure (an API error patching the gate is logged and retried at the next sync).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidepool.operator.api import ServiceView, now_rfc3339
from tidepool.operator.api.status import LoraAdapterStatus
from tidepool.operator.builders.lora import LORA_GATE, declared_adapters
from tidepool.operator.cache import Key, PodInfo
from tidepool.operator.k8s import ApiError, KubeClient, resource_path

from .client import ReplicaApi
from .plan import Attempt, ReplicaView, failure_messages, is_settled, lora_status, plan_replica

logger = logging.getLogger("tidepool.operator.lora")
RETRY_S = 120.0  # a failed load is tried again after this long
RELIST_S = 30.0  # a replica's adapter list is trusted this long when nothing else changed


@dataclass(slots=True)
class Listing:
    held: dict[str, str] | None
    at: float  # when the list was asked for (a load that ended later may be missing from it)
    declared: tuple[tuple[str, str], ...]


@dataclass(slots=True)
class LoraState:
    """What the LoRA step keeps about one service (per pod name)."""

    attempts: dict[str, dict[str, Attempt]] = field(default_factory=dict)
    tasks: dict[tuple[str, str], asyncio.Task[None]] = field(default_factory=dict)
    listings: dict[str, Listing] = field(default_factory=dict)
    is_key_refused: bool = False  # with spec.auth: a replica answered 401 or could not list (the key rotated?)

    def take_key_refused(self) -> bool:
        """Whether the key may have been refused since the last call (the sync then reads the Secret again)."""
        refused, self.is_key_refused = self.is_key_refused, False
        return refused

    def cancel(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    def reset(self) -> None:
        self.cancel()
        self.attempts.clear()
        self.listings.clear()


@dataclass(frozen=True, slots=True)
class LoraOutcome:
    status: list[LoraAdapterStatus] | None  # None: the service has no spec.lora
    failures: list[str]
    wake_s: float | None  # sync again in this long (a failed load's retry)


class LoraSync:
    """Runs the LoRA step; `requeue(key)` is called when a background load finishes."""

    def __init__(
        self,
        api: ReplicaApi,
        client: KubeClient,
        requeue: Callable[[Key], None],
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = RETRY_S,
        relist_s: float = RELIST_S,
    ) -> None:
        self.api, self.client, self.requeue, self.clock = api, client, requeue, clock
        self.retry_s, self.relist_s = retry_s, relist_s

    async def step(
        self, key: Key, view: ServiceView, pods: Sequence[PodInfo], state: LoraState, api_key: str | None = None
    ) -> LoraOutcome:
        """One LoRA step; `api_key` (spec.auth's, api_keys.py) is sent as `Authorization: Bearer` on every call."""
        if view.lora is None:
            state.reset()
            return LoraOutcome(None, [], None)
        declared = declared_adapters(view)
        serving = [p for p in pods if p.pool in view.pool_names and p.is_serving and not p.is_terminating]
        replicas = [p for p in serving if p.rank == 0]
        self._forget_gone(state, {p.name for p in serving})
        listed = await asyncio.gather(*(self._listing(key, p, declared, state, api_key) for p in replicas))
        now = self.clock()
        views = []
        for pod, listing in zip(replicas, listed, strict=True):
            attempts = state.attempts.setdefault(pod.name, {})
            held = listing.held
            if held is None and api_key is not None:
                state.is_key_refused = True
            if held is not None:
                await self._converge(key, pod, declared, listing, attempts, state, now, api_key)
                if pod.lora_gate is False and is_settled(declared, held, attempts):
                    await self._set_gate(key[0], pod, True, f"tried all {len(declared)} declared adapters")
            views.append(ReplicaView(pod.name, pod.pool, held, dict(attempts)))
        for pod in serving:
            if pod.rank != 0 and pod.lora_gate is False:
                await self._set_gate(key[0], pod, True, "a worker rank: adapters load through its replica's rank 0")
        for pod in pods:  # a restarting engine lost its adapters: keep it out of Services until they are back
            if pod.rank == 0 and pod.lora_gate and not pod.is_serving and not pod.is_terminating:
                await self._set_gate(key[0], pod, False, "the engine restarted: loading the adapters again")
        status = lora_status(declared, view.pool_names, views)
        failures = failure_messages(status)
        return LoraOutcome(status, failures, self.retry_s if failures else None)

    def _forget_gone(self, state: LoraState, names: set[str]) -> None:
        """Drop what is kept about pods that no longer serve (a restarted container lost its adapters)."""
        for pod in [p for p in state.attempts if p not in names]:
            del state.attempts[pod]
        for pod in [p for p in state.listings if p not in names]:
            del state.listings[pod]
        for task_key in [k for k in state.tasks if k[0] not in names]:
            state.tasks.pop(task_key).cancel()

    async def _listing(
        self, key: Key, pod: PodInfo, declared: Mapping[str, str], state: LoraState, api_key: str | None
    ) -> Listing:
        wanted = tuple(declared.items())
        last = state.listings.get(pod.name)
        if last is not None and last.declared == wanted and self.clock() - last.at < self.relist_s:
            return last
        asked_at = self.clock()
        listing = Listing(await self.api.adapters(key[0], pod, api_key), asked_at, wanted)
        ended = [a for a in state.attempts.get(pod.name, {}).values() if a.state != "Loading" and a.at >= asked_at]
        if not ended:  # a load that ended meanwhile may be missing from it: not kept, asked again next time
            state.listings[pod.name] = listing
        return listing

    async def _converge(
        self,
        key: Key,
        pod: PodInfo,
        declared: Mapping[str, str],
        listing: Listing,
        attempts: dict[str, Attempt],
        state: LoraState,
        now: float,
        api_key: str | None,
    ) -> None:
        held = listing.held or {}
        plan = plan_replica(declared, held, attempts, now, self.retry_s, listing.at)
        for name in plan.unloads:
            reply = await self.api.unload(key[0], pod, name, api_key)
            state.is_key_refused |= reply.status == 401
            if reply.ok or reply.status == 404:  # 404: already gone
                held.pop(name, None)
                attempts.pop(name, None)
                logger.info("[%s/%s] unloaded LoRA adapter %r from %s", *key, name, pod.name)
            else:
                logger.warning("[%s/%s] unloading %r from %s: %s", *key, name, pod.name, reply.message)
        for name, path in plan.loads:
            if name in held:  # unloading the stale copy failed: try again at the next sync
                continue
            attempts[name] = Attempt(path, "Loading", "", now)
            task = asyncio.create_task(self._load(key, pod, name, path, state, api_key))
            state.tasks[(pod.name, name)] = task

    async def _load(self, key: Key, pod: PodInfo, name: str, path: str, state: LoraState, api_key: str | None) -> None:
        try:
            reply = await self.api.load(key[0], pod, name, path, api_key)
        finally:
            state.tasks.pop((pod.name, name), None)
        state.is_key_refused |= reply.status == 401
        attempts = state.attempts.get(pod.name)
        if attempts is None:  # the pod went away meanwhile
            return
        if reply.ok:
            attempts[name] = Attempt(path, "Ready", "", self.clock())
            logger.info("[%s/%s] loaded LoRA adapter %r on %s", *key, name, pod.name)
        else:
            message = reply.message or f"HTTP {reply.status}"
            attempts[name] = Attempt(path, "Failed", message, self.clock())
            logger.warning("[%s/%s] LoRA adapter %r failed to load on %s: %s", *key, name, pod.name, message)
        state.listings.pop(pod.name, None)  # list again: the load changed what it holds
        self.requeue(key)

    async def _set_gate(self, namespace: str, pod: PodInfo, is_open: bool, message: str) -> None:
        condition: dict[str, Any] = {
            "type": LORA_GATE,
            "status": "True" if is_open else "False",
            "reason": "AdaptersTried" if is_open else "EngineRestarted",
            "message": message,
            "lastTransitionTime": now_rfc3339(),
        }
        path = resource_path("Pod", namespace, pod.name, "status")
        try:
            await self.client.request(
                "PATCH",
                path,
                body={"status": {"conditions": [condition]}},
                content_type="application/strategic-merge-patch+json",
            )
        except ApiError as exc:
            logger.warning("[%s] setting the LoRA readiness gate of %s: %s", namespace, pod.name, exc)
