"""Tidepool's fast GGUF header parser reads exactly what the `gguf` package reads, or leaves the file to it.

The reference is ``gguf.GGUFReader`` wrapped as before (values from ``fields[key].contents()``,
tensors from ``reader.tensors``). Compared on the synthetic files the loader tests use (every native
tensor type, every model variant's metadata), on a file with every metadata value type, on the real
SmolLM2 file, and on files the fast parser declines (big-endian, nested arrays, invalid UTF-8,
truncated vocabulary), which still open, or fail with the reference's `GGUFError`, as before.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tidepool.engine.gguf.errors import GGUFError
from tidepool.engine.gguf.header import HeaderDeclined, parse_header
from tidepool.engine.gguf.reader import GGUFFile, open_gguf

V = gguf.GGUFValueType


def _reference(path: Path) -> GGUFFile:
    return GGUFFile(path.resolve(), reader=gguf.GGUFReader(str(path)))


def _assert_same(fast: GGUFFile, ref: GGUFFile) -> None:
    keys = list(ref._fields)
    assert fast.parsed_by == "tidepool" and ref.parsed_by == "gguf"
    assert list(fast._values) == keys  # same keys, same order (GGUF.version / tensor_count / kv_count first)
    for key in keys:
        ours, theirs = fast.get(key), ref.get(key)
        assert type(ours) is type(theirs) and ours == theirs, key
        if isinstance(ours, list):
            assert [type(v) for v in ours] == [type(v) for v in theirs], key
    assert list(fast.tensors) == list(ref.tensors)
    for name, ours in fast.tensors.items():
        theirs = ref.tensors[name]
        assert (ours.type, ours.shape) == (theirs.type, theirs.shape), name
        assert type(ours.raw) is type(theirs.raw) and ours.raw.dtype == theirs.raw.dtype, name
        assert ours.raw.shape == theirs.raw.shape and np.array_equal(ours.raw, theirs.raw, equal_nan=True), name


@pytest.mark.parametrize(
    ("variant", "type_name"),
    [("llama-gqa", "F32"), ("llama-gqa", "F16"), ("llama-mqa-tied-llama3rope", "Q8_0"),
     ("qwen2-tied", "Q4_0"), ("llama-headdim24-linearrope", "Q4_1"), ("llama-gqa", "Q5_0")],
)  # fmt: skip
def test_synthetic_files_read_the_same(gguf_model, variant: str, type_name: str, tmp_path: Path) -> None:
    path = Path(shutil.copy(gguf_model(variant, type_name), tmp_path / "model.gguf"))  # a fresh cache entry
    fast = open_gguf(path)
    _assert_same(fast, _reference(path))
    assert len(fast.get("tokenizer.ggml.tokens")) > 256 and fast.get("tokenizer.ggml.merges")


def _every_value_type(writer: gguf.GGUFWriter) -> None:
    writer.add_uint8("t.u8", 255)
    writer.add_int8("t.i8", -128)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -32768)
    writer.add_uint32("t.u32", 2**32 - 1)
    writer.add_int32("t.i32", -(2**31))
    writer.add_float32("t.f32", 0.1)  # not exact in float32: both sides must widen it the same way
    writer.add_uint64("t.u64", 2**64 - 1)
    writer.add_int64("t.i64", -(2**63))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.true", True)
    writer.add_bool("t.false", False)
    writer.add_string("t.empty", "")
    writer.add_string("t.unicode", "▁Grüße, 世界 🙂\n\t")
    writer.add_array("t.strings", ["a", "", "▁b c", "🙂" * 50])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25, float("inf")])
    for vtype, values in ((V.UINT8, [0, 255]), (V.INT16, [-3, 3]), (V.UINT64, [2**64 - 1]), (V.FLOAT64, [0.1])):
        writer.add_key_value(f"t.array.{vtype.name.lower()}", values, V.ARRAY, sub_type=vtype)


def _write(path: Path, extra: Any = _every_value_type, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    extra(writer)
    writer.add_tensor("w.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("w.f16", np.linspace(-1, 1, 64, dtype=np.float16).reshape(2, 32))
    writer.add_tensor("w.i32", np.arange(5, dtype=np.int32))
    q = gguf.quants.quantize(np.linspace(-2, 2, 128, dtype=np.float32).reshape(2, 64), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w.q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_metadata_value_type_reads_the_same(tmp_path: Path) -> None:
    path = _write(tmp_path / "values.gguf")
    fast = open_gguf(path)
    _assert_same(fast, _reference(path))
    assert fast.get("t.unicode") == "▁Grüße, 世界 🙂\n\t" and fast.get("t.u64") == 2**64 - 1
    assert fast.get("t.strings") == ["a", "", "▁b c", "🙂" * 50] and fast.get("t.bools") == [True, False, True]


def test_alignment_key_moves_the_tensor_data(tmp_path: Path) -> None:
    path = _write(tmp_path / "aligned.gguf", lambda w: w.add_custom_alignment(64))
    fast = open_gguf(path)
    _assert_same(fast, _reference(path))
    header = parse_header(memoryview(path.read_bytes()))
    assert header.data_offset % 64 == 0 and all(t.data_offset % 64 == 0 for t in header.tensors)


def test_big_endian_and_nested_arrays_are_left_to_the_gguf_package(tmp_path: Path) -> None:
    big = _write(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    nested = _write(tmp_path / "nested.gguf", lambda w: w.add_array("t.nested", [[1, 2], [3, 4]]))
    for path in (big, nested):
        with pytest.raises(HeaderDeclined):
            parse_header(memoryview(path.read_bytes()))
        opened = open_gguf(path)
        assert opened.parsed_by == "gguf" and opened.tensors["w.f32"].shape == (3, 4)
    assert open_gguf(big).get("t.unicode") == "▁Grüße, 世界 🙂\n\t"
    assert open_gguf(nested).get("t.nested") == _reference(nested).get("t.nested")


def test_invalid_utf8_fails_as_before(tmp_path: Path) -> None:
    path = _write(tmp_path / "utf8.gguf")
    data = bytearray(path.read_bytes())
    at = data.index("▁Grüße".encode())
    data[at : at + 2] = b"\xff\xfe"
    path.write_bytes(bytes(data))
    opened = open_gguf(path)  # the reference parses the header and decodes values on first use
    assert opened.parsed_by == "gguf" and opened.get("t.u8") == 255
    with pytest.raises(GGUFError, match=r"utf8\.gguf: metadata 't\.unicode' cannot be decoded"):
        opened.get("t.unicode")


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_truncated_inside_the_vocabulary_is_the_same_gguf_error(gguf_model, tmp_path: Path, keep: float) -> None:
    source = gguf_model("llama-gqa", "F32")
    data = source.read_bytes()
    header_end = parse_header(memoryview(data)).data_offset
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(header_end * keep)])
    with pytest.raises(HeaderDeclined):
        parse_header(memoryview(path.read_bytes()))
    with pytest.raises(GGUFError, match=r"cut\.gguf .* is not a valid GGUF file: the file is truncated or corrupt"):
        open_gguf(path)


@pytest.mark.slow
def test_real_model_reads_the_same(real_gguf: Path) -> None:
    """SmolLM2: 49k tokens, 49k merges, token types, the chat template; 272 tensors (Q4_1 and F32)."""
    fast = open_gguf(real_gguf)
    _assert_same(fast, _reference(real_gguf))
    assert len(fast.get("tokenizer.ggml.tokens")) == 49152 and fast.get("tokenizer.chat_template")
