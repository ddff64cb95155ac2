"""TCP connector: a prefill engine's sender and a decode engine's receiver (see `protocol`).

Sender: `send()` hands the payload to a small thread pool and returns at once, so the engine
thread goes on computing while the bytes travel; `wait_sent(transfer_id)` (called by the HTTP
handler, off the engine thread) blocks until the decode side acknowledged or refused it.

Receiver: a listening socket with one thread per incoming connection. A complete, valid
payload is parked under its transfer id until the decode request that claims it arrives
(`take`), or until it expires (`ttl_s`) — so a router that gave up never leaks memory.
Invariants: a payload is stored only once fully received and checked against the engine's
cache geometry; a connection that breaks mid-transfer stores nothing; every connection gets
a status answer when the socket still allows one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .protocol import (
    STATUS_OK,
    STATUS_REJECTED,
    KVGeometry,
    KVPayload,
    KVTransferError,
    read_payload,
    read_status,
    write_payload,
    write_status,
)

logger = logging.getLogger(__name__)


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 < int(port) < 65536:
        raise ValueError(f"KV address {addr!r} must be host:port (e.g. 10.0.0.7:14579)")
    return host.strip("[]"), int(port)


class KVSender:
    def __init__(self, timeout_s: float = 30.0, max_workers: int = 4) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-send")
        self._futures: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self.num_sent = 0
        self.num_failed = 0
        self.bytes_sent = 0

    def send(self, addr: str, payload: KVPayload) -> Future[None]:
        future = self._pool.submit(self._send, addr, payload)
        with self._lock:
            self._futures[payload.transfer_id] = future
        return future

    async def wait_sent_async(self, transfer_id: str) -> None:
        """`wait_sent` for an event loop: awaits the acknowledgement without holding a thread."""
        future = self._take_future(transfer_id)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError as err:
            raise KVTransferError(f"KV transfer {transfer_id} was not acknowledged in time") from err

    def wait_sent(self, transfer_id: str, timeout_s: float | None = None) -> None:
        """Block until the transfer was acknowledged; raises KVTransferError with the reason otherwise."""
        future = self._take_future(transfer_id)
        try:
            future.result(timeout=timeout_s if timeout_s is not None else self.timeout_s)
        except TimeoutError as err:
            raise KVTransferError(f"KV transfer {transfer_id} was not acknowledged in time") from err

    def _take_future(self, transfer_id: str) -> Future[None]:
        """The send's future, forgotten here: whoever waits on it is its only reader."""
        with self._lock:
            future = self._futures.pop(transfer_id, None)
        if future is None:
            raise KVTransferError(f"no KV transfer {transfer_id} was started (the prefill produced no token?)")
        return future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _send(self, addr: str, payload: KVPayload) -> None:
        host, port = parse_addr(addr)
        start = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=self.timeout_s) as sock:
                write_payload(sock, payload)
                status, message = read_status(sock)
        except (OSError, KVTransferError) as err:
            self.num_failed += 1
            raise KVTransferError(f"sending KV transfer {payload.transfer_id} to {addr} failed: {err}") from err
        if status != STATUS_OK:
            self.num_failed += 1
            raise KVTransferError(f"decode engine at {addr} refused KV transfer {payload.transfer_id}: {message}")
        nbytes = payload.kv.numel() * payload.kv.element_size()
        self.num_sent += 1
        self.bytes_sent += nbytes
        logger.debug("sent KV transfer %s (%d bytes) to %s in %.3fs", payload.transfer_id, nbytes, addr,
                     time.monotonic() - start)  # fmt: skip


class KVReceiver:
    def __init__(self, geometry: KVGeometry, host: str = "0.0.0.0", port: int = 14579, ttl_s: float = 60.0) -> None:
        self.geometry = geometry
        self.ttl_s = ttl_s
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.settimeout(0.5)
        self.port = self._server.getsockname()[1]
        self._ready: dict[str, tuple[float, KVPayload]] = {}
        self._cond = threading.Condition()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[KVPayload]]] = {}
        self._closed = False
        self.num_received = 0
        self.num_rejected = 0
        self.num_expired = 0
        self._thread = threading.Thread(target=self._accept_loop, name="kv-recv", daemon=True)
        self._thread.start()
        logger.info("KV receiver listening on %s:%d", host, self.port)

    @property
    def num_parked(self) -> int:
        with self._cond:
            return len(self._ready)

    def take(self, transfer_id: str, timeout_s: float) -> KVPayload:
        """The payload for `transfer_id`, waiting up to `timeout_s` for it; raises KVTransferError on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._expire_locked()
                entry = self._ready.pop(transfer_id, None)
                if entry is not None:
                    return entry[1]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    raise _not_arrived(transfer_id, timeout_s)
                self._cond.wait(remaining)

    async def take_async(self, transfer_id: str, timeout_s: float) -> KVPayload:
        """`take` for an event loop: the receiving thread wakes the waiter, no thread is held while waiting."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[KVPayload] = loop.create_future()
        with self._cond:
            self._expire_locked()
            entry = self._ready.pop(transfer_id, None)
            if entry is not None:
                return entry[1]
            self._waiters[transfer_id] = (loop, future)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError as err:
            raise _not_arrived(transfer_id, timeout_s) from err
        finally:
            with self._cond:
                self._waiters.pop(transfer_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        self._server.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), name="kv-recv-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(60.0)
            try:
                payload = read_payload(conn)
                self.geometry.check(payload)
            except (OSError, KVTransferError, ValueError) as err:
                self.num_rejected += 1
                logger.warning("rejected an incoming KV transfer: %s", err)
                with contextlib.suppress(OSError):  # the sender is gone; it learns from its own error
                    write_status(conn, STATUS_REJECTED, str(err))
                return
            with self._cond:
                self._expire_locked()
                self.num_received += 1
                waiter = self._waiters.pop(payload.transfer_id, None)
                if waiter is None or not _hand_over(waiter, payload):
                    self._ready[payload.transfer_id] = (time.monotonic(), payload)
                self._cond.notify_all()
            with contextlib.suppress(OSError):  # stored anyway: the decode request can still claim it
                write_status(conn, STATUS_OK)

    def _expire_locked(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for transfer_id in [t for t, (arrived, _) in self._ready.items() if arrived < cutoff]:
            del self._ready[transfer_id]
            self.num_expired += 1
            logger.warning("dropped KV transfer %s: no decode request claimed it within %.0fs", transfer_id,
                           self.ttl_s)  # fmt: skip


def _hand_over(waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[KVPayload]], payload: KVPayload) -> bool:
    """Resolve an async waiter from the receiving thread; False if its loop or future is gone."""
    loop, future = waiter

    def resolve() -> None:
        if not future.done():
            future.set_result(payload)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop is closed
        return False
    return True


def _not_arrived(transfer_id: str, timeout_s: float) -> KVTransferError:
    return KVTransferError(
        f"KV transfer {transfer_id} did not arrive within {timeout_s:.0f}s; "
        "the prefill engine failed or the router sent the request to the wrong decode replica"
    )
