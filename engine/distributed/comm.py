"""The control channel between the driver and its workers, and moving step inputs across it.

Why a channel besides torch.distributed: the driver tells workers what to run (a step's input
ids, positions and attention metadata; a logits request; shutdown) at its own pace, and an
idle engine may wait hours between steps. A blocking TCP read has no timeout, while every
torch.distributed op does; so commands travel here and collectives only run inside a step.
A closed socket is also how a worker learns that the driver is gone (it exits), and how the
driver learns that a remote worker is gone.

Rendezvous: the driver hosts the torch.distributed TCPStore at master_addr:master_port and
publishes this channel's address and a random key in it; workers read both, connect, send the
key (checked with `hmac.compare_digest` before anything is unpickled) and then their rank.
Trust model: as for torch.distributed itself, the group's ports must be reachable only by the
group (e.g. a NetworkPolicy); the key keeps stray connections from being unpickled.

Framing: `multiprocessing.connection.Connection` messages carrying plain `pickle` (not
multiprocessing's pickler, whose shared-memory tensor passing does not cross machines).
Tensors are moved to the CPU before sending and to the rank's device after receiving.
"""

from __future__ import annotations

import dataclasses
import hmac
import pickle
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

STORE_KEY_ADDRESS = "tidepool/control_address"
STORE_KEY_SECRET = "tidepool/control_key"
_MAX_KEY_BYTES = 64
_KEEPALIVE_IDLE_S = 30


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def send_bytes(conn: Connection, payload: bytes) -> None:
    conn.send_bytes(payload)


def encode(message: Any) -> bytes:
    """Pickle once, send to several workers with `send_bytes`."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def connect(address: str, key: bytes, timeout: float) -> Connection:
    """Worker side: connect to the driver's channel and authenticate."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    _keepalive(sock)
    conn = Connection(sock.detach())
    conn.send_bytes(key)
    return conn


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle channel so that a driver whose node vanished (no FIN, no RST) ends the worker's wait
    within about a minute, instead of the kernel's two hours: the worker then exits and its probes fail."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux; other platforms keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def accept(server: socket.socket, key: bytes, timeout: float) -> Connection:
    """Driver side: accept one worker and check its key; raises TimeoutError or PermissionError."""
    server.settimeout(timeout)
    sock, _ = server.accept()
    sock.setblocking(True)  # Connection reads the raw fd: it must be blocking; poll() bounds the wait
    conn = Connection(sock.detach())
    if not conn.poll(timeout):
        conn.close()
        raise TimeoutError("a connection to the control channel sent no key")
    offered = conn.recv_bytes(_MAX_KEY_BYTES)
    if not hmac.compare_digest(offered, key):
        conn.close()
        raise PermissionError("a connection to the control channel offered a wrong key")
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
