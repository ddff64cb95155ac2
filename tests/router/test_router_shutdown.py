"""A real `tidepool router` process on SIGTERM: it drains (readiness 503, new requests 503 `draining`, in-flight
streams finish) and exits 0, as `tidepool serve` does (tidepool.common.graceful); before, uvicorn re-raised the
signal and the router died of it (exit 143).

The engine is an in-process fake whose stream stops after its first event until the test releases it, so the
request is in flight for certain when the signal arrives: nothing here depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from router_fake_engine import ThreadServer
from router_helpers import Proc, Servers, spawn, wait_for

TOKENS = ("one", "two", "three", "four")


def held_engine(release: threading.Event) -> FastAPI:
    """An engine streaming TOKENS, holding after the first one until `release` is set."""
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> Response:
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response("", media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        await raw.body()

        async def events() -> AsyncIterator[str]:
            for i, token in enumerate(TOKENS):
                if i == 1:
                    await asyncio.to_thread(release.wait, 120)
                chunk = {"object": "text_completion", "model": "fake", "choices": [{"index": 0, "text": token}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def start(servers: Servers, tmp_path: Path, *flags: str) -> tuple[threading.Event, Proc]:
    release = threading.Event()
    engine = ThreadServer(held_engine(release))
    servers.started.append(engine)
    router = spawn(tmp_path, "router", ["router", "--health-interval", "0.2", "--unified-url", engine.url, *flags])

    def replica_ready() -> bool:
        if router.proc.poll() is not None:
            raise AssertionError(f"the router exited with {router.proc.returncode}:\n{router.log()}")
        try:
            replicas = httpx.get(f"{router.url}/debug/replicas", timeout=2).json()["unified"]
        except httpx.HTTPError:
            return False
        return [r["state"] for r in replicas] == ["ready"]

    wait_for(replica_ready, timeout=60, what="the router and its replica")
    return release, router


def test_sigterm_drains_an_inflight_stream_and_exits_0(servers: Servers, tmp_path: Path) -> None:
    release, router = start(servers, tmp_path)
    try:
        body = {"model": "fake", "prompt": "hi", "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line) == _events(TOKENS[:1])[0]  # in flight, held at the engine
            router.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(f"{router.url}/ready", timeout=5).status_code == 503, what="draining")
            refused = httpx.post(f"{router.url}/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
            assert router.proc.poll() is None  # still waiting for the stream
            release.set()
            rest = [line for line in lines if line]
        assert rest == [*_events(TOKENS[1:]), "data: [DONE]"]
        assert router.proc.wait(60) == 0, router.log()
        assert "drained" in router.log()
    finally:
        release.set()
        router.stop()


def test_a_stream_longer_than_the_grace_period_still_exits_0(servers: Servers, tmp_path: Path) -> None:
    release, router = start(servers, tmp_path, "--drain-timeout", "0.5")
    try:
        body = {"model": "fake", "prompt": "hi", "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line) == _events(TOKENS[:1])[0]
            router.proc.send_signal(signal.SIGTERM)
            assert router.proc.wait(60) == 0, router.log()  # the engine never released it: cut after the grace period
        assert "stopping with 1 request(s) still in flight" in router.log()
    finally:
        release.set()
        router.stop()


def _events(tokens: tuple[str, ...]) -> list[str]:
    return [
        "data: " + json.dumps({"object": "text_completion", "model": "fake", "choices": [{"index": 0, "text": t}]})
        for t in tokens
    ]
