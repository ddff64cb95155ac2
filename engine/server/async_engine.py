"""The engine loop beside the event loop: one dedicated thread owns the `LLMEngine`.

Role: the HTTP handlers (event-loop thread) submit work and aborts through a thread-safe
queue; the engine thread drains it, runs `step()`, records metrics and hands each step's
outputs back to the event loop in one `call_soon_threadsafe` call, where they are routed to
per-HTTP-request asyncio queues (`RequestStream`). Nothing here blocks the event loop.

Invariants:
- Only the engine thread touches the `LLMEngine` (it is not thread-safe); only the event-loop
  thread touches the stream table.
- Commands are applied in the order they were submitted, so an abort never overtakes the add
  it cancels.
- Admission is bounded: requests queued (submitted but not yet handed to the engine, plus the
  engine's waiting queue) never exceed `max_queue_len`; over the bound `add` raises
  `QueueFullError` before anything is queued. The count errs high, never low.
- On `stop()` every unfinished request is aborted, so the KV block pool ends fully free.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..kv_transfer import KVPayload, ProducerParams
from ..llm_engine import LLMEngine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..stats import EngineStats
from .metrics import EngineMetrics

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps on its inbox before re-checking for stop


class QueueFullError(Exception):
    """The bounded waiting queue is full; the client should retry after `retry_after_s`."""

    def __init__(self, num_queued: int, max_queue_len: int, retry_after_s: int) -> None:
        super().__init__(
            f"the server's request queue is full ({num_queued} waiting, limit {max_queue_len}); retry later"
        )
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine thread failed; the process should be restarted (liveness turns false)."""


@dataclass(slots=True)
class Child:
    """One engine request of an HTTP request (n > 1 and prompt lists fan out into several)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer: ProducerParams | KVPayload | None = None  # P/D disaggregation (see server/disagg.py)


class RequestStream:
    """The outputs of one HTTP request's engine requests, in arrival order, until all finish."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.unfinished_ids = set(request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self.unfinished_ids

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished_ids:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.unfinished_ids.clear()
                raise item
            if item.finished:
                self.unfinished_ids.discard(item.request_id)
            yield item


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        max_queue_len: int = 1024,
        retry_after_s: int = 1,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        self.retry_after_s = retry_after_s
        self.stats: EngineStats = engine.get_stats()  # replaced (never mutated) by the engine thread
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._num_pending = 0  # submitted, not yet counted in `stats.num_waiting`
        self._live: set[str] = set()  # engine thread only: ids added to the engine and not finished
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="tidepool-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_queued(self) -> int:
        with self._lock:
            return self._num_pending + self.stats.num_waiting

    @property
    def num_unfinished(self) -> int:
        """Engine requests submitted and not yet finished, as the event loop sees them."""
        return len(self._streams)

    def add(self, children: list[Child], arrival_time: float) -> RequestStream:
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        with self._lock:
            num_queued = self._num_pending + self.stats.num_waiting
            if num_queued + len(children) > self.max_queue_len:
                raise QueueFullError(num_queued, self.max_queue_len, self.retry_after_s)
            self._num_pending += len(children)
        stream = RequestStream([c.request_id for c in children])
        for child in children:
            self._streams[child.request_id] = stream
        self._inbox.put(("add", children, arrival_time))
        return stream

    def abort(self, request_ids: list[str] | set[str]) -> None:
        if request_ids:
            self._inbox.put(("abort", list(request_ids)))

    def abort_all(self) -> None:
        self._inbox.put(("abort", list(self._streams)))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, stop the thread and log the block pool's final state."""
        if self._thread is None:
            return
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    def _dispatch(self, results: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in results:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            stream.put(item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]

    def _fail_all(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream.put(error)
        self._streams.clear()

    # ---- engine-thread side ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as err:  # the engine is in an unknown state: fail loudly, liveness goes false
            logger.exception("engine thread failed")
            self.error = err
            self._post(None, EngineDeadError(f"engine failed: {err!r}"))

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            commands = self._take_commands(block=not engine.has_unfinished_requests())
            results: list[tuple[str, RequestOutput | BaseException]] = []
            outputs: list[RequestOutput] = []
            num_added = 0
            for command in commands:
                if command[0] == "stop":
                    self._shutdown()
                    return
                if command[0] == "add":
                    num_added += len(command[1])
                    self._add(command[1], command[2], results, outputs)
                else:
                    outputs.extend(engine.abort_request(command[1]))
            stepped = engine.has_unfinished_requests()
            if stepped:
                outputs.extend(engine.step())
            stats = engine.get_stats()
            with self._lock:
                self.stats = stats
                self._num_pending -= num_added
            if self.metrics is not None:
                self.metrics.record_stats(stats, self._num_pending)
                if stepped:
                    self.metrics.record_step(engine.last_stats)
                self.metrics.record_outputs(outputs)
            for output in outputs:
                if output.finished:
                    self._live.discard(output.request_id)
                results.append((output.request_id, output))
            if results:
                self._post(results)

    def _add(
        self,
        children: list[Child],
        arrival_time: float,
        results: list[tuple[str, RequestOutput | BaseException]],
        outputs: list[RequestOutput],
    ) -> None:
        added: list[str] = []
        for child in children:
            try:
                self.engine.add_request(
                    child.request_id, child.prompt_token_ids, child.params, arrival_time, kv_transfer=child.kv_transfer
                )
                added.append(child.request_id)
                self._live.add(child.request_id)
            except ValueError as err:  # the server validates first, so this is a race or a bug: fail the whole request
                outputs.extend(self.engine.abort_request(added))
                self._live.difference_update(added)
                results.extend((c.request_id, err) for c in children)
                return

    def _take_commands(self, block: bool) -> list[tuple]:
        commands = []
        if block:
            try:
                commands.append(self._inbox.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _shutdown(self) -> None:
        engine = self.engine
        outputs = engine.abort_request(list(self._live))
        self._live.clear()
        if self.metrics is not None:
            self.metrics.record_stats(engine.get_stats())
            self.metrics.record_outputs(outputs)
        kv = engine.kv_cache
        logger.info("engine stopped: %d/%d KV blocks free", kv.num_free_blocks, kv.pool.num_blocks)
        self._post([(o.request_id, o) for o in outputs])

    def _post(
        self,
        results: list[tuple[str, RequestOutput | BaseException]] | None,
        error: BaseException | None = None,
    ) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            if error is not None:
                loop.call_soon_threadsafe(self._fail_all, error)
            elif results:
                loop.call_soon_threadsafe(self._dispatch, results)
        except RuntimeError:  # the loop closed between the check and the call (process exit)
            pass
