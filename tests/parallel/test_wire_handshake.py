"""The control channel's handshake and key (distributed/comm.py) over real sockets on this machine.

Both sides must prove they hold the per-service key before any frame is decoded: a stray client, a
client with the wrong key or a fake driver (what a rewritten rendezvous-store entry would point a worker
at) gets a PermissionError and a closed connection, nothing unpickled or decoded, and the driver keeps
accepting the real workers afterwards. The key comes from $TIDEPOOL_CONTROL_KEY_FILE, or, on one
machine only, is drawn at random.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from tidepool.contract import wire
from tidepool.contract.wire import MessageType
from tidepool.engine.distributed import comm

KEY = b"k" * 32
TIMEOUT = 10.0


@pytest.fixture()
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    try:
        yield sock
    finally:
        sock.close()


def _address(listener: socket.socket) -> str:
    return f"127.0.0.1:{listener.getsockname()[1]}"


def _in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run `fn` in a thread; the returned function joins it and returns its result or raises its error."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # handed to the test thread
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(TIMEOUT * 3)
        assert not thread.is_alive(), "the other side of the handshake hung"
        if "error" in result:
            raise result["error"]
        return result["value"]

    return join


def test_matching_keys_connect_and_typed_messages_flow_both_ways(listener: socket.socket) -> None:
    accepted = _in_thread(lambda: comm.accept(listener, KEY, TIMEOUT))
    worker = comm.connect(_address(listener), KEY, TIMEOUT)
    driver = accepted()
    comm.send(worker, MessageType.HELLO, rank=1, pid=os.getpid(), host="here")
    assert comm.recv(driver, MessageType.HELLO).fields == {"rank": 1, "pid": os.getpid(), "host": "here"}
    comm.send_bytes(driver, comm.encode(MessageType.LOGITS, hidden=torch.ones(2, 3)))
    assert torch.equal(comm.recv(worker, MessageType.LOGITS).fields["hidden"], torch.ones(2, 3))
    worker.close()
    with pytest.raises(EOFError):
        comm.recv(driver, MessageType.READY)
    driver.close()


def test_a_wrong_key_is_refused_on_both_sides_and_the_driver_keeps_accepting(listener: socket.socket) -> None:
    accepted = _in_thread(lambda: comm.accept(listener, KEY, TIMEOUT))
    with pytest.raises(PermissionError, match="handshake with the control channel"):
        comm.connect(_address(listener), b"w" * 32, TIMEOUT)
    with pytest.raises(PermissionError, match="offered a wrong key"):
        accepted()
    accepted = _in_thread(lambda: comm.accept(listener, KEY, TIMEOUT))
    comm.connect(_address(listener), KEY, TIMEOUT).close()
    accepted().close()


class _Boom:
    """Would create `path` if anything unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("payload", ["pickle", "old key", "silence"])
def test_a_stray_client_gets_nothing_decoded(listener: socket.socket, tmp_path: Path, payload: str) -> None:
    marker = tmp_path / "unpickled"
    accepted = _in_thread(lambda: comm.accept(listener, KEY, 0.5 if payload == "silence" else TIMEOUT))
    client = Connection(socket.create_connection(listener.getsockname()).detach())
    if payload == "pickle":
        client.send_bytes(pickle.dumps(("hello", _Boom(marker))))
    elif payload == "old key":  # what the pickle protocol's worker sent first: the key itself
        client.send_bytes(KEY)
    with pytest.raises(PermissionError):
        accepted()
    client.close()
    assert not marker.exists()


def _fake_driver(listener: socket.socket, greeting: Callable[[bytes], bytes], proof: bytes | None) -> Callable[[], Any]:
    def run() -> None:
        sock, _ = listener.accept()
        conn = Connection(sock.detach())
        conn.send_bytes(greeting(wire.new_nonce()))
        if proof is not None:
            conn.recv_bytes()
            conn.send_bytes(proof)
        with pytest.raises((EOFError, ConnectionResetError)):
            conn.recv_bytes()  # until the worker hangs up

    return _in_thread(run)


@pytest.mark.parametrize(
    "greeting, proof, message",
    [
        (wire.challenge, b"\0" * wire.PROOF_BYTES, "does not hold this worker's key"),
        (wire.challenge, b"\0" * 3, "proof is 3 bytes"),
        (lambda nonce: pickle.dumps(("forward", nonce)), None, "bad message length"),
        (lambda nonce: wire.CHALLENGE.pack(wire.MAGIC, wire.VERSION + 1, nonce), None, "speaks control version 2"),
    ],
    ids=["wrong proof", "short proof", "pickle", "newer version"],
)
def test_a_worker_refuses_a_driver_without_the_key(
    listener: socket.socket, greeting: Callable[[bytes], bytes], proof: bytes | None, message: str
) -> None:
    driver = _fake_driver(listener, greeting, proof)
    with pytest.raises(PermissionError, match=message):
        comm.connect(_address(listener), KEY, TIMEOUT)
    driver()


def test_proofs_bind_the_role_and_both_nonces() -> None:
    a, b = wire.new_nonce(), wire.new_nonce()
    proofs = {wire.proof(KEY, role, x, y) for role in ("driver", "worker") for x, y in ((a, b), (b, a))}
    assert len(proofs) == 4  # a proof cannot be replayed in the other direction or for other nonces
    assert wire.proof_matches(wire.proof(KEY, "driver", a, b), wire.proof(KEY, "driver", a, b))
    assert not wire.proof_matches(wire.proof(KEY, "driver", a, b), wire.proof(KEY + b"x", "driver", a, b))


def test_the_key_comes_from_the_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(b"  c2VjcmV0LXNlY3JldC1zZWNyZXQ=\n")  # a mounted Secret's value, with a newline
    monkeypatch.setenv(wire.CONTROL_KEY_FILE_ENV, str(key_file))
    assert comm.control_key(nnodes=2) == comm.control_key(nnodes=1) == b"c2VjcmV0LXNlY3JldC1zZWNyZXQ="


def test_one_machine_without_a_key_file_draws_a_fresh_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(wire.CONTROL_KEY_FILE_ENV, raising=False)
    first, second = comm.control_key(nnodes=1), comm.control_key(nnodes=1)
    assert len(first) == 32 and first != second


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "a multi-node group \\(2 nodes\\) needs the same control-channel key"),
        (b"short\n", "has 5 bytes; it needs at least 16"),
        ("missing", "cannot read the control-channel key"),
    ],
)
def test_a_multi_node_group_without_a_usable_key_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes | str | None, message: str
) -> None:
    monkeypatch.delenv(wire.CONTROL_KEY_FILE_ENV, raising=False)
    if content is not None:
        key_file = tmp_path / "key"
        if isinstance(content, bytes):
            key_file.write_bytes(content)
        monkeypatch.setenv(wire.CONTROL_KEY_FILE_ENV, str(key_file))
    with pytest.raises(ValueError, match=message):
        comm.control_key(nnodes=2)


def test_an_empty_or_short_key_is_never_used(listener: socket.socket) -> None:
    with pytest.raises(ValueError, match="too short"):
        comm.accept(listener, b"", TIMEOUT)
    with pytest.raises(ValueError, match="too short"):
        comm.connect(_address(listener), b"x" * 15, TIMEOUT)
