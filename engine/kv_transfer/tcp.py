"""TCP receivers of the KV hand-off (see `protocol`): one per decode rank, the driver's also takes manifests.

`RankReceiver` (every decode rank; a worker rank runs one in its process): a listening socket, one
thread per incoming connection, each frame checked (`protocol.read_frame`) and its piece stored in the
rank's `SlabStore`; a complete slab calls `on_complete(transfer_id)` (a worker tells its driver over
the control channel). `KVReceiver` (the decode driver, rank 0) also answers layout questions and
manifests: a manifest is answered once every rank's slab is complete (its own, and each worker's
notice `rank_stored`), or refused naming the missing ranks after `complete_timeout_s`; the complete
transfer is then parked under its id until the decode request that claims it arrives (`take`), or
until it expires (`ttl_s`), so a router that gave up never leaks memory (`on_drop` tells the workers).
Invariants: a transfer is claimable only when complete on every rank; a connection that breaks or
sends anything malformed stores nothing and — when the socket still allows — gets a rejection with
the reason; no exception ends a handler thread or the accept loop; at most `MAX_CONNECTIONS` frames are
handled at once (a flood of connections is refused, not given a thread each).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .assembly import SlabStore
from .layout import KVLayout
from .protocol import (
    STATUS_OK,
    STATUS_REJECTED,
    FrameLimits,
    KVPayload,
    KVTransferError,
    LayoutQuery,
    Manifest,
    read_frame,
    write_status,
)

logger = logging.getLogger(__name__)

_CONN_TIMEOUT_S = 60.0
# Concurrent incoming frames per rank (each prefill rank sends at most 4 at once); more are refused at once.
MAX_CONNECTIONS = 256


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 < int(port) < 65536:
        raise ValueError(f"KV address {addr!r} must be host:port (e.g. 10.0.0.7:14579)")
    return host.strip("[]"), int(port)


class RankReceiver:
    def __init__(
        self,
        limits: FrameLimits,
        host: str,
        port: int,
        ttl_s: float,
        on_complete: Callable[[str], None],
        max_pending_blocks: int | None = None,
    ) -> None:
        self.limits = limits
        self.ttl_s = ttl_s
        # Unclaimed KV is bounded (a flood cannot exhaust memory): by default one cache's worth of blocks.
        self.store = SlabStore(limits, max_pending_blocks or 4 * limits.max_blocks, on_complete)
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.settimeout(0.5)
        self.port = self._server.getsockname()[1]
        self._closed = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.num_rejected = 0
        self._thread = threading.Thread(target=self._accept_loop, name="kv-recv", daemon=True)
        self._thread.start()
        logger.info("KV receiver (layers %s, heads %s) listening on %s:%d", limits.layers, limits.heads, host,
                    self.port)  # fmt: skip

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self.num_rejected += 1
                with conn, contextlib.suppress(OSError):
                    write_status(conn, STATUS_REJECTED, f"busy: {MAX_CONNECTIONS} KV frames already in flight here")
                continue
            threading.Thread(target=self._handle, args=(conn,), name="kv-recv-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._slots.release()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_CONN_TIMEOUT_S)
            try:
                self._expire()
                frame = read_frame(conn, self.limits)
                if isinstance(frame, tuple):
                    self.store.add(*frame)
                    answer = ""
                else:
                    answer = self._answer(frame)
            except Exception as err:  # anything a peer sent: refused with the reason, never a dead thread
                self.num_rejected += 1
                logger.warning("rejected an incoming KV frame: %s", err)
                with contextlib.suppress(OSError):  # the sender is gone; it learns from its own error
                    write_status(conn, STATUS_REJECTED, str(err) or type(err).__name__)
                return
            with contextlib.suppress(OSError):  # stored anyway: the decode request can still claim it
                write_status(conn, STATUS_OK, answer)

    def _answer(self, frame: LayoutQuery | Manifest) -> str:
        raise KVTransferError("this rank takes KV pieces only")

    def _expire(self) -> None:
        for transfer_id in self.store.expire(self.ttl_s):
            logger.warning("dropped the KV pieces of transfer %s: unclaimed for %.0fs", transfer_id, self.ttl_s)


@dataclass(slots=True)
class _Transfer:
    arrived: float = field(default_factory=time.monotonic)
    ranks_done: set[int] = field(default_factory=set)
    manifest: Manifest | None = None


class KVReceiver(RankReceiver):
    """The decode driver's receiver: its own slab's pieces, layout questions, manifests, claims."""

    def __init__(
        self,
        limits: FrameLimits,
        layout: KVLayout,
        rank_addrs: list[tuple[str, int]],
        host: str = "0.0.0.0",
        port: int = 14579,
        ttl_s: float = 60.0,
        on_drop: Callable[[str], None] | None = None,
        max_pending_blocks: int | None = None,
    ) -> None:
        self._cond = threading.Condition()
        self._transfers: dict[str, _Transfer] = {}
        self._ready: dict[str, tuple[float, KVPayload]] = {}
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[KVPayload]]] = {}
        self._on_drop = on_drop or (lambda transfer_id: None)
        self.layout = layout
        self.rank_addrs = rank_addrs  # (host, port) per rank >= 1; host "" = this engine's own address
        self.complete_timeout_s = ttl_s / 4
        self.num_received = 0
        self.num_expired = 0
        super().__init__(
            limits, host, port, ttl_s, lambda transfer_id: self.rank_stored(0, transfer_id), max_pending_blocks
        )
        logger.info("KV transfers for this engine on port %d (worker ranks at %s)", self.port, rank_addrs)

    @property
    def num_parked(self) -> int:
        with self._cond:
            return len(self._ready)

    def layout_json(self) -> str:
        ranks = [["", self.port], *([h, p] for h, p in self.rank_addrs)]
        return json.dumps({"layout": self.layout.to_json(), "ranks": ranks})

    def rank_stored(self, rank: int, transfer_id: str) -> None:
        """Rank `rank` holds its complete slab of `transfer_id` (0: this driver)."""
        with self._cond:
            self._transfers.setdefault(transfer_id, _Transfer()).ranks_done.add(rank)
            self._cond.notify_all()

    def take(self, transfer_id: str, timeout_s: float) -> KVPayload:
        """The payload for `transfer_id`, waiting up to `timeout_s` for it; raises KVTransferError on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
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
        super().close()

    def _answer(self, frame: LayoutQuery | Manifest) -> str:
        if isinstance(frame, LayoutQuery):
            return self.layout_json()
        return self._complete(frame)

    def _complete(self, manifest: Manifest) -> str:
        """Wait until every rank holds its slab of the manifest's transfer, then park it for its request."""
        transfer_id = manifest.transfer_id
        deadline = time.monotonic() + self.complete_timeout_s
        everyone = set(range(1 + len(self.rank_addrs)))
        with self._cond:
            transfer = self._transfers.setdefault(transfer_id, _Transfer())
            if transfer.manifest is not None or transfer_id in self._ready:
                raise KVTransferError(f"transfer {transfer_id} was sent twice")
            transfer.manifest = manifest
            while not everyone <= transfer.ranks_done and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if not everyone <= transfer.ranks_done:
                del self._transfers[transfer_id]
                missing = sorted(everyone - transfer.ranks_done)
                self._drop(transfer_id)
                raise KVTransferError(
                    f"transfer {transfer_id}: decode ranks {missing} did not receive their KV within "
                    f"{self.complete_timeout_s:.0f}s (a prefill rank failed to send)"
                )
            del self._transfers[transfer_id]
            kv = self.store.pop(transfer_id)
            if kv is None:  # only a concurrent drop (expiry) can take it between completion and here
                self._drop(transfer_id)
                raise KVTransferError(f"transfer {transfer_id} expired while it was being completed")
            payload = KVPayload(transfer_id, manifest.prompt_token_ids, manifest.first_token_id,
                                self.limits.block_size, kv, self.limits.layers.start, manifest.lora_name)  # fmt: skip
            if kv.shape[2] != manifest.num_blocks:
                self._drop(transfer_id)
                raise KVTransferError(f"transfer {transfer_id}: {kv.shape[2]} blocks of KV for a manifest of "
                                      f"{manifest.num_blocks}")  # fmt: skip
            self.num_received += 1
            waiter = self._waiters.pop(transfer_id, None)
            if waiter is None or not _hand_over(waiter, payload):
                self._ready[transfer_id] = (time.monotonic(), payload)
            self._cond.notify_all()
        return ""

    def _drop(self, transfer_id: str) -> None:
        """Forget a transfer here and on the workers (called with the lock held or not: both are idempotent)."""
        self.store.drop(transfer_id)
        if self.rank_addrs:
            try:
                self._on_drop(transfer_id)
            except Exception as err:  # a dead worker: the engine learns it from its own step
                logger.warning("could not tell the workers to drop transfer %s: %s", transfer_id, err)

    def _expire(self) -> None:
        super()._expire()
        cutoff = time.monotonic() - self.ttl_s
        with self._cond:
            stale = [t for t, (arrived, _) in self._ready.items() if arrived < cutoff]
            stale += [t for t, tr in self._transfers.items() if tr.arrived < cutoff and tr.manifest is None]
            for transfer_id in stale:
                self._ready.pop(transfer_id, None)
                self._transfers.pop(transfer_id, None)
                self.num_expired += 1
                self._drop(transfer_id)
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
