"""The engine loop beside the event loop: one dedicated thread owns the `LLMEngine`.

Role: the HTTP handlers (event-loop thread) submit work and aborts through a thread-safe
queue; the engine thread drains it, runs `step()`, records metrics and hands each step's
outputs back to the event loop in one `call_soon_threadsafe` call, where they are routed to
per-HTTP-request asyncio queues (`RequestStream`). Nothing here blocks the event loop.

Invariants:
- Only the engine thread touches the `LLMEngine` (it is not thread-safe); only the event-loop
  thread touches the stream table. The HTTP side reads the engine's facts from `info`, a frozen
  `EngineInfo` built before the thread starts.
- Commands (commands.py: `AddRequests`, `AbortRequests`, `StopEngine`, `RegisterAdapter`,
  `UnregisterAdapter`, `CallEngine`) are applied in the order they were submitted, so an abort never overtakes
  the add it cancels, and an add put after an unregister is refused (404). The registry's commands
  are answered through their future; the file I/O of an adapter load happens before, off this
  thread (server/lora_admin.py), so no step ever waits for a disk.
- Admission is bounded: requests queued (submitted but not yet handed to the engine, plus the
  engine's waiting queue) never exceed `max_queue_len`; over the bound `add` raises
  `QueueFullError` before anything is queued. The count errs high, never low.
- One request cannot end the engine: a request the engine refuses fails alone
  (`RequestRejectedError`, or the `LoRAError` of an adapter unloaded meanwhile), and
  per-request failures inside a step come back as that request's error output. Anything else that
  escapes the engine is fatal: every stream gets
  `EngineDeadError`, `on_dead` is called (the server then exits non-zero) and liveness turns false.
- `abort_all(error)` (shutdown) aborts every engine request and makes every later `add` and
  every `guard`ed wait raise that error, so no request outlives a shutdown unanswered; sleep mode
  (server/sleep.py) aborts with `final=False` and sets `paused_error`, which `add` raises until it wakes.
- On `stop()` every unfinished request is aborted, so the KV block pool ends fully free, and
  the engine's background resources are closed on its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar, assert_never

from ..llm_engine import LLMEngine
from ..lora.types import LoRAError
from ..outputs import RequestOutput
from ..stats import EngineStats
from . import commands as cmd
from .commands import AbortRequests, AddRequests, Child, EngineCommand, RegisterAdapter, StopEngine, UnregisterAdapter
from .engine_info import EngineInfo
from .metrics import EngineMetrics

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps on its inbox before re-checking for stop
T = TypeVar("T")


class QueueFullError(Exception):
    """The bounded waiting queue is full; the client should retry after `retry_after_s`."""

    def __init__(self, num_queued: int, max_queue_len: int, retry_after_s: int) -> None:
        super().__init__(
            f"the server's request queue is full ({num_queued} waiting, limit {max_queue_len}); retry later"
        )
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine thread failed; the process exits so that it is restarted."""


class RequestRejectedError(ValueError):
    """The engine refused a request that passed the server's checks (a race or a gap in them): a 400."""


class ShutdownError(RuntimeError):
    """The server is shutting down and ended this request; `code` says why ("shutdown", "drain_timeout")."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class RequestStream:
    """The outputs of one HTTP request's engine requests, in arrival order, until all finish."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.unfinished_ids = set(request_ids)
        self.shutdown_error: ShutdownError | None = None  # set when a shutdown aborted these requests
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
        self._engine = engine  # the engine thread's; the HTTP side uses `info`
        self.info = EngineInfo.from_engine(engine)
        self.grammars = engine.grammars  # thread-safe: the server compiles constraints in its threads
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        self.retry_after_s = retry_after_s
        self.stats: EngineStats = engine.get_stats()  # replaced (never mutated) by the engine thread
        self.error: BaseException | None = None
        self.shutdown_error: ShutdownError | None = None
        self.paused_error: ShutdownError | None = None  # set while asleep (server/sleep.py): `add` raises it
        self.on_dead: Callable[[], None] | None = None  # called on the event loop once the engine thread died
        self._inbox: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._num_pending = 0  # submitted, not yet counted in `stats.num_waiting`
        self._live: set[str] = set()  # engine thread only: ids added to the engine and not finished
        self._lock = threading.Lock()
        self._closed = False  # set by the engine thread as it ends: commands with a reply are failed from then on
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._shutdown = asyncio.Event()

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
        if self.shutdown_error is not None or self.paused_error is not None:
            raise self.shutdown_error or self.paused_error  # type: ignore[misc]
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
        self._inbox.put(AddRequests(children, arrival_time))
        return stream

    def abort(self, request_ids: list[str] | set[str]) -> None:
        if request_ids:
            self._inbox.put(AbortRequests(list(request_ids)))

    def abort_all(self, error: ShutdownError, final: bool = True) -> None:
        """Shutdown: abort every engine request, telling its stream why, and (`final`) refuse and interrupt the rest."""
        if final:
            self.shutdown_error = error
            self._shutdown.set()
        for stream in set(self._streams.values()):
            stream.shutdown_error = error
        self._inbox.put(AbortRequests(list(self._streams)))

    async def ask(self, command: RegisterAdapter | UnregisterAdapter | cmd.CallEngine) -> Any:
        """Apply an adapter-registry command on the engine thread: its answer, or its `LoRAError` raised."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        self._inbox.put(command)
        if self._closed:  # the engine thread ended after the check: it will never read the command
            _answer(command.reply, error=EngineDeadError("the engine is not running"))
        return await self.guard(asyncio.wrap_future(command.reply))

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` unless a shutdown comes first; then it is cancelled and the ShutdownError raised."""
        task = asyncio.ensure_future(awaitable)
        if self.shutdown_error is None:
            stopper = asyncio.ensure_future(self._shutdown.wait())
            try:
                await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopper.cancel()
        if not task.done():
            task.cancel()
            raise self.shutdown_error or ShutdownError("the server is shutting down", "shutdown")
        return task.result()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, stop the thread (which closes the engine) and log the block pool's state."""
        if self._thread is None:
            return
        self._inbox.put(StopEngine())
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
        if self.on_dead is not None:
            self.on_dead()

    # ---- engine-thread side ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as err:  # the engine is in an unknown state: fail loudly, the process exits
            logger.exception("engine thread failed; the server exits so that it is restarted")
            self.error = err
            self._post(None, EngineDeadError(f"engine failed: {err!r}"))
        finally:
            self._closed = True
            self._fail_replies()
            try:
                self._engine.close()  # the KV connector's sockets (P/D), parallel workers
            except Exception:
                logger.exception("closing the engine failed")

    def _fail_replies(self, taken: list[EngineCommand] | None = None) -> None:
        """Answer every registry command not applied (`taken` from the inbox, or still in it): the engine thread
        ends without applying them (an answer already given stays)."""
        commands = list(taken or [])
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if isinstance(command, RegisterAdapter | UnregisterAdapter | cmd.CallEngine):
                _answer(command.reply, error=EngineDeadError("the engine stopped before applying the command"))

    def _loop_forever(self) -> None:
        engine = self._engine
        while True:
            commands = self._take_commands(block=not engine.has_unfinished_requests())
            results: list[tuple[str, RequestOutput | BaseException]] = []
            outputs: list[RequestOutput] = []
            num_added = 0
            for command in commands:
                match command:
                    case StopEngine():
                        self._shutdown_engine()
                        self._fail_replies(commands)
                        return
                    case AddRequests(children, arrival_time):
                        num_added += len(children)
                        self._add(children, arrival_time, results, outputs)
                    case AbortRequests(request_ids):
                        outputs.extend(engine.abort_request(request_ids))
                    case RegisterAdapter() | UnregisterAdapter() | cmd.CallEngine():
                        self._apply_registry(command)
                    case _:
                        assert_never(command)
            stepped = engine.has_unfinished_requests()
            if stepped:
                outputs.extend(engine.step())
            stats = engine.get_stats()
            with self._lock:
                self.stats = stats
                self._num_pending -= num_added
            if self.metrics is not None:
                self.metrics.record_stats(stats, self._num_pending)
                if self.metrics.lora is not None and engine.lora is not None:
                    self.metrics.lora.record(engine.lora.snapshot())
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
                self._engine.add_request(
                    child.request_id,
                    child.prompt_token_ids,
                    child.params,
                    arrival_time,
                    kv_transfer=child.kv_transfer,
                    grammar=child.grammar,
                    lora_name=child.lora_name,
                )
                added.append(child.request_id)
                self._live.add(child.request_id)
            except Exception as err:  # the server checks first, so this is a race or a gap: fail this request only
                logger.warning("the engine refused request %s: %r", child.request_id, err)
                outputs.extend(self._engine.abort_request(added))
                self._live.difference_update(added)
                # An adapter unloaded since the server checked `model` keeps its own 404.
                rejected = isinstance(err, ValueError) and not isinstance(err, LoRAError)
                error = RequestRejectedError(str(err)) if rejected else err
                results.extend((c.request_id, error) for c in children)
                return
        if self.metrics is not None and self.metrics.lora is not None:
            self.metrics.lora.count_requests(children)

    def _apply_registry(self, command: RegisterAdapter | UnregisterAdapter | cmd.CallEngine) -> None:
        """A registry command or a `CallEngine`, answered through its future; a refusal is the caller's answer alone."""
        registry = self._engine.lora  # never None here: the server sends these only with --enable-lora
        try:
            if isinstance(command, cmd.CallEngine):
                result: Any = command.fn(self._engine)
            elif isinstance(command, RegisterAdapter):
                result = registry.register(command.adapter)  # type: ignore[union-attr]
            else:
                result = registry.unregister(command.name)  # type: ignore[union-attr]
        except Exception as err:  # the registry refused (LoRAError) or failed on this adapter alone
            if not isinstance(err, LoRAError) and not isinstance(command, cmd.CallEngine):  # its caller reports it
                logger.exception("the adapter registry failed on a %s", type(command).__name__)
            _answer(command.reply, error=err)
            return
        _answer(command.reply, result)

    def _take_commands(self, block: bool) -> list[EngineCommand]:
        commands: list[EngineCommand] = []
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

    def _shutdown_engine(self) -> None:
        engine = self._engine
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


def _answer(reply: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Set a command's one answer (a second one, from a race with the thread's end, is dropped)."""
    try:
        if error is not None:
            reply.set_exception(error)
        else:
            reply.set_result(result)
    except InvalidStateError:
        pass
