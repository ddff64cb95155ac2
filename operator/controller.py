"""The InferenceService controller: caches fed by watches, a work queue, workers that reconcile.

Flow: informers (cache.py) keep every InferenceService and every labelled child and pod in memory
and call `_on_change(namespace, service)` on each change, which queues the service's key. Workers
take keys from the queue (one worker per key at a time; triggers coalesce) and run `sync(key)`:

1. read the InferenceService from the cache (gone: forget it; being deleted: nothing to do, the
   garbage collector removes the children through their owner references; a finalizer left by
   an older operator is removed so deletes never wait for us);
2. the autoscaler's tick when it is due (autoscaler/handlers.py; it writes `status.autoscaling`); with
   the autoscaler off or external, a `status.autoscaling` an earlier mode left is removed once;
3. reconcile (reconcile.py). Fast path: when the generation, the autoscaler's replicas and the
   cluster features are those last verified and every child's version (generation for workloads,
   resourceVersion otherwise) is one already verified to match the spec, nothing is built or
   compared: only status is recomputed from cached workloads and pods. Otherwise (and on the
   jittered resync, every `resync_seconds`, the safety net for anything a watch could miss) the
   builders run and every child is compared and applied where it differs;
4. write status if it changed, with the resourceVersion it was computed from.

Errors re-queue the key with per-key exponential backoff. Waiting for pods needs no retry: pod
and workload events re-queue the key. Steady state costs the API server only the watches' periodic
reconnects. Events are posted for real transitions only (Created, Scaled, RollingOut,
DriftCorrected, Pruned, InvalidSpec, ApplyFailed), and ClaimKept while it lasts (events.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import ValidationError

from tidepool.operator.api import InferenceServiceStatus, now_rfc3339
from tidepool.operator.autoscaler.handlers import Autoscaler, applied_replicas, is_autoscaled
from tidepool.operator.builders import ClusterFeatures, SpecError
from tidepool.operator.cache import CHILD_SELECTOR, SERVICE_KIND, Informer, Store, compact
from tidepool.operator.claims import with_shared_claims
from tidepool.operator.events import EventRecorder
from tidepool.operator.features import detect_features, refused_optional, watched_kinds
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.reconcile import (
    LEGACY_FINALIZER,
    WORKLOAD_KINDS,
    Desired,
    apply_all,
    desire,
    drop_legacy_finalizer,
    hold_router,
    observe,
    old_pools,
    plan,
    pruned_event,
    status_patch,
    write_status,
)
from tidepool.operator.status import Outcome, build_status, downloads_in_progress, observe_pool, pod_problems
from tidepool.operator.workqueue import WorkQueue

logger = logging.getLogger("tidepool.operator")
Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class ControllerOptions:
    resync_seconds: float = 600.0
    workers: int = 16
    features: ClusterFeatures = field(default_factory=ClusterFeatures)  # options; CRD presence is detected
    feature_recheck_seconds: float = 300.0  # how often optional CRDs (LWS, ServiceMonitor, InferencePool) are looked up


@dataclass(slots=True)
class Verified:
    """What the last full reconcile of a key established (the fast path's evidence)."""

    fingerprint: tuple[Any, ...]
    versions: dict[tuple[str, str], str]  # child -> version that matched the spec
    desired: Desired  # children dropped; pool layouts, URL and selector kept
    has_deferred: bool  # make-before-break prunes still waiting


class Controller:
    def __init__(self, client: KubeClient, options: ControllerOptions, namespaces: list[str] | None = None) -> None:
        self.client, self.options = client, options
        self.namespaces: list[str | None] = list(namespaces) if namespaces else [None]
        self.store = Store(self._on_change)
        # Keys reconciled before go first: their triggers finish work in progress (see workqueue.py).
        self.queue = WorkQueue(is_known=lambda key: key in self.verified)
        self.events = EventRecorder(client)
        self.features = options.features
        self.verified: dict[Key, Verified] = {}
        self.resync_due: dict[Key, float] = {}
        self.tick_timers: dict[Key, float] = {}  # when each autoscaled key's next tick wakes it
        self.informers: dict[tuple[str, str | None], Informer] = {}
        self._tasks: list[asyncio.Task] = []
        self.autoscaler: Autoscaler | None = None
        self.num_syncs = 0
        self.num_full = 0
        self.is_synced = False
        self.recheck_features = asyncio.Event()

    # ---- wiring ------------------------------------------------------------------------------
    def _on_change(self, namespace: str, name: str) -> None:
        self.queue.add((namespace, name))

    def _start_informer(self, kind: str) -> list[Informer]:
        started = []
        for ns in self.namespaces:
            if (kind, ns) in self.informers:
                continue
            selector = None if kind == SERVICE_KIND else CHILD_SELECTOR
            informer = Informer(self.client, self.store, kind, ns, selector)
            self.informers[(kind, ns)] = informer
            informer.task = asyncio.create_task(informer.run(), name=f"informer {informer.name}")
            self._tasks.append(informer.task)
            started.append(informer)
        return started

    async def _stop_informers(self, kinds: set[str]) -> None:
        """Stop watching kinds whose CRD went away, and forget their cached objects (they went with it)."""
        for (kind, ns), informer in list(self.informers.items()):
            if kind not in kinds:
                continue
            del self.informers[(kind, ns)]
            if informer.task is not None:
                informer.task.cancel()
                await asyncio.gather(informer.task, return_exceptions=True)
                self._tasks.remove(informer.task)
            for namespace, name in list(self.store.keys_in_scope(kind, ns)):
                stub = self.store.stub(kind, namespace, name)
                if stub is not None:
                    self.store.delete(stub)

    async def start(self, autoscaler: Autoscaler | None) -> None:
        """Fill the caches (waits for every initial list), then start workers and timers."""
        self.autoscaler = autoscaler
        self.features = await detect_features(self.client, self.options.features)
        t0 = time.monotonic()
        informers = [i for kind in watched_kinds(self.features) for i in self._start_informer(kind)]
        await asyncio.gather(*(i.synced.wait() for i in informers))
        self.is_synced = True
        logger.info(
            "caches synced in %.1fs: %s; %d workers, resync every %.0fs",
            time.monotonic() - t0,
            self.store.count(),
            self.options.workers,
            self.options.resync_seconds,
        )
        for i in range(self.options.workers):
            self._tasks.append(asyncio.create_task(self._worker(), name=f"worker {i}"))
        self._tasks.append(asyncio.create_task(self.queue.run_timers(), name="queue timers"))
        self._tasks.append(asyncio.create_task(self._resync_loop(), name="resync"))
        self._tasks.append(asyncio.create_task(self._feature_loop(), name="features"))
        self._tasks.append(asyncio.create_task(self._stats_loop(), name="stats"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def failed_task(self) -> str | None:
        """The name of a background task that died (the liveness probe fails on it)."""
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                return f"{task.get_name()}: {task.exception()!r}"
        return None

    async def _feature_loop(self) -> None:
        """Discovery again every feature_recheck_seconds, or at once when an optional kind's apply failed."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.recheck_features.wait(), self.options.feature_recheck_seconds)
            self.recheck_features.clear()
            try:
                features = await detect_features(self.client, self.options.features)
            except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
                logger.warning("feature discovery failed: %r", exc)
                continue
            if features == self.features:
                continue
            logger.info("cluster features changed: %s -> %s", self.features, features)
            await self._stop_informers(set(watched_kinds(self.features)) - set(watched_kinds(features)))
            started = [i for kind in watched_kinds(features) for i in self._start_informer(kind)]
            await asyncio.gather(*(i.synced.wait() for i in started))
            self.features = features
            for key in self.store.service_keys():
                self.queue.add(key, full=True)

    async def _resync_loop(self) -> None:
        """The safety net: every key gets a full reconcile every resync_seconds (+-10%, spread out)."""
        while True:
            await asyncio.sleep(5.0)
            now = time.monotonic()
            for key, due in list(self.resync_due.items()):
                if due <= now:
                    del self.resync_due[key]
                    self.queue.add(key, full=True)

    async def _stats_loop(self, every_s: float = 60.0) -> None:
        """One INFO line a minute while there is work: what the controller did and what it cost."""
        client = self.client
        last = (0, 0, 0)
        while True:
            await asyncio.sleep(every_s)
            now = (self.num_syncs, self.num_full, client.num_requests)
            if now == last:
                continue
            verbs = ", ".join(
                f"{verb} {n} ({1000 * client.seconds_by_verb[verb] / n:.0f} ms)"
                for verb, n in sorted(client.requests_by_verb.items())
            )
            logger.info(
                "%d syncs (%d full) in %.0fs; queue %d ready, %d processing, %d delayed; cache %s; "
                "API requests so far: %s; throttled %d",
                now[0] - last[0], now[1] - last[1], every_s, len(self.queue), self.queue.num_processing,
                self.queue.num_delayed, self.store.count(), verbs, client.num_throttled,
            )  # fmt: skip
            last = now

    async def _worker(self) -> None:
        while True:
            key, full = await self.queue.get()
            try:
                await self.sync(key, full)
                self.queue.forget(key)
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                delay = self.queue.add_rate_limited(key)
                level = logging.INFO if exc.status == 409 else logging.WARNING
                logger.log(level, "[%s/%s] %s; retrying in %.1fs", *key, exc, delay)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                delay = self.queue.add_rate_limited(key)
                logger.warning("[%s/%s] API server unreachable (%r); retrying in %.1fs", *key, exc, delay)
            except Exception:
                delay = self.queue.add_rate_limited(key)
                logger.exception("[%s/%s] reconcile failed; retrying in %.1fs", *key, delay)
            finally:
                self.queue.done(key)

    def _wake_for_tick(self, key: Key, delay_s: float) -> None:
        """One timer per key for its next autoscaler tick (syncs triggered by events must not add more)."""
        due = time.monotonic() + delay_s
        pending = self.tick_timers.get(key)
        if pending is not None and time.monotonic() <= pending <= due + 0.5:
            return
        self.tick_timers[key] = due
        self.queue.add_after(key, delay_s + 0.01)

    def forget(self, key: Key) -> None:
        self.verified.pop(key, None)
        self.resync_due.pop(key, None)
        self.tick_timers.pop(key, None)
        if self.autoscaler is not None:
            self.autoscaler.forget(key)

    # ---- one key -----------------------------------------------------------------------------
    async def sync(self, key: Key, full: bool = False) -> None:
        self.num_syncs += 1
        cached = self.store.service(key)
        if cached is None:
            self.forget(key)
            return
        body = cached.body()
        meta = body["metadata"]
        if LEGACY_FINALIZER in (meta.get("finalizers") or []):
            body = await drop_legacy_finalizer(self.client, body)
            self.store.put({**body, "kind": SERVICE_KIND})
            logger.info("[%s/%s] removed the finalizer of an older operator version", *key)
        if meta.get("deletionTimestamp"):
            return
        if self.autoscaler is not None:
            if is_autoscaled(body):
                if self.autoscaler.seconds_until_due(key) <= 0:
                    body = await self.autoscaler.tick(key, body)
                    self.store.put({**body, "kind": SERVICE_KIND})
                self._wake_for_tick(key, self.autoscaler.seconds_until_due(key))
            else:  # off or external: forget it, and clear the status.autoscaling an earlier mode left
                cleared = await self.autoscaler.clear(key, body)
                if cleared is not body:
                    body = dict(cleared)
                    self.store.put({**body, "kind": SERVICE_KIND})
                self.tick_timers.pop(key, None)
        await self._reconcile(key, body, full)

    async def _reconcile(self, key: Key, body: dict[str, Any], full: bool) -> None:
        meta = body["metadata"]
        uid, generation = meta["uid"], int(meta.get("generation", 1))
        replicas, scaling_limit = applied_replicas(body)
        fingerprint = (uid, generation, tuple(sorted((replicas or {}).items())), self.features)
        children = self.store.children_of(key, uid)
        pods = self.store.pods_of(key)
        previous = InferenceServiceStatus.model_validate(body.get("status") or {})
        state = self.verified.get(key)
        events: list[tuple[str, str, str]] = []
        error: str | None = None
        fast = (
            not full
            and state is not None
            and state.fingerprint == fingerprint
            and not state.has_deferred
            and {k: c.version for k, c in children.items()} == state.versions
        )
        held_router = False
        # The child versions this reconcile checks against the spec: the cache snapshot it compares, then
        # what its own writes returned. Never re-read from the cache afterwards: a hand edit or delete
        # arriving while this reconcile awaits must not be recorded as verified (it would take the fast
        # path next time and stay until the resync).
        versions = {k: c.version for k, c in children.items()}
        if fast and state is not None:
            desired = state.desired
            workloads = {k: c.body() for k, c in children.items() if k[0] in WORKLOAD_KINDS}
            deferred: list[dict[str, Any]] = []
        else:
            self.num_full += 1
            try:
                desired = desire(body, self.features, replicas)
            except (ValidationError, SpecError) as exc:
                await self._invalid(key, body, previous, str(exc).replace("\n", " "))
                return
            observed = {k: c.body() for k, c in children.items()}
            observed = with_shared_claims(observed, desired.children, lambda kind, name: self._found(key, kind, name))
            todo = plan(desired.children, observed, uid)
            if todo.deferred:  # a mode or topology switch: make before break
                before, _ = observe(desired, {k: v for k, v in observed.items() if k[0] in WORKLOAD_KINDS}, pods)
                held_router = hold_router(todo, desired, observed, all(p.is_serving_current for p in before))
            applied, error = await apply_all(self.client, todo.apply)
            if error and refused_optional(todo.apply, applied):
                self.recheck_features.set()  # its CRD may be gone: discovery now, not at the next period
            for child, obj in applied.items():
                self.store.put(obj)
                item = compact(obj)
                if item.owner == key[1] and uid in item.owner_uids:  # not a claim filed under another service
                    versions[child] = item.version
            await asyncio.gather(*(self.client.delete(o) for o in todo.prune))
            for obj in todo.prune:
                self.store.delete({"kind": obj["kind"], "metadata": obj["metadata"]})
                versions.pop((obj["kind"], obj["metadata"]["name"]), None)
            events += todo.events
            if todo.prune:
                events.append(pruned_event(todo.prune))
            workloads = {k: applied.get(k) or observed[k] for k in {*applied, *observed} if k[0] in WORKLOAD_KINDS}
            deferred = todo.deferred
        pools, router = observe(desired, workloads, pods)
        members = [*pools, *([router] if router else [])]
        replaced = [observe_pool(layout, workloads, pods) for layout in old_pools(deferred, desired)]
        if deferred and not error and not held_router and all(m.is_serving_current for m in members):
            await asyncio.gather(*(self.client.delete(o) for o in deferred))
            for obj in deferred:
                self.store.delete({"kind": obj["kind"], "metadata": obj["metadata"]})
                versions.pop((obj["kind"], obj["metadata"]["name"]), None)
            events.append(pruned_event(deferred))
            deferred, replaced = [], []
        elif deferred:
            logger.info("[%s/%s] keeping %d old children until the new pools serve", *key, len(deferred))
        outcome = Outcome(apply_error=error, applied=error is None, scaling_limit=scaling_limit)
        if not all(m.is_complete for m in members):
            outcome.pod_problems = pod_problems(pods)
            outcome.downloading = downloads_in_progress(pods)
        status = build_status(
            previous, generation, pools, router, outcome, desired.url, desired.selector, desired.scaled_pool,
            now_rfc3339(), replaced,
        )  # fmt: skip
        if error:
            degraded = previous.condition("Degraded")
            if degraded is None or degraded.message != error:
                events.append(("Warning", "ApplyFailed", error))
            self.verified.pop(key, None)
        else:
            slim = Desired([], desired.pools, desired.router, desired.url, desired.selector, desired.scaled_pool)
            self.verified[key] = Verified(fingerprint, versions, slim, bool(deferred) or held_router)
        if not fast:
            jitter = self.options.resync_seconds * random.uniform(0.9, 1.1)
            self.resync_due[key] = time.monotonic() + jitter
        await self._write(key, body, previous, status)
        for type_, reason, message in events:
            await self.events.post(body, type_, reason, message)
        if error:
            raise ApiError(422, error, "ApplyFailed")  # retried with backoff; status already says why

    def _found(self, key: Key, kind: str, name: str) -> dict[str, Any] | None:
        found = self.store.find(kind, key[0], name)
        return None if found is None else found.body()

    async def _write(
        self, key: Key, body: dict[str, Any], previous: InferenceServiceStatus, status: InferenceServiceStatus
    ) -> None:
        patch = status_patch(previous, status)
        if patch is None:
            return
        updated = await write_status(self.client, body, patch)
        if updated is not None:
            self.store.put({**updated, "kind": SERVICE_KIND})
        ready = status.condition("Ready")
        if ready is not None:
            logger.info("[%s/%s] Ready=%s %s: %s", *key, ready.status, ready.reason, ready.message[:300])

    async def _invalid(self, key: Key, body: dict[str, Any], previous: InferenceServiceStatus, message: str) -> None:
        generation = int(body["metadata"].get("generation", 1))
        outcome = Outcome(spec_error=message)
        status = build_status(previous, generation, [], None, outcome, None, None, None, now_rfc3339())
        degraded = previous.condition("Degraded")
        self.verified.pop(key, None)
        await self._write(key, body, previous, status)
        if degraded is None or degraded.reason != "InvalidSpec" or degraded.message != message:
            logger.info("[%s/%s] invalid spec: %s", *key, message)
            await self.events.post(body, "Warning", "InvalidSpec", message[:1000])
