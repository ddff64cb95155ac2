"""The KV hand-off between a prefill engine and a decode engine: what is sent and its wire format.

A prefill engine computes a prompt's KV and first token and sends them, as one *transfer*, to the
decode engine the router chose; the decode engine admits the request with that KV in its own blocks
and continues generation without recomputing the prompt. With tensor/pipeline parallelism every
rank holds a slab of the KV (its layers, its heads; layout.py): each prefill rank pushes *pieces* of
its slab straight to the decode ranks that cache them, and the prefill driver sends the *manifest*
(prompt, first token, adapter) to the decode driver, which answers it once every decode rank holds
its whole slab.

Wire format (one TCP connection per frame, all integers big-endian):

    magic      4 bytes   b"TPKV"
    version    u16       VERSION
    header_len u32       length of the JSON header that follows (at most the receiver's limit)
    header     JSON      an object; "kind" says which of:
      "layout"    a question to a decode driver: its `KVLayout` and each rank's address
      "piece"     {"transfer_id", "layers": [start, stop], "heads": [start, stop], "num_blocks",
                   "block_size", "head_dim", "dtype"}, followed by the piece's raw bytes: a C-contiguous
                   tensor [layers, 2 (K, V), num_blocks, block_size, heads, head_dim]
      "manifest"  {"transfer_id", "prompt_token_ids", "first_token_id", "num_blocks", "lora_name"}

The receiver answers every frame with one status byte (0 = ok, 1 = rejected), a u32 length and a
UTF-8 message (the layout, as JSON, for "layout"), so a sender always learns whether its frame
landed and why not. `lora_name` is the LoRA adapter the prompt was prefilled with (null: the base
model); the decode engine admits the transfer only for a request of that same adapter.

Invariant (the security review's): every header field is checked against the receiver's own limits
(`FrameLimits`: its header size, its block count, its slab, its dtype) before anything is allocated
from it, and any malformed frame — bad JSON, a wrong type, an impossible size — raises
`KVTransferError`, which the receiver answers as a rejection; nothing a peer sends can make it allocate
more than one slab's worth of its own cache or end its handler thread.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"TPKV"
VERSION = 2
_PREFIX = struct.Struct(">4sHI")
_STATUS = struct.Struct(">BI")
STATUS_OK, STATUS_REJECTED = 0, 1
MAX_STATUS_BYTES = 1 << 20
MAX_TRANSFER_ID = 128

DTYPES = {str(dt).removeprefix("torch."): dt for dt in (torch.float32, torch.float16, torch.bfloat16)}


class KVTransferError(RuntimeError):
    """A transfer could not be sent, received or admitted; the message says which side and why."""


@dataclass(slots=True)
class KVPayload:
    """One request's prompt, first token and the KV slab of the rank that holds it (all of it without TP/PP)."""

    transfer_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    block_size: int
    kv: torch.Tensor  # [layers, 2, num_blocks, block_size, heads, head_dim]: this rank's slab
    layer_start: int = 0
    lora_name: str | None = None  # the LoRA adapter the KV was computed with (None: the base model)

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.kv.shape[0]


@dataclass(slots=True, frozen=True)
class Manifest:
    """The request side of a transfer (the decode driver's): what the KV belongs to."""

    transfer_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    num_blocks: int
    lora_name: str | None = None


@dataclass(slots=True, frozen=True)
class PieceHeader:
    transfer_id: str
    layers: range
    heads: range
    num_blocks: int


@dataclass(slots=True, frozen=True)
class LayoutQuery:
    """A sender asking a decode driver for its layout and rank addresses."""


@dataclass(slots=True, frozen=True)
class FrameLimits:
    """What one receiving rank accepts: its slab, its cache's geometry and sizes."""

    layers: range
    heads: range
    block_size: int
    head_dim: int
    dtype: torch.dtype
    max_blocks: int  # blocks of one request: at most the rank's cache and ceil(max_model_len / block_size)
    vocab_size: int
    accepts_manifest: bool  # only the decode driver takes manifests and layout questions

    @property
    def max_header_bytes(self) -> int:
        # A prompt of max_blocks full blocks, each id at most 11 characters with its separator, plus the rest.
        return 4096 + 12 * self.max_blocks * self.block_size

    def piece_shape(self, header: PieceHeader) -> list[int]:
        return [len(header.layers), 2, header.num_blocks, self.block_size, len(header.heads), self.head_dim]


def write_piece(sock: socket.socket, header: PieceHeader, block_size: int, kv: torch.Tensor) -> None:
    kv = kv.contiguous()
    fields = {"kind": "piece", "transfer_id": header.transfer_id, "layers": [header.layers.start, header.layers.stop],
              "heads": [header.heads.start, header.heads.stop], "num_blocks": header.num_blocks,
              "block_size": block_size, "head_dim": kv.shape[-1],
              "dtype": str(kv.dtype).removeprefix("torch.")}  # fmt: skip
    _write_header(sock, fields)
    sock.sendall(memoryview(kv.view(torch.uint8).reshape(-1).numpy()))  # the tensor's bytes, no copy


def write_manifest(sock: socket.socket, manifest: Manifest) -> None:
    _write_header(sock, {"kind": "manifest", "transfer_id": manifest.transfer_id,
                         "prompt_token_ids": manifest.prompt_token_ids, "first_token_id": manifest.first_token_id,
                         "num_blocks": manifest.num_blocks, "lora_name": manifest.lora_name})  # fmt: skip


def write_layout_query(sock: socket.socket) -> None:
    _write_header(sock, {"kind": "layout"})


def _write_header(sock: socket.socket, fields: dict[str, Any]) -> None:
    body = json.dumps(fields).encode()
    sock.sendall(_PREFIX.pack(MAGIC, VERSION, len(body)) + body)


def read_frame(sock: socket.socket, limits: FrameLimits) -> LayoutQuery | Manifest | tuple[PieceHeader, torch.Tensor]:
    """The next frame, checked against `limits` before anything is allocated from it; KVTransferError if bad."""
    magic, version, header_len = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if magic != MAGIC or version != VERSION:
        raise KVTransferError(f"not a Tidepool KV transfer of version {VERSION} (magic {magic!r}, version {version})")
    if header_len > limits.max_header_bytes:
        raise KVTransferError(
            f"KV transfer header of {header_len} bytes is over this engine's {limits.max_header_bytes}"
        )
    try:
        header = json.loads(_recv_exact(sock, header_len))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise KVTransferError(f"KV transfer header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise KVTransferError("KV transfer header must be a JSON object")
    kind = header.get("kind")
    if kind in ("layout", "manifest") and not limits.accepts_manifest:
        raise KVTransferError(f"a {kind!r} frame goes to the decode engine's driver (rank 0), not to this rank")
    if kind == "layout":
        return LayoutQuery()
    if kind == "manifest":
        return _manifest(header, limits)
    if kind == "piece":
        piece = _piece_header(header, limits)
        kv = torch.empty(limits.piece_shape(piece), dtype=limits.dtype)
        _recv_into(sock, memoryview(kv.view(torch.uint8).reshape(-1).numpy()))
        return piece, kv
    raise KVTransferError(f"KV transfer header kind must be 'layout', 'piece' or 'manifest', got {kind!r}")


def _manifest(header: dict[str, Any], limits: FrameLimits) -> Manifest:
    transfer_id = _transfer_id(header)
    prompt = header.get("prompt_token_ids")
    if not isinstance(prompt, list) or not prompt or len(prompt) > limits.max_blocks * limits.block_size:
        raise KVTransferError(f"transfer {transfer_id}: prompt_token_ids must be a non-empty list that fits the cache")
    ids = [_int(header, "prompt_token_ids", t, 0, limits.vocab_size - 1) for t in prompt]
    num_blocks = _int(header, "num_blocks", header.get("num_blocks"), 1, limits.max_blocks)
    if num_blocks != math.ceil(len(ids) / limits.block_size):
        raise KVTransferError(f"transfer {transfer_id}: {num_blocks} blocks for a {len(ids)}-token prompt")
    lora = header.get("lora_name")
    if lora is not None and not isinstance(lora, str):
        raise KVTransferError(f"transfer {transfer_id}: lora_name must be a string or null")
    first = _int(header, "first_token_id", header.get("first_token_id"), 0, limits.vocab_size - 1)
    return Manifest(transfer_id, ids, first, num_blocks, lora)


def _piece_header(header: dict[str, Any], limits: FrameLimits) -> PieceHeader:
    transfer_id = _transfer_id(header)
    for name, mine in (("block_size", limits.block_size), ("head_dim", limits.head_dim)):
        if header.get(name) != mine:
            raise KVTransferError(
                f"transfer {transfer_id}: KV {name} {header.get(name)!r} differs from this engine's {mine}; "
                "prefill and decode must run the same model with the same --block-size"
            )
    dtype = str(limits.dtype).removeprefix("torch.")
    if header.get("dtype") != dtype:
        raise KVTransferError(
            f"transfer {transfer_id}: KV dtype {header.get('dtype')!r} differs from this engine's {dtype}; "
            "run prefill and decode with the same --dtype"
        )
    layers = _range(header, "layers", limits.layers)
    heads = _range(header, "heads", limits.heads)
    num_blocks = _int(header, "num_blocks", header.get("num_blocks"), 1, limits.max_blocks)
    return PieceHeader(transfer_id, layers, heads, num_blocks)


def _transfer_id(header: dict[str, Any]) -> str:
    value = header.get("transfer_id")
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TRANSFER_ID:
        raise KVTransferError(f"KV transfer header's transfer_id must be a string of 1..{MAX_TRANSFER_ID} characters")
    return value


def _int(header: dict[str, Any], name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise KVTransferError(
            f"transfer {header.get('transfer_id')!r}: {name} must hold integers in [{low}, {high}], got {value!r}"
        )
    return value


def _range(header: dict[str, Any], name: str, within: range) -> range:
    value = header.get(name)
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
        raise KVTransferError(f"transfer {header.get('transfer_id')!r}: {name} must be [start, stop]")
    start, stop = value
    if not within.start <= start < stop <= within.stop:
        raise KVTransferError(
            f"transfer {header.get('transfer_id')!r}: {name} {start}..{stop} is not inside this rank's "
            f"{within.start}..{within.stop}; prefill and decode must run the same model"
        )
    return range(start, stop)


def write_status(sock: socket.socket, status: int, message: str = "") -> None:
    body = message.encode()[:MAX_STATUS_BYTES]
    sock.sendall(_STATUS.pack(status, len(body)) + body)


def read_status(sock: socket.socket) -> tuple[int, str]:
    status, length = _STATUS.unpack(_recv_exact(sock, _STATUS.size))
    if length > MAX_STATUS_BYTES:
        raise KVTransferError(f"a KV status message of {length} bytes is over the {MAX_STATUS_BYTES} limit")
    return status, _recv_exact(sock, length).decode(errors="replace")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    view = view.cast("B")
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise KVTransferError("peer closed the connection in the middle of a KV transfer")
        view = view[got:]
