"""Torch tensors and the engine's step dataclasses <-> the control channel's wire values (`contract/wire.py`).

The contract is torch-free: it carries a tensor as a `RawTensor` (dtype name, shape, raw bytes) and a
dataclass as a `Record` (name, fields). This module is the engine's side of that mapping:

- Tensors travel as their C-contiguous CPU bytes and come back as fresh, writable CPU tensors of the
  same dtype and shape (the receiver moves them to its device).
- Only the dataclasses in `RECORDS` travel, by name; a record of any other name, or with fields its
  class does not have, is a `WireError`, so the receiver never constructs a type of the sender's choosing.
  A new dataclass inside the step's metadata needs one entry here (both ends run the same code).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from tidepool.contract import wire
from tidepool.contract.wire import Message, MessageType, RawTensor, Record, WireError

from ..layers.attention_metadata import AttentionMetadata, PrefillChunk

RECORDS: Mapping[str, type] = {cls.__name__: cls for cls in (AttentionMetadata, PrefillChunk)}
_TORCH_DTYPES: Mapping[str, torch.dtype] = {name: getattr(torch, name) for name in wire.DTYPE_SIZES}
_DTYPE_NAMES: Mapping[torch.dtype, str] = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


def to_raw(tensor: torch.Tensor) -> RawTensor:
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise WireError(f"a {tensor.dtype} tensor cannot travel on the control channel")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return RawTensor(name, tuple(tensor.shape), memoryview(flat.view(torch.uint8).numpy()))


def from_raw(raw: RawTensor) -> torch.Tensor:
    dtype = _TORCH_DTYPES[raw.dtype]
    if not memoryview(raw.data).nbytes:
        return torch.empty(raw.shape, dtype=dtype)
    if dtype == torch.bool:  # any byte is a valid uint8; only 0 and 1 are valid bools
        return (torch.frombuffer(bytearray(raw.data), dtype=torch.uint8) != 0).reshape(raw.shape)
    return torch.frombuffer(bytearray(raw.data), dtype=dtype).reshape(raw.shape)


def to_wire(value: Any) -> Any:
    """Tensors become `RawTensor`s and allow-listed dataclasses `Record`s, recursively."""
    if isinstance(value, torch.Tensor):
        return to_raw(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if RECORDS.get(name) is not type(value):
            raise WireError(f"{type(value).__qualname__} is not a record the control channel carries")
        return Record(name, {f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def from_wire(value: Any) -> Any:
    """The inverse of `to_wire` for decoded values; unknown records are refused."""
    if isinstance(value, RawTensor):
        return from_raw(value)
    if isinstance(value, Record):
        cls = RECORDS.get(value.name)
        if cls is None:
            raise WireError(f"unknown record {value.name!r} on the control channel")
        names = {f.name for f in dataclasses.fields(cls)}
        if not set(value.fields) <= names:
            raise WireError(f"record {value.name} has unknown fields {sorted(set(value.fields) - names)}")
        try:
            return cls(**{k: from_wire(v) for k, v in value.fields.items()})
        except TypeError as err:  # a required field is missing
            raise WireError(f"record {value.name} is incomplete: {err}") from None
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: from_wire(v) for k, v in value.items()}
    return value


def encode(kind: MessageType, **fields: Any) -> bytes:
    return wire.encode(kind, {name: to_wire(value) for name, value in fields.items()})


def decode(data: bytes | bytearray | memoryview, expected: frozenset[MessageType]) -> Message:
    """One frame of an expected type, with torch tensors and dataclasses in its fields; else `WireError`."""
    message = wire.decode(data)
    if message.type not in expected:
        raise WireError(f"unexpected {message.type.name} message; expected {sorted(t.name for t in expected)}")
    return Message(message.type, {name: from_wire(value) for name, value in message.fields.items()})
