"""The KV hand-off's rank plan and wire checks, without engines.

`plan_pieces` must tile every decode rank's slab exactly (each layer x head once) for any pair of valid
layouts, and name the field two incompatible layouts differ in. A receiver must answer every malformed
frame (bad JSON, wrong types, sizes over its limits, a slab it does not hold) with a rejection naming the
problem, allocate nothing from it, and keep serving: a valid transfer afterwards still lands. The decode
driver answers a manifest only once every rank announced its slab, and refuses it naming the missing ranks
(telling the workers to drop what they hold) otherwise.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading

import pytest
import torch

from tidepool.engine.kv_transfer import KVLayout, KVTransferError, Manifest, rank_limits
from tidepool.engine.kv_transfer.layout import plan_pieces
from tidepool.engine.kv_transfer.protocol import (
    STATUS_OK,
    STATUS_REJECTED,
    PieceHeader,
    read_status,
    write_manifest,
    write_piece,
)
from tidepool.engine.kv_transfer.tcp import KVReceiver, RankReceiver

LAYOUTS = [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 3)]


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_pieces_tile_every_decode_slab_exactly(num_kv_heads: int) -> None:
    for src_tp, src_pp in LAYOUTS:
        for dst_tp, dst_pp in LAYOUTS:
            src = KVLayout(6, num_kv_heads, 16, 8, "float32", src_tp, src_pp)
            dst = KVLayout(6, num_kv_heads, 16, 8, "float32", dst_tp, dst_pp)
            covered = {rank: torch.zeros(6, num_kv_heads, dtype=torch.int) for rank in range(dst.world_size)}
            for src_rank in range(src.world_size):
                for piece in plan_pieces(src, src_rank, dst):
                    # A piece is the sender's own: its layers and heads are in its slab.
                    assert set(piece.layers) <= set(src.layers_of(src_rank))
                    assert set(piece.heads) <= set(src.heads_of(src_rank))
                    covered[piece.dst_rank][piece.layers.start : piece.layers.stop,
                                            piece.heads.start : piece.heads.stop] += 1  # fmt: skip
            for rank, count in covered.items():
                expected = torch.zeros(6, num_kv_heads, dtype=torch.int)
                layers, heads = dst.layers_of(rank), dst.heads_of(rank)
                expected[layers.start : layers.stop, heads.start : heads.stop] = 1
                assert torch.equal(count, expected), (src_tp, src_pp, dst_tp, dst_pp, rank)


def test_incompatible_layouts_name_the_field() -> None:
    src = KVLayout(4, 2, 16, 8, "float32", 2)
    for field, value, hint in [("block_size", 16, "--block-size"), ("dtype", "bfloat16", "--dtype"),
                               ("num_layers", 5, "same model")]:  # fmt: skip
        dst = KVLayout(**{**src.to_json(), field: value})
        with pytest.raises(ValueError, match=f"differ in {field}.*{hint}"):
            plan_pieces(src, 0, dst)


@pytest.fixture()
def receiver() -> RankReceiver:
    layout = KVLayout(4, 2, 16, 8, "float32", tp=2)  # rank 1: layers 0..4, head 1
    done: list[str] = []
    recv = RankReceiver(rank_limits(layout, 1, 4, 512), "127.0.0.1", 0, 60.0, done.append)
    recv.done = done  # type: ignore[attr-defined]
    yield recv
    recv.close()


def _send_raw(port: int, data: bytes) -> tuple[int, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        with contextlib.suppress(OSError):  # the receiver may have answered and closed already
            sock.shutdown(socket.SHUT_WR)
        return read_status(sock)


def _frame(header: object, raw: bytes | None = None, payload: bytes = b"") -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack(">4sHI", b"TPKV", 2, len(body)) + body + payload


GOOD = {"kind": "piece", "transfer_id": "t", "layers": [0, 4], "heads": [1, 2], "num_blocks": 2, "block_size": 8,
        "head_dim": 16, "dtype": "float32"}  # fmt: skip


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (_frame(None, raw=b"{not json"), "not JSON"),
        (_frame([1, 2]), "JSON object"),
        (_frame({"kind": "piece"}), "transfer_id"),
        (_frame({**GOOD, "num_blocks": 1 << 40}), "num_blocks"),  # would allocate terabytes
        (_frame({**GOOD, "num_blocks": True}), "num_blocks"),
        (_frame({**GOOD, "num_blocks": -3}), "num_blocks"),
        (_frame({**GOOD, "layers": [0, 99]}), "layers 0..99 is not inside"),
        (_frame({**GOOD, "heads": [0, 1]}), "heads 0..1 is not inside"),  # head 0 is rank 0's
        (_frame({**GOOD, "layers": "all"}), "layers must be"),
        (_frame({**GOOD, "dtype": "float64"}), "dtype"),
        (_frame({**GOOD, "block_size": 16}), "block_size"),
        (_frame({"kind": "manifest", "transfer_id": "t"}), "driver"),  # only the decode driver takes manifests
        (_frame({"kind": "eval"}), "kind"),
        (struct.pack(">4sHI", b"TPKV", 2, 1 << 31), "over this engine's"),  # a 2 GiB header is never read
        (struct.pack(">4sHI", b"TPKV", 1, 10) + b"x" * 10, "version"),
        (_frame(GOOD, payload=b"\0" * 100), "closed the connection"),  # the bytes stop short of the piece
    ],
)
def test_a_malformed_frame_is_refused_with_its_reason(receiver: RankReceiver, frame: bytes, reason: str) -> None:
    status, message = _send_raw(receiver.port, frame)
    assert status == STATUS_REJECTED and reason in message, message
    assert receiver.store.num_pending == 0


def test_the_receiver_keeps_serving_after_bad_frames(receiver: RankReceiver) -> None:
    for frame in (_frame([1]), _frame({**GOOD, "num_blocks": 1 << 40}), b"GET / HTTP/1.1\r\n\r\n"):
        _send_raw(receiver.port, frame)
    kv = torch.arange(4 * 2 * 2 * 8 * 1 * 16, dtype=torch.float32).reshape(4, 2, 2, 8, 1, 16)
    with socket.create_connection(("127.0.0.1", receiver.port), timeout=10) as sock:
        write_piece(sock, PieceHeader("t", range(0, 4), range(1, 2), 2), 8, kv)
        assert read_status(sock)[0] == STATUS_OK
    assert receiver.done == ["t"]  # type: ignore[attr-defined]
    assert torch.equal(receiver.store.pop("t"), kv)
    assert threading.active_count() < 50  # one thread per connection, each ended


def _driver(dropped: list[str], ttl_s: float = 8.0) -> KVReceiver:
    """A decode driver (rank 0 of tp 2: head 0) whose one worker (rank 1) is simulated by `rank_stored` calls."""
    layout = KVLayout(4, 2, 16, 8, "float32", tp=2)
    return KVReceiver(rank_limits(layout, 0, 4, 512), layout, [("", 1)], "127.0.0.1", 0, ttl_s, dropped.append)


def _send_driver_part(driver: KVReceiver, tid: str) -> tuple[int, str]:
    """The prefill driver's side: its piece for decode rank 0, then the manifest (answered once complete)."""
    kv = torch.ones(4, 2, 1, 8, 1, 16)
    with socket.create_connection(("127.0.0.1", driver.port), timeout=10) as sock:
        write_piece(sock, PieceHeader(tid, range(0, 4), range(0, 1), 1), 8, kv)
        assert read_status(sock)[0] == STATUS_OK
    with socket.create_connection(("127.0.0.1", driver.port), timeout=30) as sock:
        write_manifest(sock, Manifest(tid, [5, 6, 7], 9, 1))
        return read_status(sock)


def test_the_driver_answers_a_manifest_once_every_rank_holds_its_slab() -> None:
    dropped: list[str] = []
    driver = _driver(dropped)
    try:
        notice = threading.Timer(0.2, driver.rank_stored, (1, "t"))  # the worker's KV_STORED, after the manifest
        notice.start()
        assert _send_driver_part(driver, "t") == (STATUS_OK, "")
        payload = driver.take("t", timeout_s=1)
        assert (payload.prompt_token_ids, payload.first_token_id, list(payload.kv.shape)) == (
            [5, 6, 7], 9, [4, 2, 1, 8, 1, 16])  # fmt: skip
        # The layout question: the driver's own port, then the worker's (host "": the driver's address).
        status, text = _send_raw(driver.port, _frame({"kind": "layout"}))
        assert status == STATUS_OK and json.loads(text)["ranks"] == [["", driver.port], ["", 1]]
        assert dropped == []
    finally:
        driver.close()


def test_a_manifest_whose_worker_slab_never_lands_is_refused_and_dropped_everywhere() -> None:
    dropped: list[str] = []
    driver = _driver(dropped, ttl_s=2.0)  # the driver waits ttl / 4 for the missing rank
    try:
        status, message = _send_driver_part(driver, "lost")
        assert status == STATUS_REJECTED and "decode ranks [1] did not receive" in message
        assert dropped == ["lost"] and driver.store.num_pending == 0
        with pytest.raises(KVTransferError, match="did not arrive"):
            driver.take("lost", timeout_s=0.1)
    finally:
        driver.close()
