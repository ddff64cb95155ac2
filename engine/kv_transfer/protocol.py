"""The KV hand-off between a prefill engine and a decode engine: what is sent and its wire format.

A prefill engine computes a prompt's KV and first token and sends them, as one *transfer*, to
the decode engine the router chose; the decode engine admits the request with that KV in its
own blocks and continues generation without recomputing the prompt.

Wire format (one TCP connection per transfer, all integers big-endian):

    magic      4 bytes   b"TPKV"
    version    u16       1
    header_len u32       length of the JSON header that follows
    header     JSON      {"transfer_id", "prompt_token_ids", "first_token_id", "block_size",
                          "layer_start", "layer_end", "dtype", "shape", "nbytes", "lora_name"}
    payload    nbytes    the KV tensor, C-contiguous, raw bytes

The KV tensor has shape ``[layer_end - layer_start, 2 (K, V), num_blocks, block_size,
num_kv_heads, head_dim]``: the prompt's blocks, in order (the last one may be partly used;
only ``len(prompt_token_ids)`` token slots are meaningful). The receiver answers with one
status byte (0 = stored, 1 = rejected) followed by a u32 length and a UTF-8 message, so a
sender always learns whether its transfer landed and why not. `lora_name` is the LoRA adapter the
prompt was prefilled with (null or absent: the base model); the decode engine admits the transfer only
for a request of that same adapter, which it must hold. The layer range leaves room for
pipeline-parallel senders that each ship their own stages' layers; today one transfer covers
all layers. Other connectors (NCCL, NIXL) can reuse `KVPayload` and keep the same semantics.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass

import torch

MAGIC = b"TPKV"
VERSION = 1
MAX_HEADER_BYTES = 64 << 20  # a 1M-token prompt's ids fit; anything larger is not our peer
_PREFIX = struct.Struct(">4sHI")
_STATUS = struct.Struct(">BI")
STATUS_OK, STATUS_REJECTED = 0, 1

_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (torch.float32, torch.float16, torch.bfloat16)}


class KVTransferError(RuntimeError):
    """A transfer could not be sent, received or admitted; the message says which side and why."""


@dataclass(slots=True)
class KVPayload:
    """One request's prompt KV and first token, as produced by a prefill engine."""

    transfer_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    block_size: int
    kv: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    layer_start: int = 0
    lora_name: str | None = None  # the LoRA adapter the KV was computed with (None: the base model)

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.kv.shape[0]


@dataclass(slots=True, frozen=True)
class KVGeometry:
    """What a receiver's cache looks like; a payload that does not fit is rejected, never half-stored."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def check(self, payload: KVPayload) -> None:
        kv = payload.kv
        expected = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        got = (payload.layer_end - payload.layer_start, kv.shape[1], payload.block_size, *kv.shape[4:])
        if payload.layer_start != 0 or got != expected or kv.shape[3] != payload.block_size:
            raise KVTransferError(
                f"transfer {payload.transfer_id}: KV of shape {list(kv.shape)} (layers {payload.layer_start}.."
                f"{payload.layer_end}, block size {payload.block_size}) does not fit this engine's cache "
                f"(layers 0..{self.num_layers}, block size {self.block_size}, {self.num_kv_heads} KV heads x "
                f"{self.head_dim}); prefill and decode must run the same model with the same --block-size"
            )
        if kv.dtype != self.dtype:
            raise KVTransferError(
                f"transfer {payload.transfer_id}: KV dtype {kv.dtype} differs from this engine's {self.dtype}; "
                "run prefill and decode with the same --dtype"
            )
        needed = -(-len(payload.prompt_token_ids) // payload.block_size)
        if kv.shape[2] != needed or not payload.prompt_token_ids:
            raise KVTransferError(
                f"transfer {payload.transfer_id}: {kv.shape[2]} blocks sent for a {len(payload.prompt_token_ids)}-"
                f"token prompt (expected {needed})"
            )


def write_payload(sock: socket.socket, payload: KVPayload) -> None:
    kv = payload.kv.contiguous()
    raw = kv.view(torch.uint8).reshape(-1).numpy()  # a view of the tensor's bytes, no copy
    header = json.dumps(
        {
            "transfer_id": payload.transfer_id,
            "prompt_token_ids": payload.prompt_token_ids,
            "first_token_id": payload.first_token_id,
            "block_size": payload.block_size,
            "layer_start": payload.layer_start,
            "layer_end": payload.layer_end,
            "dtype": str(kv.dtype).removeprefix("torch."),
            "shape": list(kv.shape),
            "nbytes": raw.nbytes,
            "lora_name": payload.lora_name,
        }
    ).encode()
    sock.sendall(_PREFIX.pack(MAGIC, VERSION, len(header)) + header)
    sock.sendall(memoryview(raw))


def read_payload(sock: socket.socket) -> KVPayload:
    magic, version, header_len = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if magic != MAGIC or version != VERSION:
        raise KVTransferError(f"not a Tidepool KV transfer (magic {magic!r}, version {version})")
    if header_len > MAX_HEADER_BYTES:
        raise KVTransferError(f"KV transfer header of {header_len} bytes is over the {MAX_HEADER_BYTES} limit")
    header = json.loads(_recv_exact(sock, header_len))
    try:
        dtype = _DTYPES[header["dtype"]]
        shape = [int(d) for d in header["shape"]]
        nbytes = int(header["nbytes"])
        if len(shape) != 6 or nbytes != _numel(shape) * dtype.itemsize:
            raise KVTransferError(f"KV transfer header is inconsistent: shape {shape}, {nbytes} bytes, {dtype}")
        data = bytearray(nbytes)
        _recv_into(sock, memoryview(data))
        kv = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape) if nbytes else torch.empty(shape)
        payload = KVPayload(
            transfer_id=str(header["transfer_id"]),
            prompt_token_ids=[int(t) for t in header["prompt_token_ids"]],
            first_token_id=int(header["first_token_id"]),
            block_size=int(header["block_size"]),
            kv=kv,
            layer_start=int(header["layer_start"]),
            lora_name=_optional_str(header.get("lora_name")),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise KVTransferError(f"malformed KV transfer header: {err}") from err
    if payload.layer_end != int(header["layer_end"]):
        raise KVTransferError("KV transfer header's layer range does not match its shape")
    return payload


def write_status(sock: socket.socket, status: int, message: str = "") -> None:
    body = message.encode()
    sock.sendall(_STATUS.pack(status, len(body)) + body)


def read_status(sock: socket.socket) -> tuple[int, str]:
    status, length = _STATUS.unpack(_recv_exact(sock, _STATUS.size))
    return status, _recv_exact(sock, length).decode(errors="replace")


def _optional_str(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"lora_name must be a string or null, got {type(value).__name__}")
    return value


def _numel(shape: list[int]) -> int:
    total = 1
    for dim in shape:
        if dim < 0:
            raise KVTransferError(f"negative dimension in KV shape {shape}")
        total *= dim
    return total


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise KVTransferError("peer closed the connection in the middle of a KV transfer")
        view = view[got:]
