"""One InferenceService key's reconcile, from the caches: what a worker runs for a key it took.

`sync(key)`:
1. read the InferenceService from the cache (gone: forget it; being deleted: nothing to do, the
   garbage collector removes the children through their owner references; a finalizer left by
   an older operator is removed so deletes never wait for us);
2. the autoscaler's tick when it is due (autoscaler/handlers.py; it writes `status.autoscaling`); with
   the autoscaler off or external, a `status.autoscaling` an earlier mode left is removed once;
3. reconcile. Fast path: when the generation, the autoscaler's replicas and the cluster features are
   those last verified and every child's version (generation for workloads, resourceVersion
   otherwise) is one already verified to match the spec, nothing is built or compared: only status
   is recomputed from cached workloads and pods. Otherwise (a `full` key: the jittered resync, the
   safety net for anything a watch could miss) the builders run (reconcile.py) and every child is
   compared and applied where it differs;
4. write status if it changed, with the resourceVersion it was computed from. A transition (a
   condition's status or reason, observedGeneration, URL, selector, the set of pools) is written at
   once; a routine change (counts, messages: `is_routine`) at most once per `status_interval_seconds`
   per key, by a wake-up timer that syncs the key again, so the latest state is what gets written.

Invariants: a child version is recorded as verified only from the cache snapshot this reconcile
compared or from what its own writes returned; one pending wake-up timer per key (autoscaler ticks,
paced status); an error raises (the worker re-queues the key with backoff) after status says why.
Events are posted for real transitions only (Created, Scaled, RollingOut, DriftCorrected, Pruned, InvalidSpec,
ApplyFailed), and ClaimKept when a claim starts keeping what the spec cannot change.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tidepool.operator.api import InferenceServiceStatus, now_rfc3339
from tidepool.operator.autoscaler.handlers import Autoscaler, applied_replicas, is_autoscaled
from tidepool.operator.builders import ClusterFeatures, SpecError
from tidepool.operator.cache import SERVICE_KIND, Store, compact
from tidepool.operator.claims import with_shared_claims
from tidepool.operator.events import EventRecorder
from tidepool.operator.features import refused_optional
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.metrics import STATUS_DEFERRED, STATUS_WRITES
from tidepool.operator.reconcile import (
    LEGACY_FINALIZER,
    WORKLOAD_KINDS,
    Desired,
    apply_all,
    desire,
    drop_legacy_finalizer,
    hold_router,
    is_routine,
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
    status_interval_seconds: float = 1.0  # routine status writes (counts, messages) of one key at most this often


@dataclass(slots=True)
class Verified:
    """What the last full reconcile of a key established (the fast path's evidence)."""

    fingerprint: tuple[Any, ...]
    versions: dict[tuple[str, str], str]  # child -> version that matched the spec
    desired: Desired  # children dropped; pool layouts, URL and selector kept
    has_deferred: bool  # make-before-break prunes still waiting


class ServiceSync:
    """The per-key state and reconcile; the Controller (controller.py) runs it from its workers."""

    def __init__(
        self,
        client: KubeClient,
        options: ControllerOptions,
        store: Store,
        queue: WorkQueue,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.options, self.store, self.queue = client, options, store, queue
        self._clock = clock
        self.events = EventRecorder(client)
        self.features = options.features
        self.autoscaler: Autoscaler | None = None
        self.verified: dict[Key, Verified] = {}
        self.resync_due: dict[Key, float] = {}
        self.wakes: dict[Key, float] = {}  # the pending wake-up of each key (autoscaler tick, paced status)
        self.status_written: dict[Key, float] = {}  # when each key's status was last written
        self.claims_kept: dict[Key, set[str]] = {}  # the ClaimKept messages a key's last full reconcile told
        self.recheck_features = asyncio.Event()  # set when an optional kind's apply failed
        self.num_syncs = 0
        self.num_full = 0

    def _wake(self, key: Key, delay_s: float) -> None:
        """Sync `key` again in `delay_s`: one timer per key (syncs triggered by events must not add more).

        A pending timer due no later than this one covers it: the sync it runs asks again for
        whatever is still ahead (the next tick, a status write still paced)."""
        now = self._clock()
        pending = self.wakes.get(key)
        if pending is not None and now <= pending <= now + delay_s + 0.5:
            return
        self.wakes[key] = now + delay_s
        self.queue.add_after(key, delay_s + 0.01)

    def forget(self, key: Key) -> None:
        self.verified.pop(key, None)
        self.resync_due.pop(key, None)
        self.wakes.pop(key, None)
        self.status_written.pop(key, None)
        self.claims_kept.pop(key, None)
        if self.autoscaler is not None:
            self.autoscaler.forget(key)

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
                self._wake(key, self.autoscaler.seconds_until_due(key))
            else:  # off or external: forget it, and clear the status.autoscaling an earlier mode left
                cleared = await self.autoscaler.clear(key, body)
                if cleared is not body:
                    body = dict(cleared)
                    self.store.put({**body, "kind": SERVICE_KIND})
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
            events += self._untold(key, todo.events)
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

    def _untold(self, key: Key, events: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
        """A full reconcile's events, less the ClaimKept warnings its previous one already told (a claim keeps
        what the spec cannot change for as long as both stay as they are: say so once, and again only after
        it stopped)."""
        kept = {message for _, reason, message in events if reason == "ClaimKept"}
        told = self.claims_kept.pop(key, set())
        if kept:
            self.claims_kept[key] = kept
        return [e for e in events if e[1] != "ClaimKept" or e[2] not in told]

    def _found(self, key: Key, kind: str, name: str) -> dict[str, Any] | None:
        found = self.store.find(kind, key[0], name)
        return None if found is None else found.body()

    async def _write(
        self, key: Key, body: dict[str, Any], previous: InferenceServiceStatus, status: InferenceServiceStatus
    ) -> None:
        patch = status_patch(previous, status)
        if patch is None:
            return
        routine = is_routine(previous, status)
        if routine:
            # Counts and messages only: at most one write per interval, the latest state when it comes (a
            # pool of thousands of pods would otherwise cost a status write per pod event).
            last = self.status_written.get(key)
            wait = 0.0 if last is None else last + self.options.status_interval_seconds - self._clock()
            if wait > 0:
                STATUS_DEFERRED.inc()
                self._wake(key, wait)
                return
        updated = await write_status(self.client, body, patch)
        self.status_written[key] = self._clock()
        if updated is not None:
            STATUS_WRITES.labels("routine" if routine else "transition").inc()
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
