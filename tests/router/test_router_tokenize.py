"""`/tokenize` and `/detokenize` through the router: forwarded as they are to one replica of the serving pool.

Unified: a real engine (the shared `engine_fleet`) answers through the router exactly what it
answers directly, errors included. Disaggregated: fake engines show that a tokenizer call goes to
a decode replica as the client sent it, with no prefill hand-off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from router_fake_engine import FakeEngine, ThreadServer
from router_helpers import Engines, Servers

from tidepool.router.upstream import REPLICA_HEADER

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.mark.slow
def test_tokenizer_calls_reach_a_real_replica_as_they_are(engine_fleet: Engines, servers: Servers) -> None:
    router = servers.router("--unified-url", engine_fleet.a.url, wait_ready=1)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("/tokenize", {"model": "tiny", "prompt": "Once upon a time", "return_token_strs": True}),
        ("/tokenize", {"messages": MESSAGES}),
        ("/tokenize", {"model": "gpt-17", "prompt": "hi"}),  # the replica's 404, relayed (not retried)
        ("/detokenize", {"tokens": [-1]}),  # its 400
    ]
    for path, body in calls:
        direct = httpx.post(engine_fleet.a.url + path, json=body, timeout=30)
        routed = httpx.post(router.url + path, json=body, timeout=30)
        assert (routed.status_code, routed.json()) == (direct.status_code, direct.json()), path
        assert routed.headers[REPLICA_HEADER] == engine_fleet.a.url.removeprefix("http://")
    tokens = httpx.post(router.url + "/tokenize", json={"prompt": "Once upon a time"}, timeout=30).json()["tokens"]
    assert len(tokens) > 1
    detokenized = httpx.post(router.url + "/detokenize", json={"model": "tiny", "tokens": tokens}, timeout=30)
    assert detokenized.status_code == 200 and detokenized.json()["prompt"].endswith("Once upon a time")


@dataclass
class TokenizingFake(FakeEngine):
    """The fake engine with vLLM's tokenizer routes: each records its body and answers a fixed shape."""

    def app(self) -> FastAPI:
        app = super().app()

        @app.post("/tokenize")
        async def tokenize(raw: Request) -> dict[str, Any]:
            self.bodies.append(await raw.json())
            return {"count": 2, "max_model_len": 64, "tokens": [5, 6], "token_strs": None}

        @app.post("/detokenize")
        async def detokenize(raw: Request) -> dict[str, Any]:
            self.bodies.append(await raw.json())
            return {"prompt": self.name}

        return app


def test_tokenizer_calls_skip_the_handoff_when_disaggregated(servers: Servers) -> None:
    producer, decoder = TokenizingFake("prefill"), TokenizingFake("decode")
    p, d = ThreadServer(producer.app()), ThreadServer(decoder.app())
    servers.started += [p, d]
    router = servers.router("--prefill-url", p.url, "--decode-url", f"{d.url},kv=127.0.0.1:{d.port}",
                            wait_ready=1, pool="decode")  # fmt: skip
    body = {"model": "fake", "messages": MESSAGES, "add_generation_prompt": True}
    out = httpx.post(router.url + "/tokenize", json=body, timeout=10)
    assert out.status_code == 200 and out.json()["tokens"] == [5, 6]
    out = httpx.post(router.url + "/detokenize", json={"tokens": [5, 6]}, timeout=10)
    assert out.status_code == 200 and out.json() == {"prompt": "decode"}
    assert out.headers[REPLICA_HEADER] == f"127.0.0.1:{d.port}"
    assert decoder.bodies == [body, {"tokens": [5, 6]}]  # as the client sent them: no kv_transfer_params
    assert producer.bodies == []
