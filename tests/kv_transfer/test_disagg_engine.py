"""P/D disaggregation at the engine level: a prefill engine and a decode engine joined by the TCP connector.

Outputs must equal a unified engine's (greedy), the decode side must not recompute the prompt,
and failed or abandoned transfers must leave both block pools fully free.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from pathlib import Path

import pytest

from tidepool.engine import SamplingParams
from tidepool.engine.engine_config import EngineConfig
from tidepool.engine.kv_transfer import KVPayload, KVTransferError, ProducerParams, parse_kv_transfer_params
from tidepool.engine.llm_engine import LLMEngine

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and keeps running",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a king who had three daughters and",
    "a",
    "The quick brown fox jumps over the lazy dog and then sleeps",  # shares a prefix with the first
]


def _engine(model: Path, role: str = "unified", **kw) -> LLMEngine:
    config = EngineConfig(model=str(model), dtype="float32", role=role, kv_port=0, num_kv_blocks=64,
                          max_model_len=256, block_size=8, show_progress=False, **kw)  # fmt: skip
    return LLMEngine(config)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path):
    prefill, decode = _engine(tiny_model_dir, "prefill"), _engine(tiny_model_dir, "decode")
    yield prefill, decode
    prefill.close()
    decode.close()


def _prefill(
    prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: str, params: SamplingParams | None = None
) -> KVPayload:
    addr = f"127.0.0.1:{decode.kv_connector.port}"
    first = dataclasses.replace(params or SamplingParams(temperature=0), max_tokens=1)
    prefill.add_request(rid, prompt, first, kv_transfer=ProducerParams(f"t-{rid}", addr))
    _run(prefill)
    prefill.kv_connector.sender.wait_sent(f"t-{rid}")
    return decode.kv_connector.receiver.take(f"t-{rid}", timeout_s=10)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_disaggregated_output_equals_unified(tiny_model_dir: Path, engines, sampling: str) -> None:
    prefill, decode = engines
    if sampling == "greedy":
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    else:  # seeded sampling: the decode engine continues the request's random stream where prefill left it
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    unified = _engine(tiny_model_dir)
    for i, prompt in enumerate(PROMPTS):
        unified.add_request(f"r{i}", prompt, params)
    expected = _run(unified)

    payloads = {f"r{i}": _prefill(prefill, decode, f"r{i}", p, params) for i, p in enumerate(PROMPTS)}
    for i, prompt in enumerate(PROMPTS):  # all admitted together: they decode as one continuous batch
        decode.add_request(f"r{i}", prompt, params, kv_transfer=payloads[f"r{i}"])
    got = _run(decode)
    assert got == expected
    # No prompt recompute: the decode engine computed one token per step per request.
    assert decode.last_stats.step_num_prompt_tokens == 0
    for engine in (prefill, decode):
        assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks
        engine.kv_cache.pool.check_invariants()


def test_first_token_that_finishes_and_abort_before_admission(engines) -> None:
    prefill, decode = engines
    payload = _prefill(prefill, decode, "one", "def fibonacci(n):")
    decode.add_request("one", "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=1), kv_transfer=payload)
    outs = [o for o in decode.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == [[payload.first_token_id]]
    assert outs[0].outputs[0].finish_reason == "length"
    assert not decode.has_unfinished_requests()

    payload = _prefill(prefill, decode, "gone", "Once upon a time")
    decode.add_request("gone", "Once upon a time", SamplingParams(temperature=0, max_tokens=5), kv_transfer=payload)
    aborted = decode.abort_request("gone")
    assert aborted and aborted[0].finished
    assert decode.kv_cache.num_free_blocks == decode.num_kv_blocks


def test_prompt_mismatch_and_wrong_role_are_rejected(engines) -> None:
    prefill, decode = engines
    payload = _prefill(prefill, decode, "mm", "Once upon a time")
    with pytest.raises(ValueError, match="different prompt"):
        decode.add_request(
            "mm", "Once upon a time, again", SamplingParams(temperature=0, max_tokens=3), kv_transfer=payload
        )
    with pytest.raises(ValueError, match="only a 'decode' engine"):
        prefill.add_request("x", "hi", SamplingParams(temperature=0, max_tokens=3), kv_transfer=payload)
    with pytest.raises(ValueError, match="max_tokens=1"):
        prefill.add_request(
            "y", "hi", SamplingParams(temperature=0, max_tokens=3), kv_transfer=ProducerParams("t", "h:1")
        )
    assert decode.kv_cache.num_free_blocks == decode.num_kv_blocks


def test_send_to_dead_decode_fails_cleanly(engines) -> None:
    prefill, _ = engines
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    prefill.add_request("dead", "hello there", SamplingParams(temperature=0, max_tokens=1),
                        kv_transfer=ProducerParams("t-dead", f"127.0.0.1:{dead}"))  # fmt: skip
    _run(prefill)
    with pytest.raises(KVTransferError, match="failed"):
        prefill.kv_connector.sender.wait_sent("t-dead")
    assert prefill.kv_cache.num_free_blocks == prefill.num_kv_blocks


def test_broken_and_malformed_transfers_store_nothing(engines) -> None:
    _, decode = engines
    receiver = decode.kv_connector.receiver
    rejected = receiver.num_rejected
    with socket.create_connection(("127.0.0.1", receiver.port)) as sock:  # killed mid-header
        sock.sendall(struct.pack(">4sHI", b"TPKV", 1, 1000) + b'{"transfer_id": "half"')
    with socket.create_connection(("127.0.0.1", receiver.port)) as sock:  # not our protocol at all
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        sock.recv(100)
    with pytest.raises(KVTransferError, match="did not arrive"):
        receiver.take("half", timeout_s=0.5)
    assert receiver.num_parked == 0
    assert receiver.num_rejected >= rejected + 1


def test_parse_kv_transfer_params() -> None:
    assert parse_kv_transfer_params({"role": "consumer", "transfer_id": "a"}).transfer_id == "a"
    producer = parse_kv_transfer_params({"role": "producer", "transfer_id": "a", "decode_kv_addr": "10.0.0.1:14579"})
    assert isinstance(producer, ProducerParams)
    for bad, match in [
        ({"role": "producer", "transfer_id": "a"}, "decode_kv_addr"),
        ({"role": "producer", "transfer_id": "a", "decode_kv_addr": "nohost"}, "host:port"),
        # Digits Python's int() refuses or reads oddly: still the host:port message, never int()'s own.
        ({"role": "producer", "transfer_id": "a", "decode_kv_addr": "h:" + "9" * 5000}, "host:port"),
        ({"role": "producer", "transfer_id": "a", "decode_kv_addr": "h:\u00b2"}, "host:port"),
        ({"role": "producer", "transfer_id": "a", "decode_kv_addr": "h:\u0661\u0662"}, "host:port"),
        ({"role": "producer", "transfer_id": "a", "decode_kv_addr": "h:65536"}, "host:port"),
        ({"role": "both", "transfer_id": "a"}, "role"),
        ({"role": "consumer"}, "transfer_id"),
        ("consumer", "object"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_kv_transfer_params(bad)
