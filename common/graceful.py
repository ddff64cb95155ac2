"""Graceful shutdown for `tidepool serve` and `tidepool router`: SIGTERM drains, then the process exits 0.

uvicorn alone stops accepting at once on SIGTERM, gives in-flight requests its graceful-shutdown
time, and then raises the signal again once its handlers are restored, so the process dies of it
(exit status 143): a rolling update looks like a crash to whoever watches exit codes.

- `DrainingServer`: uvicorn's server, except that the first SIGTERM/SIGINT runs the app's `drain()`
  on the event loop and only then stops uvicorn; a second signal during the drain calls `hurry()`
  (the app ends its drain at once); one after the drain has finished stops uvicorn at once. Signals
  are never recorded for re-raising, so the process exits with the status its `main` returns.
- `Drain` and `DrainGate` (the router's; the engine server has its own gate, engine/server/gate.py):
  the ASGI middleware counts in a `Drain` the requests in flight outside the probe paths, from their
  start to their last byte (a stream counts until it ends), and once `Drain.start()` was called
  answers new ones 503 `draining` with `Retry-After` and `Connection: close` (a client's retry opens
  a new connection, which the Service sends to another replica). `Drain.wait_drained(timeout_s)`
  returns when none is left in flight, the grace period is over, or `Drain.hurry()` was called.

Invariants: a signal handler only schedules work on the loop (it runs between two bytecodes of the
loop's thread); the drain itself never blocks the loop; the probe paths stay open while draining,
so the kubelet and Prometheus see the state (readiness 503) rather than a refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from .api_key import OPEN_PATHS
from .asgi_reply import Receive, Send, error_body, refuse

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM/SIGINT drain before stopping and are not re-raised at exit."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]], hurry: Callable[[], None]) -> None:
        super().__init__(config)
        self._drain = drain
        self._hurry = hurry
        self.drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = asyncio.get_running_loop()
        if self.drain_task is None and not self.should_exit:
            logger.info("signal %d: draining before exit", sig)
            loop.call_soon_threadsafe(self._start_drain, loop)
        elif not self.should_exit:
            logger.warning("signal %d again: ending the drain now", sig)
            loop.call_soon_threadsafe(self._hurry)
        else:
            self.force_exit = True

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.drain_task is None:
            self.drain_task = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:  # a drain that failed must not keep the process up
            self.should_exit = True


class Drain:
    """What a drain needs to know: whether it started, how many requests are in flight (counted by `DrainGate`)."""

    def __init__(self, retry_after_s: int = 1) -> None:
        self.retry_after_s = retry_after_s  # sent with the 503 `draining`
        self.is_draining = False
        self.num_inflight = 0
        self._changed: asyncio.Event | None = None  # made on the serving loop, by the first request or the drain
        self._is_hurried = False

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def enter(self) -> None:
        self.num_inflight += 1

    def leave(self) -> None:
        self.num_inflight -= 1
        self._event().set()

    def start(self) -> None:
        """Refuse new requests from now on."""
        self.is_draining = True

    def hurry(self) -> None:
        """End `wait_drained` now (a second signal)."""
        self._is_hurried = True
        self._event().set()

    async def wait_drained(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight (True), or the grace period ends or `hurry()` is called (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        changed = self._event()
        while self.num_inflight > 0 and not self._is_hurried:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            changed.clear()  # no await since the check above: a request that ends from here on sets it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
        return self.num_inflight == 0


class DrainGate:
    """ASGI middleware counting in-flight requests outside `open_paths` in `drain`; refuses new ones once draining."""

    def __init__(self, app: Any, drain: Drain, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.drain = drain
        self.open_paths = open_paths

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        drain = self.drain
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if drain.is_draining:
            message = "the server is shutting down and takes no new request; retry it (another replica will take it)"
            headers = {"retry-after": str(drain.retry_after_s), "connection": "close"}
            await refuse(receive, send, 503, error_body(message, "service_unavailable", "draining"), headers)
            return
        drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            drain.leave()
