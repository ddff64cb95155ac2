"""Shutdown and process-level edges: every request answered, every exit code meaningful, whatever the timing.

Requests are held in flight by pausing the engine (controlled_serve.py), never by hoping a
generation is slow enough, so each test means the same on a fast and on a busy machine.
Drain and read timeouts are set far above anything the test waits for whenever the point is
that they must *not* be what ends the wait.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_proc import MODEL_NAME, Server, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LONG = "600"  # seconds: a drain or read timeout that must never be what ends a test
STREAM = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
JSON_BODY = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 50, "ignore_eos": True}


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _error(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


class _StreamReader:
    """Reads one SSE stream in a thread: every `data:` payload, parsed (the final `[DONE]` kept as a string)."""

    def __init__(self, server: Server, path: str, body: dict[str, Any]) -> None:
        import threading

        self.status: int | None = None
        self.events: list[Any] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(server, path, body), daemon=True)
        self._thread.start()

    def _read(self, server: Server, path: str, body: dict[str, Any]) -> None:
        try:
            with httpx.Client(timeout=120) as http, http.stream("POST", server.url + path, json=body) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
        except BaseException as err:  # the assertion below reports it
            self.error = err

    def join(self) -> None:
        self._thread.join(120)
        assert not self._thread.is_alive() and self.error is None, self.error


class _JsonRequest:
    def __init__(self, server: Server, path: str, body: dict[str, Any]) -> None:
        import threading

        self.response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._post, args=(server, path, body), daemon=True)
        self._thread.start()

    def _post(self, server: Server, path: str, body: dict[str, Any]) -> None:
        self.response = httpx.post(server.url + path, json=body, timeout=120)

    def join(self) -> httpx.Response:
        self._thread.join(120)
        assert self.response is not None
        return self.response


def _assert_aborted_stream(reader: _StreamReader, code: str, n: int = 1) -> None:
    """The stream says what happened: every one of the n choices ends with finish_reason "abort", then one
    OpenAI-shaped error event, then [DONE]."""
    assert reader.status == 200
    assert reader.events[-1] == "[DONE]", reader.events[-3:]
    error = _error(reader.events[-2])
    assert error["code"] == code and error["type"] == "service_unavailable", error
    chunks = [c for c in reader.events[:-2] if isinstance(c, dict)]
    assert all("error" not in c for c in chunks), chunks  # one error event, the last
    finishes = {choice["index"]: choice["finish_reason"] for c in chunks for choice in c["choices"]}
    assert finishes == dict.fromkeys(range(n), "abort"), reader.events[-2 * n - 2 :]


def _blocks_all_free(server: Server) -> bool:
    match = re.search(r"engine stopped: (\d+)/(\d+) KV blocks free", server.log())
    return bool(match) and match.group(1) == match.group(2)


def test_drain_deadline_aborts_say_so(serve_controlled: Callable[..., Server]) -> None:
    server = serve_controlled("--drain-timeout", "1")
    server.pause()
    stream = _StreamReader(server, "/v1/completions", {**STREAM, "n": 3})
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 50, "n": 2}
    chat = _StreamReader(server, "/v1/chat/completions", chat_body)
    plain = _JsonRequest(server, "/v1/completions", JSON_BODY)
    _wait_for(lambda: server.kv()["num_unfinished"] == 6, "six sequences in the (paused) engine")
    server.proc.send_signal(signal.SIGTERM)
    for reader, n in ((stream, 3), (chat, 2)):
        reader.join()
        _assert_aborted_stream(reader, "drain_timeout", n)
    resp = plain.join()
    assert resp.status_code == 503, resp.text
    assert _error(resp.json())["code"] == "drain_timeout"
    assert server.proc.wait(60) == 0
    assert _blocks_all_free(server), server.log()[-2000:]


def test_second_sigterm_answers_everything_and_exits(serve_controlled: Callable[..., Server]) -> None:
    server = serve_controlled("--drain-timeout", LONG)
    server.pause()
    stream = _StreamReader(server, "/v1/completions", STREAM)
    plain = _JsonRequest(server, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50})  # fmt: skip
    _wait_for(lambda: server.kv()["num_unfinished"] == 2, "two requests in the (paused) engine")
    server.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: httpx.get(server.url + "/ready", timeout=10).status_code == 503, "the drain to start")
    server.proc.send_signal(signal.SIGTERM)
    stream.join()
    _assert_aborted_stream(stream, "shutdown")
    resp = plain.join()
    assert resp.status_code == 503 and _error(resp.json())["code"] == "shutdown", resp.text
    assert server.proc.wait(60) == 0  # well before the 600 s grace period: the second signal ended it
    assert _blocks_all_free(server), server.log()[-2000:]


def test_stalled_uploads_do_not_hold_the_drain(serve: Callable[..., Server]) -> None:
    server = serve("--drain-timeout", LONG, "--body-read-timeout", LONG)
    uploads = [_stalled_upload(server) for _ in range(10)]
    _wait_for(lambda: server.kv()["num_receiving_http"] == 10, "ten uploads in progress")
    server.proc.send_signal(signal.SIGTERM)
    for sock in uploads:
        status, body = _read_response(sock)
        assert status == 503 and _error(body)["code"] == "draining", body
    assert server.proc.wait(60) == 0  # neither 600 s timeout was waited for


def test_stalled_upload_gets_408(serve: Callable[..., Server]) -> None:
    server = serve("--body-read-timeout", "1")
    status, body = _read_response(_stalled_upload(server))
    assert status == 408 and _error(body)["code"] == "body_read_timeout", body
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_request_body_limit_gives_413(serve: Callable[..., Server]) -> None:
    server = serve("--max-body-bytes", "2000")
    big = {"model": MODEL_NAME, "prompt": "x" * 3000, "max_tokens": 1}
    resp = httpx.post(server.api + "/completions", json=big, timeout=30)
    assert resp.status_code == 413 and _error(resp.json())["code"] == "request_too_large", resp.text

    def chunked() -> Any:  # no Content-Length: the limit is enforced while reading
        yield json.dumps(big).encode()

    resp = httpx.post(server.api + "/completions", content=chunked(), timeout=30,
                      headers={"content-type": "application/json"})  # fmt: skip
    assert resp.status_code == 413 and _error(resp.json())["code"] == "request_too_large", resp.text
    # Far over the limit: the client is still uploading when the answer is ready, and must still read it
    # (the server reads and drops the rest before closing, instead of resetting the connection).
    huge = httpx.post(server.api + "/completions", json={**big, "prompt": "x" * 4_000_000}, timeout=60)
    assert huge.status_code == 413 and _error(huge.json())["code"] == "request_too_large", huge.text
    small = httpx.post(server.api + "/completions", json={**big, "prompt": "x" * 100}, timeout=30)
    assert small.status_code == 200, small.text


def test_dead_engine_exits_nonzero(serve_controlled: Callable[..., Server]) -> None:
    server = serve_controlled()
    server.crash_engine()
    resp = httpx.post(server.api + "/completions", json=JSON_BODY, timeout=60)
    assert resp.status_code == 500 and _error(resp.json())["code"] == "engine_dead", resp.text
    assert server.proc.wait(60) == 1  # restarted by Kubernetes, instead of answering 503 forever
    assert "engine thread failed" in server.log()


def test_a_request_the_engine_fails_on_fails_alone(serve_controlled: Callable[..., Server]) -> None:
    server = serve_controlled()
    normal = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = httpx.post(server.api + "/completions", json=normal, timeout=60).json()["choices"][0]["text"]
    server.poison_seed(666)
    server.pause()  # all four in the engine together, so the poisoned ones share steps with the healthy ones
    poisoned = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 24, "seed": 666, "ignore_eos": True}
    plain = _JsonRequest(server, "/v1/completions", poisoned)
    # n=2 from seed 665: choice 1 (seed 666) fails, choice 0 is healthy and still running when it does.
    stream = _StreamReader(server, "/v1/completions", {**poisoned, "seed": 665, "n": 2, "stream": True})
    healthy = [_JsonRequest(server, "/v1/completions", normal) for _ in range(2)]
    _wait_for(lambda: server.kv()["num_unfinished"] == 5, "five sequences in the (paused) engine")
    server.pause(False)
    resp = plain.join()
    assert resp.status_code == 500 and _error(resp.json())["code"] == "request_failed", resp.text
    stream.join()
    assert stream.events[-1] == "[DONE]" and _error(stream.events[-2])["code"] == "request_failed", stream.events
    finishes = {choice["index"]: choice["finish_reason"] for c in stream.events[:-2] for choice in c["choices"]}
    assert finishes.keys() == {0, 1} and finishes[0] == "abort", stream.events  # the healthy choice is told too
    for request in healthy:  # the others in the same steps carry on with exactly their tokens
        assert request.join().json()["choices"][0]["text"] == expected
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    server.wait_pool_free()


def test_port_in_use_is_one_clear_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    from serve_proc import _command

    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        proc = subprocess.run([*_command(), "serve", "--model", str(tiny_model_dir), "--host", "127.0.0.1",
                               "--port", str(port)], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120)  # fmt: skip
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], proc.stderr


def _stalled_upload(server: Server) -> socket.socket:
    """A client that sends its headers and part of its body, then nothing."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    head = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + b'{"model": "tiny", "prompt": "hel')
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    with sock:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before a response: {data!r}"
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))  # type: ignore[union-attr]
        while len(rest) < length:
            chunk = sock.recv(65536)
            assert chunk, "connection closed mid-body"
            rest += chunk
        return status, json.loads(rest[:length])
