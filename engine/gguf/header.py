"""A fast GGUF header parser: every metadata value decoded straight from the file's bytes.

Role: the metadata of a real model holds ~100k strings (the vocabulary and the BPE merges). The
`gguf` package's reader builds a numpy memmap view for every length and every string (~740k views
for SmolLM2, seconds of start-up); this module walks the header once with `struct` over one
`memoryview` of the mapped file, decodes each string once into a `str`, and reads numeric arrays
with one `np.frombuffer` each. `reader.py` uses it first and falls back to the `gguf` package on
anything it declines.

Invariants:
- For every file this module accepts, the values equal what ``gguf.GGUFReader``'s
  ``fields[key].contents()`` returns (Python ``str``/``int``/``float``/``bool`` scalars, lists for
  arrays, ``GGUF.version`` / ``GGUF.tensor_count`` / ``GGUF.kv_count`` included), and the tensors
  have the same names, types, shapes (GGUF ``ne`` order), data offsets and byte counts; a test
  compares both on synthetic files and on the real model.
- It accepts only what it can read exactly like the `gguf` package (little-endian files of
  version 2 or 3, scalar/string/flat arrays); anything else (a big-endian file, a nested array, an
  unknown value or tensor type, a truncated header, invalid UTF-8, duplicate keys or tensor names,
  a bad alignment) raises `HeaderDeclined` or a `ValueError`/`struct.error`, never returns a
  partial header: the caller then asks the `gguf` package, whose error messages are the user-facing ones.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# GGUFValueType ids -> (little-endian numpy dtype, struct format) of the scalar types; STRING = 8, ARRAY = 9.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALARS: dict[int, np.dtype] = {kind: np.dtype("<" + fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_STRUCTS = {kind: struct.Struct("<" + fmt) for kind, fmt in _SCALAR_FORMATS.items()}
STRING, ARRAY, UINT32 = 8, 9, 4


class HeaderDeclined(ValueError):
    """The file is valid GGUF (or maybe not) in a form this parser leaves to the `gguf` package."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor-info record: name, GGML type, dims in GGUF ``ne`` order, absolute data offset, bytes."""

    name: str
    type: GGMLQuantizationType
    dims: tuple[int, ...]
    data_offset: int
    n_bytes: int


@dataclass(frozen=True, slots=True)
class Header:
    values: dict[str, Any]  # every metadata key, decoded, in file order
    tensors: list[TensorEntry]  # in file order
    data_offset: int  # where the (aligned) tensor data starts


class _Cursor:
    """Reads little-endian values from `buf` at a moving offset; every read is bounds-checked."""

    __slots__ = ("buf", "offset", "size")

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.offset, self.size = buf, 0, len(buf)

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.offset)  # struct.error past the end
        self.offset += 4
        return value

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.offset)
        self.offset += 8
        return value

    def string(self) -> str:
        length = self.u64()
        end = self.offset + length
        if end > self.size:
            raise HeaderDeclined(f"a string runs past the end of the file (byte {end} of {self.size})")
        text = str(self.buf[self.offset : end], "utf-8")
        self.offset = end
        return text

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings: the hot loop (one slice and one decode per string)."""
        buf, offset, size, unpack = self.buf, self.offset, self.size, _U64.unpack_from
        out: list[str] = [""] * count
        for i in range(count):
            (length,) = unpack(buf, offset)
            start = offset + 8
            offset = start + length
            if offset > size:
                raise HeaderDeclined(f"a string runs past the end of the file (byte {offset} of {size})")
            out[i] = str(buf[start:offset], "utf-8")
        self.offset = offset
        return out

    def scalar(self, kind: int) -> Any:
        packer = _STRUCTS[kind]
        (value,) = packer.unpack_from(self.buf, self.offset)
        self.offset += packer.size
        return value

    def array(self, kind: int, count: int) -> list[Any]:
        dtype = _SCALARS[kind]
        end = self.offset + count * dtype.itemsize
        if end > self.size:
            raise HeaderDeclined(f"an array runs past the end of the file (byte {end} of {self.size})")
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offset).tolist()
        self.offset = end
        return values

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind in _STRUCTS:
            return self.scalar(kind)
        if kind != ARRAY:
            raise HeaderDeclined(f"unknown metadata value type {kind}")
        item_kind, count = self.u32(), self.u64()
        if item_kind == STRING:
            return self.strings(count)
        if item_kind in _SCALARS:
            return self.array(item_kind, count)
        raise HeaderDeclined(f"metadata arrays of type {item_kind} are left to the gguf package")


def parse_header(buf: memoryview) -> Header:
    """The header of the GGUF file whose bytes are `buf` (see the module docstring for what is declined)."""
    cursor = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise HeaderDeclined("no GGUF magic")
    cursor.offset = 4
    version = cursor.u32()
    if version not in SUPPORTED_VERSIONS:
        raise HeaderDeclined(f"version {version} (big-endian, or unknown) is left to the gguf package")
    tensor_count, kv_count = cursor.u64(), cursor.u64()
    values: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    types: dict[str, int] = {}
    for _ in range(kv_count):
        key = cursor.string()
        if key in values:
            raise HeaderDeclined(f"duplicate metadata key {key!r}")
        types[key] = cursor.u32()
        values[key] = cursor.value(types[key])
    entries: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.u32()
        dims = tuple(cursor.u64() for _ in range(n_dims))
        entries.append((name, cursor.u32(), dims, cursor.u64()))
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in values:
        alignment = values["general.alignment"]
        if types["general.alignment"] != UINT32 or alignment == 0 or alignment & (alignment - 1):
            raise HeaderDeclined("general.alignment is not a power-of-two uint32")
    data_offset = -(-cursor.offset // alignment) * alignment
    return Header(values, _tensors(entries, data_offset), data_offset)


def _tensors(entries: list[tuple[str, int, tuple[int, ...], int]], data_offset: int) -> list[TensorEntry]:
    tensors: list[TensorEntry] = []
    names: set[str] = set()
    for name, type_id, dims, offset in entries:
        if name in names:
            raise HeaderDeclined(f"duplicate tensor {name!r}")
        names.add(name)
        kind = GGMLQuantizationType(type_id)  # ValueError for a type id the gguf package does not know
        block_size, type_size = GGML_QUANT_SIZES[kind]
        n_elements = 1
        for dim in dims:
            n_elements *= dim
        tensors.append(TensorEntry(name, kind, dims, data_offset + offset, n_elements * type_size // block_size))
    return tensors
