"""A small fake engine for the router tests: OpenAI-shaped answers, scripted failures, and the hand-off protocol.

Generation is a pure function of the prompt text (`fake_tokens`), so a unified answer and a
disaggregated one (first token from the producer, the rest from the consumer) can be compared.
Producer role: checks the router sent `stream=false` and `max_tokens=1`, computes the first
token and pushes it over HTTP to `decode_kv_addr` (`POST /kv/{transfer_id}` on the decode
fake, which stands for its KV listener), then echoes the params with `"status": "sent"`.
Consumer role: waits for that transfer, then answers as a unified engine would.

Scripted failures (`FakeEngine.script`, consumed one per request): an int status (500, 429)
answers that status; "cut" streams one event and then breaks the connection; "hang" sleeps
until the client goes away (recorded in `num_cancelled`); "sleeping" answers the 503 a sleeping engine gives.
Sleep mode (`is_sleeping`): /ready stays 200, /metrics says the sleep state (tidepool.contract.sleep) and every
generation request gets that 503, as a real engine put to sleep by the operator.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tidepool.contract import sleep


def fake_tokens(prompt: str, start: int, stop: int) -> list[str]:
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big")
    return [f"w{(seed + 7 * i) % 997}" for i in range(start, stop)]


def prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(f"{m['role']}:{m['content']}\n" for m in body["messages"])
    return str(body["prompt"])


@dataclass
class FakeEngine:
    name: str
    script: list[int | str] = field(default_factory=list)
    is_ready: bool = True
    num_waiting: int = 0
    num_running: int = 0
    token_delay_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)
    num_cancelled: int = 0
    is_sleeping: bool = False

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/ready")
        async def ready() -> Response:
            return JSONResponse({"ready": self.is_ready}, status_code=200 if self.is_ready else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            text = (
                f'vllm:num_requests_waiting{{model_name="fake"}} {self.num_waiting}\n'
                f'vllm:num_requests_running{{model_name="fake"}} {self.num_running}\n'
                'vllm:kv_cache_usage_perc{model_name="fake"} 0.25\n'
            )
            for state in sleep.SLEEP_STATES:
                is_current = state == (sleep.WEIGHTS_OFFLOADED if self.is_sleeping else sleep.AWAKE)
                text += f'{sleep.ENGINE_SLEEP_STATE_METRIC}{{{sleep.SLEEP_STATE_LABEL}="{state}"}} {int(is_current)}\n'
            return Response(text, media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": self.name}]}

        @app.post("/kv/{transfer_id}")
        async def receive_kv(transfer_id: str, raw: Request) -> dict[str, str]:
            self.transfers[transfer_id] = await raw.json()
            return {"status": "ok"}

        @app.post("/v1/completions")
        async def completions(raw: Request) -> Response:
            return await self.answer(await raw.json(), raw, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(raw: Request) -> Response:
            return await self.answer(await raw.json(), raw, chat=True)

        return app

    async def answer(self, body: dict[str, Any], raw: Request, chat: bool) -> Response:
        self.bodies.append(body)
        action = self.script.pop(0) if self.script else None
        if self.is_sleeping or action == "sleeping":
            error = {"error": {"message": "asleep", "type": "service_unavailable", "code": sleep.SLEEPING_CODE}}
            return JSONResponse(error, status_code=503)
        if isinstance(action, int):
            error = {"error": {"message": f"{self.name} scripted {action}", "type": "x", "param": None, "code": None}}
            return JSONResponse(error, status_code=action, headers={"Retry-After": "1"} if action == 429 else None)
        if action == "hang":  # until the client goes away, noticed the way the real server does: by polling
            while not await raw.is_disconnected():
                await asyncio.sleep(0.02)
            self.num_cancelled += 1
            return Response(status_code=499)
        prompt = prompt_of(body)
        max_tokens = int(body.get("max_tokens") or 16)
        params = body.get("kv_transfer_params")
        if params and params["role"] == "producer":
            return await self._produce(body, params, prompt, chat)
        first = 0
        tokens: list[str] = []
        if params and params["role"] == "consumer":
            transfer = await self._wait_transfer(params["transfer_id"])
            if transfer is None or transfer["prompt"] != prompt:
                return JSONResponse({"error": {"message": "no KV transfer", "type": "x"}}, status_code=500)
            tokens, first = [transfer["first"]], 1
        tokens += fake_tokens(prompt, first, max_tokens)
        if body.get("stream"):
            return StreamingResponse(self._stream(tokens, chat, action == "cut"), media_type="text/event-stream")
        return JSONResponse(_completion(" ".join(tokens), chat, self.name))

    async def _produce(self, body: dict[str, Any], params: dict[str, Any], prompt: str, chat: bool) -> Response:
        if body.get("stream") is not False or body.get("max_tokens") != 1:
            return JSONResponse({"error": {"message": "producer wants stream=false, max_tokens=1"}}, status_code=400)
        first = fake_tokens(prompt, 0, 1)[0]
        async with httpx.AsyncClient() as client:
            pushed = await client.post(
                f"http://{params['decode_kv_addr']}/kv/{params['transfer_id']}", json={"first": first, "prompt": prompt}
            )
            pushed.raise_for_status()
        answer = _completion(first, chat, self.name)
        answer["kv_transfer_params"] = {**params, "status": "sent"}
        return JSONResponse(answer)

    async def _wait_transfer(self, transfer_id: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + 5.0
        while transfer_id not in self.transfers and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.transfers.pop(transfer_id, None)

    async def _stream(self, tokens: list[str], chat: bool, cut: bool) -> AsyncIterator[str]:
        try:
            async for event in self._events(tokens, chat, cut):
                yield event
        except asyncio.CancelledError:  # Starlette cancels a stream whose client disconnected
            self.num_cancelled += 1
            raise

    async def _events(self, tokens: list[str], chat: bool, cut: bool) -> AsyncIterator[str]:
        for i, token in enumerate(tokens):
            text = token if i == 0 else f" {token}"
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
            if i == len(tokens) - 1:
                choice["finish_reason"] = "length"
            kind = "chat.completion.chunk" if chat else "text_completion"
            chunk = {"id": "x", "object": kind, "created": 0, "model": "fake", "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n"
            if cut:
                await asyncio.sleep(0.05)
                raise RuntimeError("scripted cut")  # uvicorn drops the connection mid-body
            await asyncio.sleep(self.token_delay_s)
        yield "data: [DONE]\n\n"


def _completion(text: str, chat: bool, name: str) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        kind = "text_completion"
    usage = {"prompt_tokens": 1, "completion_tokens": len(text.split()), "total_tokens": 1 + len(text.split())}
    return {"id": name, "object": kind, "created": 0, "model": "fake", "choices": [choice], "usage": usage}


class ThreadServer:
    """uvicorn serving an app in a background thread on loopback (port 0: a free one)."""

    def __init__(self, app: FastAPI, port: int = 0, host: str = "127.0.0.1") -> None:
        config = uvicorn.Config(app, host=host, port=port, log_config=None, lifespan="on", timeout_graceful_shutdown=1)
        self.host = host
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port: int = self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
