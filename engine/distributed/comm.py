"""The control channel between the driver and its workers: authenticated, typed messages, no pickle.

Why a channel besides torch.distributed: the driver tells workers what to run (a step's input
ids, positions and attention metadata; a logits request; shutdown) at its own pace, and an
idle engine may wait hours between steps. A blocking TCP read has no timeout, while every
torch.distributed op does; so commands travel here and collectives only run inside a step.
A closed socket is also how a worker learns that the driver is gone (it exits), and how the
driver learns that a remote worker is gone.

Rendezvous: the driver hosts the torch.distributed TCPStore at master_addr:master_port and
publishes this channel's address in it (only the address: anyone who reaches the store's port can
read and write it). Workers read the address and connect.

Authentication, before any frame is decoded (`contract/wire.py` computes, this module does the I/O):
the driver sends its nonce, the worker answers with its own nonce and an HMAC of both under the
per-service key, the driver checks it (constant time) and answers with its own HMAC, which the worker
checks. So a stray client gets nothing decoded, and a worker pointed at a fake driver (a rewritten
store entry) refuses it. The key never travels through the store or the channel: `control_key` reads
it from the file named by $TIDEPOOL_CONTROL_KEY_FILE (on a multi-node group every node must have the
same one: the operator mounts a per-service Secret), or, on one machine without that variable, draws
a random one that the driver hands to its local workers in their spawn arguments.

Framing: `multiprocessing.connection.Connection` length-prefixed messages (never its `send`/`recv`,
which pickle), each carrying one frame of `contract.wire` (fixed header, JSON body, tensors as raw
bytes; `wire_codec` maps torch tensors and the step's dataclasses). Frames longer than
`wire.MAX_FRAME_BYTES` are refused before they are read. A frame that does not decode raises
`WireError`; the receiver closes that connection. Tensors are moved to the CPU before sending and
to the rank's device after receiving.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from tidepool.contract import wire
from tidepool.contract.wire import Message, MessageType, WireError

from . import wire_codec

STORE_KEY_ADDRESS = "tidepool/control_address"
_KEEPALIVE_IDLE_S = 30


def control_key(nnodes: int) -> bytes:
    """The channel's key: from $TIDEPOOL_CONTROL_KEY_FILE, else (one node only) a fresh random key."""
    path = os.environ.get(wire.CONTROL_KEY_FILE_ENV)
    if path:
        return wire.read_key_file(path)
    if nnodes > 1:
        raise ValueError(
            f"a multi-node group ({nnodes} nodes) needs the same control-channel key on every node: set "
            f"{wire.CONTROL_KEY_FILE_ENV} to a file holding it (at least {wire.MIN_KEY_BYTES} bytes; the operator "
            f"mounts a per-service Secret at {wire.CONTROL_KEY_MOUNT_PATH}). The key never travels through the "
            "rendezvous store, which anyone reaching its port can read."
        )
    return secrets.token_bytes(32)


def _check_key(key: bytes) -> None:
    if len(key) < wire.MIN_KEY_BYTES:
        raise ValueError(f"a control-channel key of {len(key)} bytes is too short (at least {wire.MIN_KEY_BYTES})")


def encode(kind: MessageType, **fields: Any) -> bytes:
    """Encode once, send to several workers with `send_bytes`."""
    return wire_codec.encode(kind, **fields)


def send(conn: Connection, kind: MessageType, **fields: Any) -> None:
    conn.send_bytes(wire_codec.encode(kind, **fields))


def send_bytes(conn: Connection, payload: bytes) -> None:
    conn.send_bytes(payload)


def recv(conn: Connection, *expected: MessageType) -> Message:
    """The next message, of one of the `expected` types; EOFError/OSError when the peer is gone, else WireError."""
    return wire_codec.decode(conn.recv_bytes(wire.MAX_FRAME_BYTES), frozenset(expected))


def _recv_exact(conn: Connection, size: int, timeout: float, what: str) -> bytes:
    if not conn.poll(timeout):
        raise PermissionError(f"the control channel's peer sent no {what} within {timeout:.0f} s")
    data = conn.recv_bytes(size)  # OSError when longer
    if len(data) != size:
        raise WireError(f"the control channel's {what} is {len(data)} bytes, expected {size}")
    return data


def connect(address: str, key: bytes, timeout: float) -> Connection:
    """Worker side: connect to the driver's channel; both sides prove they hold `key` (else PermissionError)."""
    _check_key(key)
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    _keepalive(sock)
    conn = Connection(sock.detach())
    try:
        driver_nonce = wire.parse_challenge(_recv_exact(conn, wire.CHALLENGE.size, timeout, "greeting"))
        own = wire.new_nonce()
        conn.send_bytes(wire.RESPONSE.pack(own, wire.proof(key, "worker", own, driver_nonce)))
        offered = _recv_exact(conn, wire.PROOF_BYTES, timeout, "proof")
        if not wire.proof_matches(wire.proof(key, "driver", driver_nonce, own), offered):
            raise PermissionError(
                f"the control channel at {address} does not hold this worker's key: check that every node "
                f"reads the same {wire.CONTROL_KEY_FILE_ENV} and that --master-addr names the driver"
            )
    except (OSError, EOFError, WireError) as err:
        conn.close()
        if isinstance(err, PermissionError):
            raise
        raise PermissionError(f"handshake with the control channel at {address} failed: {err}") from err
    return conn


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle channel so that a driver whose node vanished (no FIN, no RST) ends the worker's wait
    within about a minute, instead of the kernel's two hours: the worker then exits and its probes fail."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux; other platforms keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def accept(server: socket.socket, key: bytes, timeout: float) -> Connection:
    """Driver side: accept one worker and run the handshake; raises TimeoutError (no connection) or
    PermissionError (a connection that did not prove it holds the key; it is closed)."""
    _check_key(key)
    server.settimeout(timeout)
    sock, peer = server.accept()
    sock.setblocking(True)  # Connection reads the raw fd: it must be blocking; poll() bounds the wait
    conn = Connection(sock.detach())
    try:
        own = wire.new_nonce()
        conn.send_bytes(wire.challenge(own))
        worker_nonce, offered = wire.RESPONSE.unpack(_recv_exact(conn, wire.RESPONSE.size, timeout, "key proof"))
        if not wire.proof_matches(wire.proof(key, "worker", worker_nonce, own), offered):
            raise PermissionError(f"a connection to the control channel from {peer} offered a wrong key")
        conn.send_bytes(wire.proof(key, "driver", own, worker_nonce))
    except (OSError, EOFError, WireError) as err:
        conn.close()
        if isinstance(err, PermissionError):
            raise
        raise PermissionError(f"a connection to the control channel from {peer} failed its handshake: {err}") from err
    return conn


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to every tensor inside dataclasses, lists and tuples (the attention metadata)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    return value
