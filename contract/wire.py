"""The wire format of the multi-node control channel: typed, versioned frames, decoded without executing anything.

Both ends of the channel (the driver, rank 0, and every worker rank, possibly on other machines) agree
on this module; it is standard library only so that it can be read, tested and fuzzed without torch.

Frame (one per control message; all integers big-endian):

    magic      4 bytes   b"TPWC"
    version    u16       VERSION
    type       u16       a `MessageType`
    body_len   u32       length of the JSON body (at most MAX_BODY_BYTES)
    blob_len   u64       length of the tensor bytes that follow the body (at most MAX_BLOB_BYTES)
    body       JSON      {"f": {field: value}, "t": [[dtype, [dims...]], ...]}
    blob       bytes     every tensor's raw, C-contiguous bytes, in the order of "t", back to back

Values inside "f" are JSON (null, bool, int, float, str, list, object with string keys) plus two tagged
objects: {"$t": i} is the i-th tensor of "t" (a `RawTensor`: dtype name, shape and its slice of the
blob), and {"$r": name, "f": {...}} a record (`Record`: a named group of fields, which the engine maps
onto an allow-listed dataclass). Any other object key starting with "$" is refused.

Invariants:
- `decode` either returns a `Message` whose fields match `SCHEMAS[type]` exactly (names and kinds) or
  raises `WireError`, for any input bytes: unknown magic, version, type or dtype, truncated or trailing
  bytes, oversize lengths, malformed or too deeply nested JSON, NaN/Infinity, tensor sizes that do not
  add up to the blob. No pickle, no eval, no import, no constructor of the sender's choosing.
- A new message type or field is a new entry in `MessageType`/`SCHEMAS`; changing the meaning of an
  existing one needs a new VERSION (both ends then refuse each other with a clear error).
- The handshake (`challenge`/`proof`) runs before any frame is decoded: each side proves it holds the
  per-service key with an HMAC-SHA256 over both sides' fresh nonces (constant-time comparison), so
  neither a stray client nor a fake driver gets a message decoded. The key never crosses the network;
  on a multi-node group every node reads it from the file named by CONTROL_KEY_FILE_ENV (a Secret the
  operator mounts), on one machine the driver draws one and hands it to its local workers at spawn.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

MAGIC = b"TPWC"
VERSION = 1
HEADER = struct.Struct(">4sHHIQ")
MAX_BODY_BYTES = 16 << 20  # a step's metadata is a few KB; a 16 MiB body is not our peer
MAX_BLOB_BYTES = 8 << 30  # the largest tensors are a step's hidden rows
MAX_FRAME_BYTES = HEADER.size + MAX_BODY_BYTES + MAX_BLOB_BYTES
MAX_TENSOR_DIMS = 8

# Element sizes of the tensor dtypes the channel carries (names as torch spells them, without "torch.").
DTYPE_SIZES: Mapping[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}

# The per-service key: every node of a multi-node group reads it from this file (see the module docstring).
CONTROL_KEY_FILE_ENV = "TIDEPOOL_CONTROL_KEY_FILE"
CONTROL_KEY_MOUNT_PATH = "/etc/tidepool/control-key/key"  # where the operator is expected to mount the Secret
MIN_KEY_BYTES = 16
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
CHALLENGE = struct.Struct(f">4sH{NONCE_BYTES}s")  # driver -> worker: magic, version, driver nonce
RESPONSE = struct.Struct(f">{NONCE_BYTES}s{PROOF_BYTES}s")  # worker -> driver: worker nonce, worker proof


class WireError(ValueError):
    """Bytes that are not a valid control message of this version; the connection carrying them is closed."""


class MessageType(IntEnum):
    # worker -> driver
    HELLO = 1
    READY = 2
    ERROR = 3
    KV_LISTEN = 4  # a decode worker's KV receiver address (before READY)
    KV_STORED = 5  # a decode worker holds its whole slab of a transfer
    # driver -> worker
    INIT_KV = 16
    FORWARD = 17
    LOGITS = 18
    SHUTDOWN = 19
    LORA_SLOT = 20
    KV_SEND = 21  # prefill: push this rank's KV of these blocks to the decode engine at addr
    KV_FILL = 22  # decode: write the transfer's slab into these blocks
    KV_DROP = 23  # decode: forget the transfer's slab


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A tensor as it travels: dtype name (a DTYPE_SIZES key), shape, and its C-contiguous bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview

    def __post_init__(self) -> None:
        _check_tensor_spec(self.dtype, list(self.shape))
        nbytes = tensor_nbytes(self.dtype, self.shape)
        if memoryview(self.data).nbytes != nbytes:
            raise WireError(f"tensor {self.dtype}{list(self.shape)} needs {nbytes} bytes")


@dataclass(frozen=True, slots=True)
class Record:
    """A named group of fields (the engine maps the name onto an allow-listed dataclass)."""

    name: str
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Message:
    type: MessageType
    fields: dict[str, Any]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ints(v: object) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _is_floats(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)


def _list_of(kind: type) -> Callable[[object], bool]:
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) for x in v)


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


_KINDS: dict[str, Callable[[object], bool]] = {
    "int": _is_int,
    "int?": _optional(_is_int),
    "ints": _is_ints,
    "ints?": _optional(_is_ints),
    "floats": _is_floats,
    "str": lambda v: isinstance(v, str),
    "strs": _list_of(str),
    "tensor": lambda v: isinstance(v, RawTensor),
    "tensor?": _optional(lambda v: isinstance(v, RawTensor)),
    "tensors": _list_of(RawTensor),
    "record": lambda v: isinstance(v, Record),
}

# Every message type's fields and their kinds; a frame with a missing, extra or mistyped field is refused.
SCHEMAS: Mapping[MessageType, Mapping[str, str]] = {
    MessageType.HELLO: {"rank": "int", "pid": "int", "host": "str"},
    MessageType.READY: {"rank": "int"},
    MessageType.ERROR: {"rank": "int", "text": "str"},
    # P/D hand-off with tensor/pipeline parallelism (engine/kv_transfer/ranks.py); host "" = the driver's node.
    MessageType.KV_LISTEN: {"rank": "int", "host": "str", "port": "int"},
    MessageType.KV_STORED: {"rank": "int", "transfer_id": "str"},
    MessageType.KV_SEND: {"transfer_id": "str", "block_ids": "ints", "addr": "str"},
    MessageType.KV_FILL: {"transfer_id": "str", "block_ids": "ints"},
    MessageType.KV_DROP: {"transfer_id": "str"},
    MessageType.INIT_KV: {"num_blocks": "int"},
    MessageType.FORWARD: {
        "input_ids": "tensor",
        "positions": "tensor",
        "meta": "record",  # the step's attention metadata
        "scratch_shape": "ints?",  # the torch path's decode scratch, allocated on the worker
        "scratch_blocks": "int?",  # a scoring pass on scratch KV of this many blocks
        "lora_slots": "tensor?",  # int32 [tokens]: each token's LoRA slot (-1: base model); None: no adapter token
    },
    MessageType.LOGITS: {"hidden": "tensor"},
    MessageType.SHUTDOWN: {},
    # Fill one LoRA device slot on every rank of a stage with the adapter's modules of that stage's layers
    # (module i: layers[i], targets[i], unsharded a[i] [r, in] and scaled b[i] [out, r], scalings[i]); the
    # receiving rank keeps its tensor-parallel shard. Empty lists clear the slot. `rank`: the adapter's rank.
    MessageType.LORA_SLOT: {
        "slot": "int",
        "rank": "int",
        "layers": "ints",
        "targets": "strs",
        "a": "tensors",
        "b": "tensors",
        "scalings": "floats",
    },
}


def tensor_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]


def _check_tensor_spec(dtype: object, shape: object) -> None:
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise WireError(f"unknown tensor dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise WireError(f"bad tensor shape {shape!r}: at most {MAX_TENSOR_DIMS} non-negative integer dimensions")


def _check_fields(kind: MessageType, fields: Mapping[str, Any]) -> None:
    schema = SCHEMAS[kind]
    if set(fields) != set(schema):
        raise WireError(f"{kind.name} message has fields {sorted(fields)}, expected {sorted(schema)}")
    for name, field_kind in schema.items():
        if not _KINDS[field_kind](fields[name]):
            raise WireError(f"{kind.name} message field {name!r} is not of kind {field_kind}")


# ---- encoding ------------------------------------------------------------------------------------------------


def encode(kind: MessageType, fields: Mapping[str, Any]) -> bytes:
    """One frame; `fields` hold JSON values, `RawTensor`s and `Record`s (checked against the schema)."""
    _check_fields(kind, fields)
    specs: list[list[Any]] = []
    blobs: list[memoryview] = []

    def to_json(value: Any) -> Any:
        if isinstance(value, RawTensor):
            specs.append([value.dtype, list(value.shape)])
            blobs.append(memoryview(value.data).cast("B"))
            return {"$t": len(specs) - 1}
        if isinstance(value, Record):
            return {"$r": value.name, "f": {k: to_json(v) for k, v in value.fields.items()}}
        if isinstance(value, dict):
            if not all(isinstance(k, str) and not k.startswith("$") for k in value):
                raise WireError(f"object keys must be strings not starting with '$': {sorted(map(str, value))}")
            return {k: to_json(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [to_json(v) for v in value]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise WireError(f"a {type(value).__name__} cannot travel on the control channel")

    body = {"f": {k: to_json(v) for k, v in fields.items()}, "t": specs}
    try:
        raw = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
    except ValueError as err:
        raise WireError(f"cannot encode {kind.name}: {err}") from err
    blob_len = sum(b.nbytes for b in blobs)
    if len(raw) > MAX_BODY_BYTES or blob_len > MAX_BLOB_BYTES:
        raise WireError(f"{kind.name} message is too large ({len(raw)} body bytes, {blob_len} tensor bytes)")
    return b"".join([HEADER.pack(MAGIC, VERSION, kind, len(raw), blob_len), raw, *blobs])


# ---- decoding ------------------------------------------------------------------------------------------------


def _reject_constant(name: str) -> None:
    raise WireError(f"{name} is not allowed in a control message")


def _parse_header(view: memoryview) -> tuple[MessageType, int, int]:
    if view.nbytes < HEADER.size:
        raise WireError(f"truncated frame: {view.nbytes} bytes, the header alone is {HEADER.size}")
    magic, version, kind, body_len, blob_len = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"not a Tidepool control frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise WireError(f"control frame version {version}, this side speaks {VERSION}: run one Tidepool version")
    try:
        kind = MessageType(kind)
    except ValueError:
        raise WireError(f"unknown control message type {kind}") from None
    if body_len > MAX_BODY_BYTES or blob_len > MAX_BLOB_BYTES:
        raise WireError(f"oversize control frame: body {body_len} bytes, tensors {blob_len} bytes")
    expected = HEADER.size + body_len + blob_len
    if view.nbytes != expected:
        what = "truncated" if view.nbytes < expected else "trailing bytes after"
        raise WireError(f"{what} control frame: {view.nbytes} bytes, the header says {expected}")
    return kind, body_len, blob_len


def _tensors(specs: object, blob: memoryview) -> list[RawTensor]:
    if not isinstance(specs, list):
        raise WireError("the body's tensor list is malformed")
    tensors, offset = [], 0
    for spec in specs:
        if not isinstance(spec, list) or len(spec) != 2:
            raise WireError(f"malformed tensor spec {spec!r}")
        dtype, shape = spec
        _check_tensor_spec(dtype, shape)
        nbytes = tensor_nbytes(dtype, shape)
        if offset + nbytes > blob.nbytes:
            raise WireError(f"tensor {dtype}{shape} runs past the end of the frame's {blob.nbytes} tensor bytes")
        tensors.append(RawTensor(dtype, tuple(shape), blob[offset : offset + nbytes]))
        offset += nbytes
    if offset != blob.nbytes:
        raise WireError(f"the frame's tensors take {offset} bytes, its header says {blob.nbytes}")
    return tensors


def _resolve(value: Any, tensors: list[RawTensor]) -> Any:
    if isinstance(value, list):
        return [_resolve(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$t" in value:
        index = value["$t"]
        if len(value) != 1 or not _is_int(index) or not 0 <= index < len(tensors):
            raise WireError(f"bad tensor reference {value!r}")
        return tensors[index]
    if "$r" in value:
        name, fields = value.get("$r"), value.get("f")
        if len(value) != 2 or not isinstance(name, str) or not isinstance(fields, dict):
            raise WireError("malformed record")
        return Record(name, {k: _resolve(v, tensors) for k, v in fields.items()})
    if any(k.startswith("$") for k in value):
        raise WireError(f"unknown tagged object with keys {sorted(value)[:4]}")
    return {k: _resolve(v, tensors) for k, v in value.items()}


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse one frame (see the module docstring); raises `WireError` on anything else."""
    view = memoryview(data).cast("B")
    kind, body_len, _ = _parse_header(view)
    body_end = HEADER.size + body_len
    try:
        body = json.loads(bytes(view[HEADER.size : body_end]).decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WireError(f"malformed {kind.name} body: {err}") from None
    if not isinstance(body, dict) or set(body) != {"f", "t"} or not isinstance(body["f"], dict):
        raise WireError(f"malformed {kind.name} body: expected an object with 'f' and 't'")
    tensors = _tensors(body["t"], view[body_end:])
    try:
        fields = {k: _resolve(v, tensors) for k, v in body["f"].items()}
    except RecursionError:
        raise WireError(f"{kind.name} body is nested too deeply") from None
    _check_fields(kind, fields)
    return Message(kind, fields)


# ---- handshake -----------------------------------------------------------------------------------------------


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def challenge(nonce: bytes) -> bytes:
    """The driver's first bytes on a new connection: magic, version and its nonce."""
    return CHALLENGE.pack(MAGIC, VERSION, nonce)


def parse_challenge(data: bytes) -> bytes:
    """The worker's check of the driver's first bytes; returns the driver's nonce."""
    if len(data) != CHALLENGE.size:
        raise WireError(f"the control channel's greeting is {len(data)} bytes, expected {CHALLENGE.size}")
    magic, version, nonce = CHALLENGE.unpack(data)
    if magic != MAGIC:
        raise WireError(f"not a Tidepool control channel (magic {magic!r})")
    if version != VERSION:
        raise WireError(f"the driver speaks control version {version}, this worker {VERSION}: run one Tidepool version")
    return nonce


def proof(key: bytes, role: str, own_nonce: bytes, peer_nonce: bytes) -> bytes:
    """HMAC-SHA256 binding the role ("driver"/"worker"), the version and both nonces: replay-proof both ways."""
    message = b"tidepool-control|%d|%s|" % (VERSION, role.encode()) + own_nonce + peer_nonce
    return hmac.new(key, message, hashlib.sha256).digest()


def proof_matches(expected: bytes, offered: bytes) -> bool:
    return hmac.compare_digest(expected, offered)


def read_key_file(path: str) -> bytes:
    """The per-service key: the file's bytes without surrounding whitespace (a Secret mounted as a file)."""
    try:
        with open(path, "rb") as file:
            key = file.read(4096).strip()
    except OSError as err:
        raise ValueError(f"cannot read the control-channel key from {CONTROL_KEY_FILE_ENV}={path!r}: {err}") from err
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"the control-channel key in {path!r} has {len(key)} bytes; it needs at least {MIN_KEY_BYTES} "
            "(e.g. `head -c 32 /dev/urandom | base64`)"
        )
    return key
