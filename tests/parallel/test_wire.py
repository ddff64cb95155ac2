"""The control channel's wire format (contract/wire.py) and the engine's codec (distributed/wire_codec.py).

Round trips of every message type and every tensor dtype (through the engine's codec, as the channel
uses them); each way a frame can be wrong gives `WireError` with a message that says what; the step's
attention metadata comes back field for field; only allow-listed records are built.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from typing import Any

import pytest
import torch

from tidepool.contract import wire
from tidepool.contract.wire import HEADER, MAGIC, VERSION, Message, MessageType, RawTensor, Record, WireError
from tidepool.engine.distributed import wire_codec
from tidepool.engine.layers.attention_metadata import AttentionMetadata, PrefillChunk

ALL = frozenset(MessageType)


def _meta() -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor([17, 40, 41, 42], dtype=torch.int64),
        num_decode_seqs=1,
        decode_block_tables=torch.tensor([[1, 0]], dtype=torch.int64),
        decode_mask=torch.tensor([[[[True, False, True]]]]),
        prefills=[
            PrefillChunk(query_start=1, num_query_tokens=3, context_len=3, block_ids=torch.tensor([2]), mask=None),
            PrefillChunk(0, 0, 5, torch.zeros(0, dtype=torch.int64), torch.ones(0, 5, dtype=torch.bool)),
        ],
        block_tables=torch.tensor([[1, 0], [2, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([18, 3], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
        sliding_window=4096,
    )


SAMPLES: dict[MessageType, dict[str, Any]] = {
    MessageType.HELLO: {"rank": 3, "pid": 4242, "host": "pod-1.tidepool"},
    MessageType.READY: {"rank": 1},
    MessageType.ERROR: {"rank": 2, "text": 'Traceback (most recent call last):\n  "ü" ValueError: ✗\n'},
    MessageType.INIT_KV: {"num_blocks": 1 << 20},
    MessageType.FORWARD: {
        "input_ids": torch.tensor([5, 9, 11, 13]),
        "positions": torch.tensor([17, 0, 1, 2]),
        "meta": _meta(),
        "scratch_shape": [1, 4, 2, 64],
        "scratch_blocks": None,
        "lora_slots": torch.tensor([-1, 0, 0, 2], dtype=torch.int32),
    },
    MessageType.LOGITS: {"hidden": torch.randn(3, 8, dtype=torch.bfloat16)},
    MessageType.SHUTDOWN: {},
    MessageType.LORA_SLOT: {
        "slot": 1,
        "rank": 8,
        "layers": [0, 0, 1],
        "targets": ["q_proj", "v_proj", "down_proj"],
        "a": [torch.randn(8, 64), torch.randn(4, 64), torch.randn(8, 160)],
        "b": [torch.randn(64, 8), torch.randn(32, 4), torch.randn(64, 8)],
        "scalings": [2.0, 4.0, 0.5],
    },
    MessageType.KV_LISTEN: {"rank": 3, "host": "10.0.0.9", "port": 14582},
    MessageType.KV_STORED: {"rank": 1, "transfer_id": "cmpl-7f3a"},
    MessageType.KV_SEND: {"transfer_id": "cmpl-7f3a", "block_ids": [0, 7, 3], "addr": "10.0.0.7:14579"},
    MessageType.KV_FILL: {"transfer_id": "cmpl-7f3a", "block_ids": [12, 13]},
    MessageType.KV_DROP: {"transfer_id": "cmpl-7f3a"},
}


def _same(got: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)
    elif dataclasses.is_dataclass(expected):
        assert type(got) is type(expected)
        for field in dataclasses.fields(expected):
            _same(getattr(got, field.name), getattr(expected, field.name))
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            _same(g, e)
    else:
        assert got == expected and type(got) is type(expected)


def test_there_is_a_sample_of_every_message_type() -> None:
    assert set(SAMPLES) == set(MessageType) == set(wire.SCHEMAS)


@pytest.mark.parametrize("kind", list(MessageType), ids=lambda k: k.name)
def test_every_message_type_round_trips(kind: MessageType) -> None:
    frame = wire_codec.encode(kind, **SAMPLES[kind])
    assert frame[:4] == MAGIC
    message = wire_codec.decode(frame, frozenset({kind}))
    assert message.type is kind
    assert set(message.fields) == set(SAMPLES[kind])
    for name, value in SAMPLES[kind].items():
        _same(message.fields[name], value)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)


@pytest.mark.parametrize("name", sorted(wire.DTYPE_SIZES))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 5), (1, 0, 4)], ids=str)
def test_every_tensor_dtype_and_shape_round_trips(name: str, shape: tuple[int, ...]) -> None:
    dtype = getattr(torch, name)
    assert dtype.itemsize == wire.DTYPE_SIZES[name]
    tensor = _tensor(dtype, shape)
    message = wire_codec.decode(wire_codec.encode(MessageType.LOGITS, hidden=tensor), ALL)
    got = message.fields["hidden"]
    _same(got, tensor)
    got.add_(got) if dtype != torch.bool else got.logical_not_()  # a fresh, writable tensor


def test_a_non_contiguous_view_travels_as_its_values() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[:, 1::2].t()
    got = wire_codec.decode(wire_codec.encode(MessageType.LOGITS, hidden=view), ALL).fields["hidden"]
    _same(got, view.contiguous())


def test_a_bool_tensor_decodes_to_valid_bools_whatever_its_bytes() -> None:
    frame = wire.encode(MessageType.LOGITS, {"hidden": RawTensor("bool", (3,), bytes([0, 1, 7]))})
    got = wire_codec.decode(frame, ALL).fields["hidden"]
    assert got.tolist() == [False, True, True]


def _frame(kind: int, body: object, blob: bytes = b"", version: int = VERSION, magic: bytes = MAGIC) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HEADER.pack(magic, version, kind, len(raw), len(blob)) + raw + blob


GOOD = _frame(MessageType.READY, {"f": {"rank": 1}, "t": []})
HIDDEN = {"f": {"hidden": {"$t": 0}}, "t": [["float32", [2]]]}

BAD_FRAMES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "truncated frame"),
    "short header": (GOOD[:10], "truncated frame"),
    "truncated body": (GOOD[:-1], "truncated control frame"),
    "trailing byte": (GOOD + b"\0", "trailing bytes"),
    "magic": (_frame(MessageType.READY, {"f": {"rank": 1}, "t": []}, magic=b"PICK"), "not a Tidepool control frame"),
    "version": (_frame(MessageType.READY, {"f": {"rank": 1}, "t": []}, version=2), "version 2"),
    "type": (_frame(999, {"f": {}, "t": []}), "unknown control message type 999"),
    "oversize body": (HEADER.pack(MAGIC, VERSION, 2, wire.MAX_BODY_BYTES + 1, 0), "oversize"),
    "oversize blob": (HEADER.pack(MAGIC, VERSION, 2, 2, 1 << 62) + b"{}", "oversize"),
    "pickle body": (_frame(MessageType.READY, b"\x80\x04K\x01."), "malformed READY body"),
    "not utf-8": (_frame(MessageType.READY, b'{"f":"\xff"}'), "malformed READY body"),
    "nan": (_frame(MessageType.LOGITS, b'{"f":{"hidden":NaN},"t":[]}'), "NaN is not allowed"),
    "deep nesting": (_frame(MessageType.READY, b"[" * 100_000 + b"]" * 100_000), "malformed READY body"),
    "body not an object": (_frame(MessageType.READY, [1]), "expected an object"),
    "missing field": (_frame(MessageType.READY, {"f": {}, "t": []}), "expected ['rank']"),
    "extra field": (_frame(MessageType.READY, {"f": {"rank": 1, "x": 2}, "t": []}), "expected ['rank']"),
    "wrong kind": (_frame(MessageType.READY, {"f": {"rank": "1"}, "t": []}), "not of kind int"),
    "bool for int": (_frame(MessageType.READY, {"f": {"rank": True}, "t": []}), "not of kind int"),
    "dtype": (_frame(MessageType.LOGITS, {**HIDDEN, "t": [["object", [2]]]}, bytes(8)), "unknown tensor dtype"),
    "negative dim": (_frame(MessageType.LOGITS, {**HIDDEN, "t": [["float32", [-2]]]}), "bad tensor shape"),
    "too many dims": (_frame(MessageType.LOGITS, {**HIDDEN, "t": [["int8", [1] * 9]]}, b"\1"), "bad tensor shape"),
    "tensor past blob": (_frame(MessageType.LOGITS, HIDDEN, bytes(4)), "runs past the end"),
    "blob left over": (_frame(MessageType.LOGITS, HIDDEN, bytes(12)), "take 8 bytes"),
    "dangling ref": (_frame(MessageType.LOGITS, {"f": {"hidden": {"$t": 1}}, "t": []}), "bad tensor reference"),
    "unknown tag": (_frame(MessageType.LOGITS, {"f": {"hidden": {"$py": "os.system"}}, "t": []}), "unknown tagged"),
    "record shape": (_frame(MessageType.FORWARD, {"f": {"meta": {"$r": 1, "f": {}}}, "t": []}), "malformed record"),
}


@pytest.mark.parametrize("frame, message", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
def test_each_bad_frame_is_a_clear_wire_error(frame: bytes, message: str) -> None:
    with pytest.raises(WireError, match=re.escape(message)):
        wire.decode(frame)


def _forward_with_meta(meta: Record) -> bytes:
    ints = RawTensor("int64", (1,), bytes(8))
    fields = {"input_ids": ints, "positions": ints, "meta": meta, "scratch_shape": None, "scratch_blocks": None}
    return wire.encode(MessageType.FORWARD, {**fields, "lora_slots": None})


@pytest.mark.parametrize(
    "record, message",
    [
        (Record("Popen", {"args": ["sh"]}), "unknown record 'Popen'"),
        (Record("PrefillChunk", {"query_start": 0, "__class__": 1}), "unknown fields"),
        (Record("PrefillChunk", {"query_start": 0}), "incomplete"),
    ],
)
def test_only_allow_listed_records_with_their_own_fields_are_built(record: Record, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire_codec.decode(_forward_with_meta(record), ALL)


def test_an_unexpected_message_type_is_refused() -> None:
    frame = wire_codec.encode(MessageType.HELLO, **SAMPLES[MessageType.HELLO])
    with pytest.raises(WireError, match="unexpected HELLO message"):
        wire_codec.decode(frame, frozenset({MessageType.FORWARD, MessageType.SHUTDOWN}))


@pytest.mark.parametrize(
    "kind, fields, message",
    [
        (MessageType.READY, {"rank": 1, "extra": 2}, "expected \\['rank'\\]"),
        (MessageType.INIT_KV, {"num_blocks": 2.0}, "not of kind int"),
        (MessageType.LOGITS, {"hidden": torch.zeros(2, dtype=torch.complex64)}, "cannot travel"),
        (MessageType.ERROR, {"rank": 1, "text": object()}, "not of kind str"),
        (MessageType.LORA_SLOT, {**SAMPLES[MessageType.LORA_SLOT], "targets": ["q_proj", 3, "x"]}, "not of kind strs"),
        (MessageType.LORA_SLOT, {**SAMPLES[MessageType.LORA_SLOT], "a": [[1.0]]}, "not of kind tensors"),
    ],
)
def test_the_sender_refuses_what_the_receiver_would(kind: MessageType, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire_codec.encode(kind, **fields)


def test_a_dataclass_outside_the_allow_list_cannot_be_sent() -> None:
    @dataclasses.dataclass
    class AttentionMetadata:  # same name, another class
        x: int = 1

    with pytest.raises(WireError, match="not a record"):
        wire_codec.encode(MessageType.FORWARD, **{**SAMPLES[MessageType.FORWARD], "meta": AttentionMetadata()})


def test_header_layout_is_fixed() -> None:
    """Both ends parse this layout; changing it needs a new VERSION."""
    assert HEADER.format == ">4sHHIQ" and HEADER.size == 20 and MAGIC == b"TPWC"
    magic, version, kind, body_len, blob_len = struct.unpack(">4sHHIQ", GOOD[:20])
    assert (magic, version, kind, blob_len) == (MAGIC, VERSION, MessageType.READY, 0)
    assert body_len == len(GOOD) - 20
    assert wire.decode(GOOD) == Message(MessageType.READY, {"rank": 1})
