"""uvicorn's HTTP/1.1 protocol with low-latency TCP settings, for the engine server and the router.

The protocol is uvicorn's httptools one (the C parser vLLM's deployments run, via uvicorn[standard]):
per streamed token it costs the event loop about a third less CPU than the pure-Python h11 one
(bench/README.md); h11's is used where httptools is not installed.

Two stalls of about 40 ms each, both from Nagle's algorithm meeting Linux's delayed ACKs, found by
timing each `recv` of a streamed completion on a tiny model (bench/README.md, "Where a token's
milliseconds go"):
- Response side: a streamed response is written as its headers, then one chunk per token. Without
  TCP_NODELAY the first chunk waits until the client ACKs the headers, and the client delays that
  ACK. asyncio sets TCP_NODELAY on accepted connections only when the listening socket says it is
  TCP by its protocol number, and `tidepool serve` binds its own socket (to report a busy port
  before loading the model), whose protocol number is 0: every streamed request's first token came
  40 ms late. Each accepted connection now gets TCP_NODELAY here, whatever socket it came from.
- Request side: many clients write a request as two segments (headers, then body) on a socket
  without TCP_NODELAY (httpx's asyncio transport: the async openai SDK and most agent frameworks).
  Nagle holds the body until the server ACKs the headers, which Linux delays, since nothing is sent
  back yet. Setting TCP_QUICKACK after each read sends a scheduled ACK at once (Linux flushes it
  when the option is set), so the body follows without the stall. One setsockopt per received
  segment; none per streamed token.

Invariant: only segment and ACK timing change; what is read and written, and in which order, is
uvicorn's. Where an option does not exist (TCP_QUICKACK is Linux's) or the socket refuses it,
that option is left alone.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


class _LowLatency:
    """TCP_NODELAY on every connection and an immediate ACK of every read, for one of uvicorn's protocols."""

    _quickack_sock: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return  # a Unix socket, or a transport without one: nothing to tune
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            return  # already closed by the peer; uvicorn sees that itself
        if _TCP_QUICKACK is not None:
            self._quickack_sock = sock
            self._ack_now()

    def data_received(self, data: bytes) -> None:
        self._ack_now()
        super().data_received(data)  # type: ignore[misc]

    def _ack_now(self) -> None:
        if self._quickack_sock is None:
            return
        try:
            self._quickack_sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
        except OSError:  # closed under us, or refused: plain delayed ACKs from now on
            self._quickack_sock = None


class LowLatencyH11Protocol(_LowLatency, H11Protocol):
    """uvicorn's pure-Python HTTP/1.1 protocol, tuned."""


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is a dependency, but uvicorn runs without it
    LowLatencyHttpToolsProtocol: type[asyncio.Protocol] | None = None
else:

    class LowLatencyHttpToolsProtocol(_LowLatency, HttpToolsProtocol):  # type: ignore[no-redef]
        """uvicorn's httptools (C parser) HTTP/1.1 protocol, tuned."""


def http_protocol() -> type[asyncio.Protocol]:
    """The protocol class for uvicorn's `http=`: httptools' when it is installed, else h11's, tuned either way."""
    return LowLatencyHttpToolsProtocol or LowLatencyH11Protocol
