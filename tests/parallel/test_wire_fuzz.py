"""Fuzzing the control channel's decoder: whatever the bytes, a valid message or `WireError`, nothing else.

Inputs: random bytes; random bodies behind a well-formed header (so the JSON and tensor checks are
reached); JSON bodies built from every value kind and tag the format knows, with random tensor specs
and blobs; valid frames of every message type with bytes flipped, inserted or deleted; every prefix of
a valid frame (always a truncation error). Each input goes through the contract's decoder and the
engine's codec (tensors and records built from it). Decoding is a bounded pass over the input: no
loop is driven by a length the input claims without the bytes being there, so it cannot hang.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidepool.contract import wire
from tidepool.contract.wire import HEADER, MAGIC, VERSION, Message, MessageType, WireError
from tidepool.engine.distributed import wire_codec
from tidepool.engine.layers.attention_metadata import AttentionMetadata, PrefillChunk

ALL = frozenset(MessageType)


def _valid_frames() -> list[bytes]:
    meta = AttentionMetadata(
        slot_mapping=torch.arange(3),
        num_decode_seqs=1,
        decode_block_tables=torch.zeros(1, 2, dtype=torch.int64),
        decode_mask=None,
        prefills=[PrefillChunk(1, 2, 2, torch.tensor([1]), torch.ones(2, 2, dtype=torch.bool))],
        seq_lens=torch.tensor([5, 2], dtype=torch.int32),
    )
    samples: dict[MessageType, dict[str, Any]] = {
        MessageType.HELLO: {"rank": 1, "pid": 7, "host": "h"},
        MessageType.READY: {"rank": 1},
        MessageType.ERROR: {"rank": 1, "text": "boom"},
        MessageType.INIT_KV: {"num_blocks": 64},
        MessageType.FORWARD: {
            "input_ids": torch.arange(3),
            "positions": torch.arange(3),
            "meta": meta,
            "scratch_shape": [1, 2],
            "scratch_blocks": 4,
            "lora_slots": torch.tensor([-1, 0, 1], dtype=torch.int32),
        },
        MessageType.LOGITS: {"hidden": torch.ones(2, 3, dtype=torch.float16)},
        MessageType.SHUTDOWN: {},
        MessageType.LORA_SLOT: {
            "slot": 0,
            "rank": 2,
            "layers": [1],
            "targets": ["o_proj"],
            "a": [torch.ones(2, 4)],
            "b": [torch.ones(4, 2)],
            "scalings": [0.5],
        },
        MessageType.KV_LISTEN: {"rank": 1, "host": "", "port": 14580},
        MessageType.KV_STORED: {"rank": 1, "transfer_id": "t"},
        MessageType.KV_SEND: {"transfer_id": "t", "block_ids": [3, 4], "addr": "10.0.0.7:14579"},
        MessageType.KV_FILL: {"transfer_id": "t", "block_ids": [3, 4]},
        MessageType.KV_DROP: {"transfer_id": "t"},
    }
    assert set(samples) == set(MessageType)
    return [wire_codec.encode(kind, **fields) for kind, fields in samples.items()]


FRAMES = _valid_frames()


def _decodes_or_refuses(data: bytes) -> None:
    """The property: a schema-valid Message or WireError, from both the contract and the engine's codec."""
    for decode in (wire.decode, lambda d: wire_codec.decode(d, ALL)):
        try:
            message = decode(data)
        except WireError:
            continue
        assert isinstance(message, Message) and message.type in MessageType
        assert set(message.fields) == set(wire.SCHEMAS[message.type])


def _frame(kind: int, body: bytes, blob: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, len(body), len(blob)) + body + blob


KINDS = st.sampled_from([int(k) for k in MessageType]) | st.integers(0, 0xFFFF)


@settings(max_examples=300)
@given(st.binary(max_size=256))
def test_random_bytes(data: bytes) -> None:
    _decodes_or_refuses(data)


@settings(max_examples=200)
@given(KINDS, st.binary(max_size=256), st.binary(max_size=64))
def test_random_bodies_behind_a_well_formed_header(kind: int, body: bytes, blob: bytes) -> None:
    _decodes_or_refuses(_frame(kind, body, blob))


SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
KEYS = st.sampled_from(["$t", "$r", "f", "$x", "rank", "num_blocks", "hidden", "input_ids", "meta", "slot_mapping"])
TAGGED = st.fixed_dictionaries({"$t": st.integers(-1, 3)}) | st.fixed_dictionaries(
    {"$r": st.sampled_from(["AttentionMetadata", "PrefillChunk", "Popen", ""]), "f": st.dictionaries(KEYS, SCALARS)}
)
VALUES = st.recursive(
    SCALARS | TAGGED,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
SPECS = st.lists(
    st.tuples(st.sampled_from([*wire.DTYPE_SIZES, "object", ""]), st.lists(st.integers(-2, 4), max_size=3)),
    max_size=3,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(KINDS, st.dictionaries(KEYS, VALUES, max_size=6), SPECS, st.binary(max_size=128))
def test_structured_bodies(kind: int, fields: dict[str, Any], specs: list[Any], blob: bytes) -> None:
    body = json.dumps({"f": fields, "t": [list(spec) for spec in specs]}).encode()
    _decodes_or_refuses(_frame(kind, body, blob))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    frame = bytearray(draw(st.sampled_from(FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(frame)))
        action = draw(st.sampled_from(["flip", "insert", "delete"]))
        if action == "insert" or position == len(frame):
            frame[position:position] = draw(st.binary(min_size=1, max_size=4))
        elif action == "flip":
            frame[position] ^= draw(st.integers(1, 255))
        else:
            del frame[position : position + draw(st.integers(1, 8))]
    return bytes(frame)


@settings(max_examples=400)
@given(mutated())
def test_mutated_valid_frames(data: bytes) -> None:
    _decodes_or_refuses(data)


@pytest.mark.parametrize("frame", FRAMES, ids=[MessageType(HEADER.unpack_from(f)[2]).name for f in FRAMES])
def test_every_truncation_of_a_valid_frame_is_refused(frame: bytes) -> None:
    assert wire_codec.decode(frame, ALL).type in MessageType
    for end in range(len(frame)):
        with pytest.raises(WireError, match="truncated"):
            wire.decode(frame[:end])
