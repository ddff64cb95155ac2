"""The door of the API: readiness, request bodies (size, read timeout) and in-flight counting.

Role: an ASGI middleware in front of the API routes (`POST /v1/...` and vLLM's `POST /tokenize`
and `/detokenize`). It answers 503 while the model loads or the server drains, reads the whole
body itself (so it can bound it) and only then hands the request to FastAPI with the body replayed.

Invariants:
- A body with a Content-Encoding other than identity is refused with 415 (and `Accept-Encoding:
  identity`, as RFC 9110 asks) before it is read: the API reads only uncompressed JSON.
- A body larger than `max_body_bytes` is refused with 413 as soon as that is known (from
  Content-Length, or while reading); a client that pauses longer than `body_read_timeout_s`
  between two parts of its body gets 408. Both bodies are OpenAI-shaped errors.
- A request counts as in flight (and holds a drain) only once its body is complete: an upload
  still in progress when the drain starts is answered 503 `draining` at once, so stalled
  uploads never hold a shutdown.
- A refusal sent before the whole body arrived closes the connection, after reading and
  discarding what the client is still sending for a short while (a "lingering close", bounded by
  `_LINGER_S`): closing on unread data makes the kernel reset the connection, and a client still
  uploading would lose the answer.
- In-flight counting wraps the whole ASGI call, so a streamed response counts until its last
  byte is sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import APIError
from .state import ServerState

TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # vLLM's, outside /v1/
_LINGER_S = 5.0  # at most this long discarding the rest of a refused body before answering
_LINGER_PAUSE_S = 0.5  # a client that sends nothing for this long is not uploading any more


class _Refused(Exception):
    def __init__(self, error: APIError, more_body: bool = True) -> None:
        self.error = error
        self.more_body = more_body  # whether the client may still be sending its body


class _ClientGone(Exception):
    pass


class RequestGate:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        state = self.state
        reason = state.not_ready_reason()
        if reason is not None:
            await _discard_rest(receive)
            await send_error(send, _not_accepting(reason), close=True)
            return
        state.num_receiving += 1
        try:
            body = await self._read_body(scope, receive)
        except _ClientGone:
            return
        except _Refused as refused:
            if refused.more_body:
                await _discard_rest(receive)
            await send_error(send, refused.error, close=True)
            return
        finally:
            state.num_receiving -= 1
        state.num_inflight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            state.num_inflight -= 1

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        coding = _content_encoding(scope)
        if coding not in ("", "identity"):
            raise _Refused(
                APIError(
                    f"the request body is sent with Content-Encoding {coding!r}; this server reads only uncompressed "
                    "bodies: send it without Content-Encoding",
                    status_code=415,
                    code="unsupported_content_encoding",
                    headers={"accept-encoding": "identity"},
                )
            )
        limit = self.state.config.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            raise _Refused(_too_large(declared, limit))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._next_message(receive)
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            more_body = message.get("more_body", False)
            if size > limit:
                raise _Refused(_too_large(size, limit, at_least=more_body), more_body)
            chunks.append(chunk)
            if not more_body:
                return b"".join(chunks)

    async def _next_message(self, receive: Receive) -> Message:
        """The next body message, unless the client stalls past the read timeout or a drain starts first."""
        state = self.state
        if state.is_draining:
            raise _Refused(_not_accepting("draining"))
        timeout = state.config.body_read_timeout_s
        receiving = asyncio.ensure_future(receive())
        draining = asyncio.ensure_future(state.drain_started.wait())
        try:
            await asyncio.wait({receiving, draining}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            draining.cancel()
        if receiving.done():
            return receiving.result()
        receiving.cancel()
        if state.is_draining:
            raise _Refused(_not_accepting("draining"))
        raise _Refused(
            APIError(
                f"the request body did not arrive: nothing was received for {timeout:g} s (--body-read-timeout)",
                status_code=408,
                code="body_read_timeout",
            )
        )


def is_api_path(path: str) -> bool:
    """Whether a POST to `path` is an API call: gated, bounded and counted in flight."""
    return path.startswith("/v1/") or path in TOKENIZER_PATHS


async def _discard_rest(receive: Receive) -> None:
    """Read and drop what the client still sends, until its body ends, it pauses or `_LINGER_S` is over."""
    deadline = time.monotonic() + _LINGER_S
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(receive(), min(remaining, _LINGER_PAUSE_S))
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body once, then the client's own messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _header_values(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of header `name` (lower-case, as ASGI gives names), in the order sent."""
    return [value for key, value in scope.get("headers", ()) if key == name]


def _content_length(scope: Scope) -> int | None:
    values = _header_values(scope, b"content-length")
    if not values:
        return None
    try:
        return int(values[0])
    except ValueError:
        return None  # the HTTP parser refuses a malformed length before we are called


def _content_encoding(scope: Scope) -> str:
    """The body's Content-Encoding, lower-cased; "" when there is none (several headers are joined as HTTP says)."""
    values = (value.decode("latin-1").strip() for value in _header_values(scope, b"content-encoding"))
    return ", ".join(v for v in values if v).lower()


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    got = f"at least {size:,}" if at_least else f"{size:,}"
    return APIError(
        f"the request body is {got} bytes; this server accepts at most {limit:,} (--max-body-bytes)",
        status_code=413,
        code="request_too_large",
    )


def _not_accepting(reason: str) -> APIError:
    return APIError(
        f"the server is not accepting requests ({reason})", status_code=503, type="service_unavailable", code=reason
    )


def error_bytes(body: dict[str, Any]) -> bytes:
    """JSON with non-ASCII escaped: an error message quoting client input can always be encoded."""
    return json.dumps(body).encode()


async def send_error(send: Send, error: APIError, close: bool = False) -> None:
    payload = error_bytes(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [
        (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in (error.headers or {}).items()
    ]
    if close:  # the rest of the body was not read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
