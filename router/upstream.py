"""Small pieces of talking to replicas: error bodies, the retryable-failure type, disconnect races, SSE regrouping.

Invariants: an `UpstreamFailure` is raised only before any byte reached the client (so it may
be retried); `sse_events` never splits an event, so a stream cut can be followed by a
well-formed error event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tidepool.contract.sleep import SLEEPING_CODE

T = TypeVar("T")

FORWARDED_HEADERS = ("authorization", "x-api-key", "x-request-id")  # client -> replica (its API key unchanged)
RELAYED_HEADERS = ("retry-after", "x-request-id")  # replica -> client
REPLICA_HEADER = "x-tidepool-replica"  # the replica that answered (host:port), for clients and tests
CLIENT_CLOSED = 499  # nginx's status for "client closed request": recorded, never seen by a client


def error_response(status: int, message: str, type: str, code: str, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class UpstreamFailure(Exception):
    """A failed attempt that may be retried on another replica (nothing reached the client yet)."""

    def __init__(
        self,
        message: str,
        pool: str,
        replica: str,
        status: int | None = None,
        content: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.pool = pool  # the pool whose replica failed
        self.replica = replica  # its URL: not tried again for this request
        self.status = status  # the replica's HTTP status, None for a transport error
        self.content = content  # the replica's error body, relayed if this is the last attempt
        self.headers = headers or {}
        # The replica's engine sleeps (503, error code contract.sleep.SLEEPING_CODE): not a broken replica, so it
        # stays a candidate; it is unready until woken, so the retry is held like a request at zero.
        self.is_asleep = status == 503 and is_sleeping_reply(content)


def is_sleeping_reply(content: bytes) -> bool:
    """An engine's OpenAI error body saying it sleeps (its `error.code` is contract.sleep.SLEEPING_CODE)."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == SLEEPING_CODE


class ClientGone(Exception):
    """The client disconnected while the router waited for an upstream answer."""


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (closing the upstream connection) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        # The body was read already: the next ASGI message is the disconnect.
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the client left (or this handler was cancelled): drop the upstream call
    if task not in done:
        raise ClientGone()
    return task.result()


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Regroup raw chunks into whole SSE events (each ending with a blank line); a trailing rest as is."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        end = max(buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n"))
        if end == -1:
            continue
        cut = end + (4 if buffer.startswith(b"\r\n\r\n", end) else 2)
        yield buffer[:cut]
        buffer = buffer[cut:]
    if buffer:
        yield buffer
