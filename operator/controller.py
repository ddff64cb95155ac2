"""The InferenceService controller's runtime: caches fed by watches, a work queue, workers.

Informers (cache.py) keep every InferenceService and every labelled child and pod in memory and
call `_on_change(namespace, service, full)` on each change, which queues the service's key. Workers take
keys from the queue (one worker per key at a time; triggers coalesce) and run `sync(key)` of the
`ServiceSync` the controller holds (sync.py: the per-key reconcile and the per-key state; composed,
not inherited). Around them: the resync loop (every key gets a full reconcile every `resync_seconds`,
jittered: the safety net for anything a watch could miss), the feature loop
(optional CRDs appearing or going: informers started or stopped, every key reconciled in full),
and one stats line a minute.

Errors re-queue the key with per-key exponential backoff. Waiting for pods needs no retry: pod
and workload events re-queue the key. Steady state costs the API server only the watches' periodic
reconnects. A background task that dies is reported by `failed_task()` (the liveness probe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import aiohttp

from tidepool.operator.autoscaler.handlers import Autoscaler
from tidepool.operator.cache import CHILD_SELECTOR, SERVICE_KIND, Informer, Key, Store
from tidepool.operator.events import EventRecorder
from tidepool.operator.features import detect_features, watched_kinds
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.metrics import (
    ACTIVE_WORKERS,
    CACHED,
    CONTROLLER,
    MAX_WORKERS,
    RECONCILE_ERRORS,
    RECONCILE_TIME,
    RECONCILE_TOTAL,
    SERVICE_CONDITIONS,
)
from tidepool.operator.sync import ControllerOptions, ServiceSync
from tidepool.operator.workqueue import WorkQueue

__all__ = ["Controller", "ControllerOptions"]
logger = logging.getLogger("tidepool.operator")


class Controller:
    """Informers, the work queue and the workers around one `ServiceSync` (`services`)."""

    def __init__(
        self,
        client: KubeClient,
        options: ControllerOptions,
        namespaces: list[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.options, self._clock = client, options, clock
        self.store = Store(self._on_change)
        # Keys reconciled before go first: their triggers finish work in progress (see workqueue.py).
        self.queue = WorkQueue(clock=clock, is_known=lambda key: self.services.is_known(key))
        self.events = EventRecorder(client)
        self.services = ServiceSync(client, options, self.store, self.queue, self.events, clock)
        self.namespaces: list[str | None] = list(namespaces) if namespaces else [None]
        self.informers: dict[tuple[str, str | None], Informer] = {}
        self._tasks: list[asyncio.Task] = []
        self.is_synced = False
        ACTIVE_WORKERS.labels(CONTROLLER).set_function(lambda: self.queue.num_processing)
        MAX_WORKERS.labels(CONTROLLER).set(options.workers)
        for kind in ("services", "children", "pods"):
            CACHED.labels(kind).set_function(lambda kind=kind: self.store.count()[kind])
        SERVICE_CONDITIONS.read = self._service_conditions

    def _service_conditions(self) -> Iterator[tuple[str, str, list[dict]]]:
        for (namespace, name), cached in list(self.store.services.items()):
            yield namespace, name, (cached.body().get("status") or {}).get("conditions") or []

    # ---- wiring ------------------------------------------------------------------------------
    def _on_change(self, namespace: str, name: str, full: bool) -> None:
        self.queue.add((namespace, name), full)

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
        self.services.autoscaler = autoscaler
        self.services.features = await detect_features(self.client, self.options.features)
        t0 = time.monotonic()
        informers = [i for kind in watched_kinds(self.services.features) for i in self._start_informer(kind)]
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
                await asyncio.wait_for(self.services.recheck_features.wait(), self.options.feature_recheck_seconds)
            self.services.recheck_features.clear()
            try:
                features = await detect_features(self.client, self.options.features)
            except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
                logger.warning("feature discovery failed: %r", exc)
                continue
            old = self.services.features
            if features == old:
                continue
            logger.info("cluster features changed: %s -> %s", old, features)
            await self._stop_informers(set(watched_kinds(old)) - set(watched_kinds(features)))
            started = [i for kind in watched_kinds(features) for i in self._start_informer(kind)]
            await asyncio.gather(*(i.synced.wait() for i in started))
            self.services.features = features
            for key in self.store.service_keys():
                self.queue.add(key, full=True)

    async def _resync_loop(self) -> None:
        """The safety net: every key gets a full reconcile every resync_seconds (+-10%, spread out)."""
        while True:
            await asyncio.sleep(5.0)
            for key in self.services.due_for_resync(time.monotonic()):
                self.queue.add(key, full=True)

    async def _stats_loop(self, every_s: float = 60.0) -> None:
        """One INFO line a minute while there is work: what the controller did and what it cost."""
        client = self.client
        last = (0, 0, 0)
        while True:
            await asyncio.sleep(every_s)
            now = (self.services.num_syncs, self.services.num_full, client.num_requests)
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
                await self._process(key, full)
            finally:
                self.queue.done(key)

    async def _process(self, key: Key, full: bool) -> None:
        """One reconcile of `key`, counted and timed; on an error the key comes back after its backoff."""
        started, result = self._clock(), "error"
        try:
            await self.services.sync(key, full)
            self.queue.forget(key)
            result = "success"
        except asyncio.CancelledError:
            result = ""  # the operator is stopping: not a reconcile that ended
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
            if result:
                RECONCILE_TOTAL.labels(CONTROLLER, result).inc()
                RECONCILE_TIME.labels(CONTROLLER).observe(self._clock() - started)
            if result == "error":
                RECONCILE_ERRORS.labels(CONTROLLER).inc()
