"""Answering a request from raw ASGI middleware, before any app saw it: OpenAI-shaped error bodies, read bounds.

Used by the API-key check (api_key.py) and the router's drain gate (graceful.py), which both answer
a request themselves (401, 503) without handing it to FastAPI.

Invariants:
- The body is OpenAI's `{"error": {"message", "type", "param", "code"}}`, JSON with non-ASCII escaped.
- A refusal reads and discards what the client is still sending of its body first, bounded by
  `_DISCARD_MAX_BYTES` and `_DISCARD_MAX_S`: closing a connection on unread data makes the kernel reset
  it, and a client still uploading would lose the answer. When the bound stops the read, the answer
  says `Connection: close`, so no later request is parsed from the rest of that body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# Above the server's largest accepted body (16 MiB), so an honest client with a wrong key reads its 401; the
# bytes are dropped as they come (nothing is buffered), and the time bound stops a client that trickles.
_DISCARD_MAX_BYTES = 32 << 20
_DISCARD_MAX_S = 5.0


def error_body(message: str, type: str, code: str | None) -> bytes:
    """OpenAI's error body, as bytes."""
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


async def discard_body(receive: Receive) -> bool:
    """Read and drop the rest of the request body, within the bounds; True when all of it was read."""
    num_bytes = 0

    async def read_all() -> bool:
        nonlocal num_bytes
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return True  # the client is gone: nothing left to read
            num_bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
            if num_bytes > _DISCARD_MAX_BYTES:
                return False

    try:
        return await asyncio.wait_for(read_all(), _DISCARD_MAX_S)
    except TimeoutError:
        return False


async def refuse(
    receive: Receive, send: Send, status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> None:
    """Answer `status` with the JSON `body` without calling the app; the request body is discarded first."""
    is_whole = await discard_body(receive)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for name, value in (headers or {}).items():
        raw_headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    if not is_whole and not any(name == b"connection" for name, _ in raw_headers):
        raw_headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
