"""FastAPI routes of the OpenAI-compatible server, its lifecycle (load, serve, drain) and error rendering.

Role: the HTTP surface. `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`
(liveness), `/ready` (readiness), `/metrics`, `/version`, `/debug/kv`.

Lifecycle: the app answers at once; the model loads in a background thread, and until it is
in place `/ready` is 503 and API calls get 503 `loading`. `drain()` (called on SIGTERM) turns
readiness false, answers new API calls with 503 `draining`, waits for the in-flight ones
(up to the grace period, then aborts the rest) and returns; the caller then stops uvicorn.

Invariants: every error body has OpenAI's `{"error": {"message", "type", "param", "code"}}`
shape; in-flight counting wraps the whole ASGI call, so a streamed response counts until its
last byte is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine_config import EngineConfig
from .async_engine import AsyncEngine
from .metrics import EngineMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, param_from_loc
from .serving import Serving

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerConfig:
    engine: EngineConfig
    model_name: str
    max_queue_len: int = 1024  # engine requests waiting (not yet running) before new ones get 429
    retry_after_s: int = 1  # the Retry-After header sent with 429
    drain_timeout_s: float = 30.0  # grace period for in-flight requests after SIGTERM


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None
    serving: Serving | None = None
    metrics: EngineMetrics | None = None
    load_error: BaseException | None = None
    is_draining: bool = False
    num_inflight: int = 0
    started: float = field(default_factory=time.time)
    on_fatal: Callable[[], None] | None = None  # asks the server process to exit (set by the CLI)


def build_app(config: ServerConfig) -> FastAPI:
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        threading.Thread(target=_load, args=(state, loop), name="tidepool-load", daemon=True).start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop)
            state.engine.engine.close()  # the KV connector's sockets (P/D disaggregation)

    app = FastAPI(title="Tidepool", lifespan=lifespan)
    app.state.tidepool = state
    app.add_middleware(_InflightMiddleware, state=state)  # type: ignore[arg-type]
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.load_error is not None or (state.engine is not None and not state.engine.is_alive):
            return JSONResponse({"status": "dead"}, status_code=500)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        reason = _not_ready_reason(state)
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from tidepool import __version__

        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(
            id=config.model_name,
            created=int(state.started),
            root=config.engine.model,
            max_model_len=state.serving.max_model_len if state.serving else None,
        )
        return ModelList(data=[card]).model_dump()

    @app.get("/debug/kv")
    async def debug_kv() -> dict[str, int]:
        """Block-pool occupancy for tests and operators: all blocks are free when nothing runs."""
        engine = _require_engine(state)
        stats = engine.stats
        return {
            "num_free_blocks": stats.num_free_blocks,
            "num_blocks": stats.num_kv_blocks,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_unfinished": engine.num_unfinished,
            "num_inflight_http": state.num_inflight,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _require_serving(state).completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _require_serving(state).chat(body, raw)

    return app


async def drain(app: FastAPI) -> None:
    """Readiness false, new API calls 503, wait for in-flight ones (abort after the grace period)."""
    state: ServerState = app.state.tidepool
    state.is_draining = True
    timeout = state.config.drain_timeout_s
    logger.info("draining: %d in-flight request(s), grace period %.0f s", state.num_inflight, timeout)
    deadline = time.monotonic() + timeout
    while state.num_inflight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.num_inflight > 0 and state.engine is not None:
        logger.warning("grace period over: aborting %d in-flight request(s)", state.num_inflight)
        state.engine.abort_all()
        abort_deadline = time.monotonic() + 5.0
        while state.num_inflight > 0 and time.monotonic() < abort_deadline:
            await asyncio.sleep(0.05)
    logger.info("drained")


def _load(state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
    """Load the model off the event loop, then hand the engine to the loop thread."""
    try:
        from ..llm_engine import LLMEngine

        engine = LLMEngine(state.config.engine)
    except BaseException as err:
        logger.exception("failed to load the model")
        state.load_error = err
        if state.on_fatal is not None:
            loop.call_soon_threadsafe(state.on_fatal)
        return
    loop.call_soon_threadsafe(_engine_ready, state, engine, loop)


def _engine_ready(state: ServerState, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    config = state.config
    rc = engine.resolved
    cache_config = {
        "block_size": str(config.engine.block_size),
        "num_gpu_blocks": str(engine.num_kv_blocks),
        "enable_prefix_caching": str(config.engine.enable_prefix_caching),
        "gpu_memory_utilization": str(config.engine.gpu_memory_utilization),
        "cache_dtype": "auto",
        "device": str(rc.device),
    }
    state.metrics = EngineMetrics(config.model_name, engine.max_model_len, rc.max_num_batched_tokens, cache_config)
    state.engine = AsyncEngine(engine, state.metrics, config.max_queue_len, config.retry_after_s)
    state.serving = Serving(state.engine, config.model_name, engine.tokenizer, engine.max_model_len)
    state.engine.start(loop)
    logger.info("ready: serving %s as %r", config.engine.model, config.model_name)


def _not_ready_reason(state: ServerState) -> str | None:
    if state.load_error is not None:
        return "load_failed"
    if state.is_draining:
        return "draining"
    if state.serving is None:
        return "loading"
    if state.engine is not None and not state.engine.is_alive:
        return "engine_dead"
    return None


def _require_engine(state: ServerState) -> AsyncEngine:
    if state.engine is None:
        raise APIError("the model is still loading", status_code=503, type="service_unavailable", code="loading")
    return state.engine


def _require_serving(state: ServerState) -> Serving:
    if state.serving is None:
        raise APIError("the model is still loading", status_code=503, type="service_unavailable", code="loading")
    return state.serving


class _InflightMiddleware:
    """Counts API calls until their last byte is sent; answers 503 while loading or draining."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        reason = _not_ready_reason(self.state)
        if reason is not None:
            err = APIError(
                f"the server is not accepting requests ({reason})",
                status_code=503,
                type="service_unavailable",
                code=reason,
            )
            await _send_json(send, err.status_code, err.body())
            return
        self.state.num_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_inflight -= 1


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        param = param_from_loc(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('msg', '')}", None
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
            if "input" in first and param is not None:
                message += f" (got {json.dumps(first['input'], default=str)[:200]})"
        return JSONResponse(APIError(message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        body = APIError(str(err.detail), status_code=err.status_code, type=kind).body()
        return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        body = APIError(f"internal error: {err!r}", status_code=500, type="internal_error").body()
        return JSONResponse(body, status_code=500)
