"""A work queue of InferenceService keys with controller-runtime's guarantees, on asyncio.

- A key is queued at most once: triggers that arrive while it waits coalesce (the reconcile reads the
  latest state from the caches, so the latest state wins).
- A key is never processed by two workers at once: one added while being processed is marked dirty
  and queued again when its worker calls `done()`.
- `add_after(key, delay)` schedules a later add (resync, autoscaler ticks); `add_rate_limited(key)`
  adds after a per-key exponential backoff (errors), reset by `forget(key)`.
- A `full` flag travels with a key (OR-ed when triggers coalesce): the next reconcile must compare
  every child with the spec instead of trusting what it verified last time (the resync safety net).

- Two lanes: keys `is_known(key)` says were reconciled before (their children exist; a trigger means a
  pod became ready or a child changed) go before keys never reconciled. A burst of 1,000 creates
  then does not hold back the status of services already created: each finishes (Ready) as soon as
  its pods serve, instead of after the whole burst (a single FIFO made Ready lag creation by the
  length of the queue). The known lane cannot starve the other for long: its triggers come from
  cluster events of services already created, a finite stream.

Invariants: FIFO within a lane; timers live in one heap served by one task (no task per key).
The clock, backoff bounds and `is_known` are parameters, so tests run without sleeping. client-go's
`workqueue_*` metrics (metrics.py) are kept under the queue's `name`: depth, adds (an add that
coalesces into a waiting key is not one), retries, time waiting and time being processed.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable

from tidepool.operator.metrics import CONTROLLER, QUEUE_ADDS, QUEUE_DEPTH, QUEUE_RETRIES, QUEUE_WAIT, QUEUE_WORK


class WorkQueue:
    def __init__(
        self,
        base_delay_s: float = 0.5,
        max_delay_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        is_known: Callable[[Hashable], bool] = lambda _key: False,
        name: str = CONTROLLER,
    ) -> None:
        self.base_delay_s, self.max_delay_s = base_delay_s, max_delay_s
        self._clock = clock
        self._is_known = is_known
        self._lanes: tuple[deque[Hashable], deque[Hashable]] = (deque(), deque())  # known first, then new
        self._ready = asyncio.Event()
        self._queued: dict[Hashable, bool] = {}  # key -> full, for keys waiting in _queue
        self._processing: set[Hashable] = set()
        self._dirty: dict[Hashable, bool] = {}  # added while processing -> re-queued on done()
        self._failures: dict[Hashable, int] = {}
        self._timers: list[tuple[float, int, Hashable, bool]] = []
        self._seq = itertools.count()
        self._timer_wakeup = asyncio.Event()
        self.num_coalesced = 0
        self._added_at: dict[Hashable, float] = {}  # queued (or marked dirty) at
        self._started_at: dict[Hashable, float] = {}  # taken by a worker at
        self._adds, self._retries = QUEUE_ADDS.labels(name), QUEUE_RETRIES.labels(name)
        self._wait, self._work = QUEUE_WAIT.labels(name), QUEUE_WORK.labels(name)
        QUEUE_DEPTH.labels(name).set_function(self.__len__)

    def __len__(self) -> int:
        return len(self._lanes[0]) + len(self._lanes[1])

    @property
    def num_processing(self) -> int:
        return len(self._processing)

    @property
    def num_delayed(self) -> int:
        return len(self._timers)

    def add(self, key: Hashable, full: bool = False) -> None:
        if key in self._processing:
            if key not in self._dirty:
                self._adds.inc()
                self._added_at[key] = self._clock()
            self._dirty[key] = self._dirty.get(key, False) or full
            return
        if key in self._queued:
            self.num_coalesced += 1
            self._queued[key] = self._queued[key] or full
            return
        self._adds.inc()
        self._added_at[key] = self._clock()
        self._enqueue(key, full)

    def _enqueue(self, key: Hashable, full: bool) -> None:
        self._queued[key] = full
        self._lanes[0 if self._is_known(key) else 1].append(key)
        self._ready.set()

    def add_after(self, key: Hashable, delay_s: float, full: bool = False) -> None:
        if delay_s <= 0:
            self.add(key, full)
            return
        heapq.heappush(self._timers, (self._clock() + delay_s, next(self._seq), key, full))
        self._timer_wakeup.set()

    def add_rate_limited(self, key: Hashable) -> float:
        """Add after this key's backoff (base * 2^failures, capped); returns the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        self._retries.inc()
        delay = min(self.base_delay_s * 2**failures, self.max_delay_s)
        self.add_after(key, delay)
        return delay

    def forget(self, key: Hashable) -> None:
        self._failures.pop(key, None)

    def num_failures(self, key: Hashable) -> int:
        return self._failures.get(key, 0)

    async def get(self) -> tuple[Hashable, bool]:
        """The next ready key and its `full` flag; the caller must call `done(key)` afterwards."""
        while not len(self):
            self._ready.clear()
            await self._ready.wait()
        key = (self._lanes[0] or self._lanes[1]).popleft()
        full = self._queued.pop(key)
        self._processing.add(key)
        now = self._clock()
        self._wait.observe(max(now - self._added_at.pop(key, now), 0.0))
        self._started_at[key] = now
        return key, full

    def done(self, key: Hashable) -> None:
        self._processing.discard(key)
        started = self._started_at.pop(key, None)
        if started is not None:
            self._work.observe(max(self._clock() - started, 0.0))
        if key in self._dirty:  # added while it was processed: queued now, counted and timed when it was added
            self._enqueue(key, self._dirty.pop(key))

    def fire_due(self) -> float | None:
        """Add every timer that is due; returns seconds until the next one (None: no timers)."""
        now = self._clock()
        while self._timers and self._timers[0][0] <= now:
            _, _, key, full = heapq.heappop(self._timers)
            self.add(key, full)
        return self._timers[0][0] - now if self._timers else None

    async def run_timers(self) -> None:
        """Serve `add_after` timers until cancelled (one task for the whole queue)."""
        while True:
            wait = self.fire_due()
            self._timer_wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._timer_wakeup.wait(), timeout=wait)
