"""The server's and router's connections are tuned for streaming: TCP_NODELAY on, every read ACKed at once.

Runs uvicorn as `tidepool serve` sets it up (its own pre-bound socket from `cli._bind`, the protocol
class from `tcp_tuning.http_protocol()`) in a thread, and looks at the accepted connection's real
socket. Before this tuning the accepted socket had TCP_NODELAY off (the pre-bound socket's protocol
number was 0, so asyncio skipped it), which held each streamed request's first token ~40 ms behind
its response headers. No timing is asserted: the socket options are read back.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from tidepool.common.tcp_tuning import _TCP_QUICKACK, http_protocol
from tidepool.engine.server.cli import _bind


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for part in (b"data: 1\n\n", b"data: 2\n\n"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture()
def live() -> Iterator[tuple[uvicorn.Server, int]]:
    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app, http=http_protocol(), log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield server, port
    server.should_exit = True
    thread.join(30)


def _request(conn: socket.socket) -> bytes:
    body = b'{"x": 1}'
    # Headers and body as two segments from a socket without TCP_NODELAY, as httpx's asyncio transport sends.
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))  # fmt: skip
    conn.sendall(body)
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        chunk = conn.recv(65536)
        assert chunk, f"connection closed early: {data!r}"
        data += chunk
    return data


def _connection(server: uvicorn.Server) -> Any:
    [protocol] = list(server.server_state.connections)
    return protocol


def test_pre_bound_socket_says_tcp() -> None:
    sock = _bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # what asyncio checks before setting TCP_NODELAY itself
    finally:
        sock.close()


def test_httptools_protocol_is_used() -> None:
    # httptools is a dependency; its C parser costs the event loop less per streamed chunk than h11.
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert issubclass(http_protocol(), HttpToolsProtocol)


def test_accepted_connection_has_nodelay(live: tuple[uvicorn.Server, int]) -> None:
    server, port = live
    with socket.create_connection(("127.0.0.1", port)) as conn:
        assert b"data: 1" in _request(conn)
        sock = _connection(server).transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


@pytest.mark.skipif(_TCP_QUICKACK is None, reason="TCP_QUICKACK is Linux's")
def test_every_read_is_acked_at_once(live: tuple[uvicorn.Server, int]) -> None:
    server, port = live
    with socket.create_connection(("127.0.0.1", port)) as conn:
        _request(conn)
        protocol = _connection(server)
        calls: list[tuple[int, int, int]] = []
        real = protocol._quickack_sock

        class Recording:
            def setsockopt(self, level: int, option: int, value: int) -> None:
                calls.append((level, option, value))
                real.setsockopt(level, option, value)

        protocol._quickack_sock = Recording()
        assert b"data: 2" in _request(conn)
        assert calls and set(calls) == {(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)}


def test_router_runs_uvicorn_with_the_tuned_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidepool.common.graceful import DrainingServer
    from tidepool.router import cli as router_cli

    seen: dict[str, Any] = {}

    def run(server: DrainingServer, sockets: Any = None) -> None:  # the router's uvicorn, stopped before it serves
        seen["http"] = server.config.http
        server.started = True

    monkeypatch.setattr(DrainingServer, "run", run)
    assert router_cli.main(["--unified-url", "http://127.0.0.1:9", "--port", "0"]) == 0
    assert seen["http"] is http_protocol()
