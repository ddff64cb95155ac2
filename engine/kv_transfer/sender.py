"""The sending side of the KV hand-off: every prefill rank pushes its pieces; the driver adds the manifest.

`KVSender.send(addr, transfer_id, kv, manifest)` runs on a small thread pool and returns at once, so
the engine (or a worker's command loop) goes on while the bytes travel. `kv` is this rank's slab of the
prompt's blocks, already copied off the cache. The thread asks the decode driver at `addr` for its
layout and rank addresses once (`LayoutCache`; forgotten after any failure, so a restarted decode pod
is asked again), pushes each piece of the plan (`layout.plan_pieces`) to the decode rank that caches
it, and — on the prefill driver only — sends the manifest last: the decode driver answers it once
every decode rank holds its slab, so an acknowledged transfer is complete everywhere.
`wait_sent(transfer_id)` (the HTTP handler, off the engine thread) blocks until then, or raises
`KVTransferError` with the reason (a refused or failed frame, a missing rank).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .layout import KVLayout, plan_pieces
from .protocol import (
    STATUS_OK,
    KVTransferError,
    Manifest,
    PieceHeader,
    read_status,
    write_layout_query,
    write_manifest,
    write_piece,
)
from .tcp import parse_addr

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Peers:
    """A decode engine as its driver describes it: its layout and each rank's (host, port)."""

    layout: KVLayout
    addrs: list[tuple[str, int]]

    @classmethod
    def parse(cls, text: str, driver_host: str) -> Peers:
        try:
            raw = json.loads(text)
            layout = KVLayout.from_json(raw["layout"])
            ranks = raw["ranks"]
            if not isinstance(ranks, list) or len(ranks) != layout.world_size:
                raise ValueError(f"{layout.world_size} rank addresses expected")
            addrs = []
            for host, port in ranks:
                if not isinstance(host, str) or type(port) is not int or not 0 < port < 65536:
                    raise ValueError(f"bad rank address {host!r}:{port!r}")
                addrs.append((host or driver_host, port))
        except (ValueError, KeyError, TypeError) as err:
            raise KVTransferError(f"the decode engine's layout answer is malformed: {err}") from err
        return cls(layout, addrs)


class LayoutCache:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._peers: dict[str, Peers] = {}
        self._lock = threading.Lock()

    def get(self, addr: str) -> Peers:
        with self._lock:
            peers = self._peers.get(addr)
        if peers is None:
            host, port = parse_addr(addr)
            status, text = _exchange((host, port), self.timeout_s, write_layout_query)
            if status != STATUS_OK:
                raise KVTransferError(f"the decode engine at {addr} refused the layout question: {text}")
            peers = Peers.parse(text, host)
            with self._lock:
                self._peers[addr] = peers
        return peers

    def forget(self, addr: str) -> None:
        with self._lock:
            self._peers.pop(addr, None)


class KVSender:
    def __init__(self, layout: KVLayout, rank: int = 0, timeout_s: float = 30.0, max_workers: int = 4) -> None:
        self.layout = layout
        self.rank = rank
        self.timeout_s = timeout_s
        self.layouts = LayoutCache(timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-send")
        self._futures: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self.num_sent = 0
        self.num_failed = 0
        self.bytes_sent = 0

    def send(self, addr: str, transfer_id: str, kv: torch.Tensor, manifest: Manifest | None = None) -> Future[None]:
        """Push this rank's pieces of `kv` ([layers, 2, blocks, block_size, heads, dim], its slab) and the manifest."""
        future = self._pool.submit(self._send, addr, transfer_id, kv, manifest)
        if manifest is not None:  # only the driver's sends are waited on (the manifest covers every rank)
            with self._lock:
                self._futures[transfer_id] = future
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

    def _send(self, addr: str, transfer_id: str, kv: torch.Tensor, manifest: Manifest | None) -> None:
        start, nbytes = time.monotonic(), 0
        try:
            peers = self.layouts.get(addr)
            try:
                pieces = plan_pieces(self.layout, self.rank, peers.layout)
            except ValueError as err:
                raise KVTransferError(str(err)) from err
            own_layers, own_heads = self.layout.layers_of(self.rank), self.layout.heads_of(self.rank)
            for piece in pieces:
                part = kv[piece.layers.start - own_layers.start : piece.layers.stop - own_layers.start, :, :, :,
                          piece.heads.start - own_heads.start : piece.heads.stop - own_heads.start]  # fmt: skip
                header = PieceHeader(transfer_id, piece.layers, piece.heads, kv.shape[2])
                self._push(peers.addrs[piece.dst_rank], lambda s, h=header, p=part: write_piece(s, h, kv.shape[3], p))
                nbytes += part.numel() * part.element_size()
            if manifest is not None:
                self._push(parse_addr(addr), lambda s: write_manifest(s, manifest))
        except (OSError, KVTransferError) as err:
            self.num_failed += 1
            self.layouts.forget(addr)
            logger.warning("KV transfer %s from rank %d to %s failed: %s", transfer_id, self.rank, addr, err)
            raise KVTransferError(f"sending KV transfer {transfer_id} to {addr} failed: {err}") from err
        self.num_sent += 1
        self.bytes_sent += nbytes
        logger.debug("rank %d sent KV transfer %s (%d bytes) to %s in %.3fs", self.rank, transfer_id, nbytes, addr,
                     time.monotonic() - start)  # fmt: skip

    def _push(self, target: tuple[str, int], write: Callable[[socket.socket], None]) -> None:
        status, message = _exchange(target, self.timeout_s, write)
        if status != STATUS_OK:
            raise KVTransferError(f"the decode rank at {target[0]}:{target[1]} refused it: {message}")


def _exchange(target: tuple[str, int], timeout_s: float, write: Callable[[socket.socket], None]) -> tuple[int, str]:
    """One connection: write a frame, read the status answer."""
    with socket.create_connection(target, timeout=timeout_s) as sock:
        write(sock)
        return read_status(sock)
