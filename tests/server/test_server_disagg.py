"""P/D disaggregation over HTTP: a `--role prefill` and a `--role decode` server, driven the way the router does.

The hand-off (engine/server/disagg.py): POST the body to the prefill engine with
max_tokens=1 and producer params, then the original body to the decode engine with consumer
params; the decode engine's answer (streamed or not) equals the unified server's, and both
block pools end fully free, also after refused and abandoned transfers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import httpx
import pytest
from serve_proc import Server, free_port

BODIES = [
    {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 10, "temperature": 0, "ignore_eos": True},
    {"prompt": "def fibonacci(n):", "max_tokens": 7, "temperature": 0, "ignore_eos": True},
    {"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0.8, "seed": 3, "ignore_eos": True},
]


@pytest.fixture(scope="module")
def pd_pair(serve: Callable[..., Server]) -> tuple[Server, Server, int]:
    kv_port = free_port()
    decode = serve("--role", "decode", "--kv-port", str(kv_port), "--kv-transfer-timeout", "5")
    prefill = serve("--role", "prefill", "--kv-transfer-timeout", "5")
    return prefill, decode, kv_port


def _producer(tid: str, kv_port: int) -> dict:
    return {"kv_transfer_params": {"role": "producer", "transfer_id": tid, "decode_kv_addr": f"127.0.0.1:{kv_port}"}}


def _consumer(tid: str) -> dict:
    return {"kv_transfer_params": {"role": "consumer", "transfer_id": tid}}


def _handoff(prefill: Server, decode: Server, kv_port: int, body: dict, path: str = "completions") -> httpx.Response:
    tid = uuid.uuid4().hex
    first = {**body, "max_tokens": 1, "stream": False, **_producer(tid, kv_port)}
    resp = httpx.post(f"{prefill.api}/{path}", json=first, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["kv_transfer_params"]["status"] == "sent"
    second = {**body, **_consumer(tid)}
    return httpx.post(f"{decode.api}/{path}", json=second, timeout=60)


def test_outputs_equal_unified_serving(server: Server, pd_pair: tuple[Server, Server, int]) -> None:
    prefill, decode, kv_port = pd_pair
    for body in BODIES:
        expected = httpx.post(f"{server.api}/completions", json=body, timeout=60).json()["choices"][0]
        got = _handoff(prefill, decode, kv_port, body)
        assert got.status_code == 200, got.text
        choice = got.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (expected["text"], expected["finish_reason"])
        assert got.json()["usage"]["completion_tokens"] == body["max_tokens"]
    chat = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 6, "temperature": 0}
    expected = httpx.post(f"{server.api}/chat/completions", json=chat, timeout=60).json()["choices"][0]
    got = _handoff(prefill, decode, kv_port, chat, "chat/completions").json()["choices"][0]
    assert got["message"]["content"] == expected["message"]["content"]
    for s in (prefill, decode, server):
        s.wait_pool_free()


SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_constrained_output_continues_its_grammar_on_the_decode_engine(
    server: Server, pd_pair: tuple[Server, Server, int], temperature: float
) -> None:
    """The prefill engine samples the first token under the constraint; the decode engine's matcher takes it
    and goes on: the same tokens as unified serving, a valid object."""
    prefill, decode, kv_port = pd_pair
    body = {"prompt": "A pet:", "max_tokens": 60, "temperature": temperature, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}}  # fmt: skip
    expected = httpx.post(f"{server.api}/completions", json=body, timeout=60).json()["choices"][0]
    got = _handoff(prefill, decode, kv_port, body)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected["text"], "stop")
    value = json.loads(choice["text"])
    assert value["kind"] in ("cat", "dog") and 0 <= value["n"] <= 99 and set(value) == {"kind", "n"}
    decode.wait_pool_free()


def test_streamed_decode_matches(server: Server, pd_pair: tuple[Server, Server, int]) -> None:
    prefill, decode, kv_port = pd_pair
    body = {**BODIES[0], "stream": True}
    expected = httpx.post(f"{server.api}/completions", json=BODIES[0], timeout=60).json()["choices"][0]["text"]
    resp = _handoff(prefill, decode, kv_port, body)
    assert resp.status_code == 200
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    assert text == expected
    decode.wait_pool_free()


def test_bad_and_failed_transfers_answer_clearly(pd_pair: tuple[Server, Server, int]) -> None:
    prefill, decode, kv_port = pd_pair
    body = {"prompt": "hello", "max_tokens": 1}
    no_addr = {"kv_transfer_params": {"role": "producer", "transfer_id": "x"}}
    cases = [
        (prefill, {**body, **_consumer("x")}, 400, "--role decode"),
        (prefill, {**body, "max_tokens": 3, **_producer("x", kv_port)}, 400, "max_tokens=1"),
        (prefill, {**body, **no_addr}, 400, "decode_kv_addr"),
        (decode, {**body, **_consumer("never")}, 504, "did not arrive"),
        (decode, {**body, **_producer("x", kv_port)}, 400, "--role prefill"),
    ]
    for target, payload, status, message in cases:
        resp = httpx.post(f"{target.api}/completions", json=payload, timeout=30)
        assert resp.status_code == status, resp.text
        assert message in resp.json()["error"]["message"]
    # A decode engine nobody listens for: the prefill side answers 502 and frees everything.
    dead = free_port()
    resp = httpx.post(f"{prefill.api}/completions", json={**body, **_producer("dead", dead)}, timeout=30)
    assert resp.status_code == 502 and "failed" in resp.json()["error"]["message"]
    # Prefilled KV for a prompt the decode request does not carry is refused, not used.
    tid = uuid.uuid4().hex
    httpx.post(f"{prefill.api}/completions", json={**body, **_producer(tid, kv_port)}, timeout=30)
    resp = httpx.post(f"{decode.api}/completions", json={"prompt": "other", **_consumer(tid)}, timeout=30)
    assert resp.status_code == 400 and "different prompt" in resp.json()["error"]["message"]
    for s in (prefill, decode):
        s.wait_pool_free()
