"""Open a GGUF file, check it, and answer metadata and tensor questions.

Role: the only place that opens GGUF files. The header is read by `header.py`'s fast parser (one
pass over the mapped bytes, each vocabulary string decoded once: ~0.1 s for SmolLM2's 49k tokens and
49k merges where the `gguf` package's per-string numpy views took seconds). Anything that parser
declines (a bad file, a big-endian one, a nested array) is read again by `gguf.GGUFReader`, the
reference: its exceptions (numpy reshape errors on a truncated file, "GGUF magic invalid", unknown
enum values) become one `GGUFError` that names the file, so bad files get the same messages as
before. A file is parsed once per process and shared by the config, tokenizer and weight loaders
(keyed on path, size and modification time, so a rewritten file is parsed again).

Invariants: a `GGUFFile` that exists was fully parsed, every tensor's bytes lie inside the file, and
shapes are in torch order (outermost first: a matrix is ``[rows, cols]`` = ``[out, in]``), the
reverse of GGUF's ``ne`` order.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import quant_shape_to_byte_shape

from .detect import MAGIC
from .errors import GGUFError
from .header import Header, TensorEntry, parse_header

# Decoded by Tidepool's own torch code; the quantized ones can also stay quantized.
NATIVE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# Decoded with the `gguf` package's numpy reference dequantizers (always dequantized).
REFERENCE_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = NATIVE_TYPES + REFERENCE_TYPES
# GGML types the `gguf` package exposes as typed arrays (the rest are uint8 rows of blocks).
_PLAIN_DTYPES = {
    name: np.dtype(kind)
    for name, kind in (("F16", np.float16), ("F32", np.float32), ("F64", np.float64), ("I8", np.int8),
                       ("I16", np.int16), ("I32", np.int32), ("I64", np.int64))
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as stored: its GGML type, torch-order shape and the raw (memory-mapped) data."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray  # float arrays for F32/F16, else uint8 rows of blocks (gguf's byte shape)

    @property
    def type_name(self) -> str:
        return self.type.name


class GGUFFile:
    """A parsed GGUF file: metadata values by key and tensors by name.

    Built from the fast parser's `Header` (every value already decoded) or, as the fallback, from a
    `GGUFReader` (values decoded on first use); both answer the same.
    """

    def __init__(
        self, path: Path, reader: GGUFReader | None = None, header: Header | None = None, data: np.ndarray | None = None
    ) -> None:
        """From `reader`, or from `header` and `data` (the whole file, memory-mapped as uint8)."""
        self.path = path
        self.parsed_by = "gguf" if reader is not None else "tidepool"  # which parser read the header (diagnostics)
        self._fields: dict[str, Any] = dict(reader.fields) if reader is not None else {}
        self._values: dict[str, Any] = dict(header.values) if header is not None else {}
        self.tensors: dict[str, TensorInfo] = {}
        if reader is not None:
            for tensor in reader.tensors:
                shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
                self.tensors[tensor.name] = TensorInfo(tensor.name, tensor.tensor_type, shape, tensor.data)
        elif header is not None and data is not None:
            for entry in header.tensors:
                self.tensors[entry.name] = TensorInfo(entry.name, entry.type, entry.dims[::-1], _raw(data, entry))

    def has(self, key: str) -> bool:
        return key in self._values or key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._values and key not in self._fields:
            return default
        if key not in self._values:
            try:
                self._values[key] = self._fields[key].contents()
            except (ValueError, UnicodeDecodeError, IndexError) as err:
                raise GGUFError(f"{self.path}: metadata {key!r} cannot be decoded ({err})") from None
        return self._values[key]

    def require(self, key: str, why: str = "") -> Any:
        value = self.get(key)
        if value is None:
            reason = f" ({why})" if why else ""
            raise GGUFError(f"{self.path}: required metadata {key!r} is missing{reason}")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture", "the model architecture"))

    def check_types(self, names: list[str] | None = None) -> None:
        """Raise `GGUFError` naming the first tensor whose type Tidepool cannot decode."""
        for name in names if names is not None else list(self.tensors):
            tensor = self.tensors[name]
            if tensor.type_name not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} has type {tensor.type_name}, which Tidepool cannot load; "
                    f"supported tensor types: {', '.join(SUPPORTED_TYPES)}"
                )


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file (cached per process while the file is unchanged); `GGUFError` if it is not valid GGUF."""
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    stat = file.stat()
    return _open_cached(file, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)
def _open_cached(file: Path, size: int, mtime_ns: int) -> GGUFFile:
    with file.open("rb") as handle:
        head = handle.read(8)
    if head[:4] != MAGIC:
        raise GGUFError(
            f"{file} is not a GGUF file: it starts with {head[:4]!r}, not the GGUF magic {MAGIC!r} "
            "(give a .gguf file from llama.cpp's converter, or a Hugging Face model folder)"
        )
    try:
        data = np.memmap(file, mode="r")  # mapped, not read: only the header's pages are touched here
        header = parse_header(memoryview(data))
        if all(t.data_offset + t.n_bytes <= size for t in header.tensors):
            return GGUFFile(file, header=header, data=data)
    except (ValueError, IndexError, KeyError, OverflowError, OSError, struct.error):
        pass  # declined: the reference reader below decides, and words any error
    try:
        reader = GGUFReader(str(file))
    except (ValueError, IndexError, KeyError, OverflowError, OSError, TypeError) as err:
        raise GGUFError(f"{file} ({size} bytes) is not a valid GGUF file: {_describe(err, size)}") from None
    gguf_file = GGUFFile(file, reader=reader)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise GGUFError(
                f"{file} is truncated: tensor {tensor.name!r} ends at byte {end}, but the file has {size} bytes"
            )
    return gguf_file


def _raw(data: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes as the `gguf` package shapes them: typed for float/int types, else uint8 block rows."""
    shape = entry.dims[::-1]
    dtype = _PLAIN_DTYPES.get(entry.type.name)
    if dtype is None:
        dtype, shape = np.dtype(np.uint8), quant_shape_to_byte_shape(shape, entry.type)
    return data[entry.data_offset : entry.data_offset + entry.n_bytes].view(dtype).reshape(shape)


def _describe(err: BaseException, size: int) -> str:
    text = str(err)
    if "is not a valid GGMLQuantizationType" in text:
        found = re.search(r"(\d+)\)? is not a valid", text)  # "99 is not ..." or "np.uint32(99) is not ..."
        value = found.group(1) if found else text.split(" ", 1)[0]
        return (
            f"a tensor has type id {value}, unknown to the gguf package {_gguf_version()}; "
            f"supported tensor types: {', '.join(SUPPORTED_TYPES)}"
        )
    if "version" in text.lower():
        return text
    return f"the file is truncated or corrupt ({type(err).__name__}: {text}; {size} bytes on disk)"


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"
