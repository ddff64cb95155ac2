"""FastAPI routes of the OpenAI-compatible server, its lifecycle (load, serve, drain) and error rendering.

Role: the HTTP surface, registered by family: probes (`/health` liveness, `/ready` readiness,
`/metrics`, `/version`), what the server holds (`/v1/models`: the base model and its LoRA
adapters; `/debug/kv`) and the gated API calls (`/v1/completions`, `/v1/chat/completions`, vLLM's
`/tokenize` and `/detokenize`, see tokenization.py; with --allow-runtime-lora-updating vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, see lora_admin.py; with --enable-sleep-mode vLLM's
`/sleep`, `/wake_up` and `/is_sleeping`, see sleep.py). What the routes share
is a `ServerState` (state.py).

Lifecycle: the app answers at once; the model loads in a background thread (then --lora-modules;
a module that fails to load stops the start), and until it is
in place `/ready` is 503 and API calls get 503 `loading`. `drain()` (called on SIGTERM) turns
readiness false, answers new API calls (and uploads still in progress) with 503 `draining`,
waits for the in-flight ones up to the grace period, then aborts the rest, which are told so
(`ShutdownError`: a 503, or an error event after `finish_reason: "abort"` on a stream); a
second signal (`hurry`) ends the wait at once the same way. If the engine thread dies, or the
model fails to load, `on_fatal` makes the process exit non-zero so that it is restarted.

API keys (`--api-key`, tidepool.common.api_key): when set, every path but the probes, `/metrics` and
`/version` answers 401 without a valid key, the LoRA admin endpoints and `/debug/kv` included.

Invariants: every error body has OpenAI's `{"error": {"message", "type", "param", "code"}}`
shape and is rendered with non-ASCII escaped, so no client input can make rendering fail; the
request gate (gate.py) counts a request in flight from its complete body to its last byte.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidepool.common.api_key import ApiKeyMiddleware, ApiKeys

from . import lora_admin, sleep, tokenization
from .async_engine import AsyncEngine, ShutdownError
from .gate import RequestGate, error_bytes
from .logprobs import LogprobFormatter
from .metrics import EngineMetrics
from .prompts import PromptEncoder
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, param_from_loc
from .replies import answering_shutdown
from .serving import Serving
from .state import ServerConfig, ServerState
from .tools.plan import ToolSettings

logger = logging.getLogger(__name__)

_ABORT_WAIT_S = 5.0  # after aborting, how long the drain waits for the aborted requests to be answered


def build_app(config: ServerConfig, api_keys: ApiKeys | None = None) -> FastAPI:
    """The server's app: the API-key check (with `api_keys`) and the request gate in front, the routes by family,
    the model loading in the background."""
    state = ServerState(config)
    app = FastAPI(title="Tidepool", lifespan=_lifespan(state))
    app.state.tidepool = state
    app.add_middleware(RequestGate, state=state)  # type: ignore[arg-type]
    if api_keys is not None:  # added last: outermost, so a request without a key learns nothing, not even "loading"
        app.add_middleware(ApiKeyMiddleware, keys=api_keys)  # type: ignore[arg-type]
    _add_error_handlers(app)
    _add_probe_routes(app, state)
    _add_info_routes(app, state)
    _add_api_routes(app, state)
    if config.allow_runtime_lora_updating:
        _add_lora_routes(app, state)
    if config.enable_sleep_mode:
        sleep.add_routes(app, state)
    return app


def _lifespan(state: ServerState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start loading the model when the app starts; stop the engine thread and the encoder when it ends."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        threading.Thread(target=_load, args=(state, loop), name="tidepool-load", daemon=True).start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop)  # the engine thread closes the engine itself
        if state.serving is not None:
            state.serving.encoder.close()

    return lifespan


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    """What Kubernetes and Prometheus ask: `/health` (liveness), `/ready` (readiness), `/metrics`, `/version`."""

    @app.get("/health")
    async def health() -> Response:
        if state.load_error is not None or (state.engine is not None and not state.engine.is_alive):
            return JSONResponse({"status": "dead"}, status_code=500)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        reason = state.not_ready_reason()
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


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """What the server holds: `/v1/models` (OpenAI's model list) and `/debug/kv` (block-pool occupancy)."""
    config = state.config

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(
            id=config.model_name,
            created=int(state.started),
            root=config.engine.model,
            max_model_len=state.engine.info.max_model_len if state.engine else None,
        )
        snapshot = state.engine.info.lora_snapshot if state.engine else None
        adapters = lora_admin.adapter_cards(snapshot(), card) if snapshot is not None else []
        return ModelList(data=[card, *adapters]).model_dump()

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
            "num_receiving_http": state.num_receiving,
        }


def _add_api_routes(app: FastAPI, state: ServerState) -> None:
    """The gated API calls (gate.is_api_path): completions, chat completions, vLLM's tokenize and detokenize."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _require_serving(state).completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _require_serving(state).chat(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> Response:
        serving = _require_serving(state)
        return JSONResponse(await tokenization.tokenize(serving, tokenization.parse_tokenize(body)))

    @app.post("/detokenize")
    async def detokenize(body: tokenization.DetokenizeRequest) -> Response:
        return JSONResponse(await tokenization.detokenize(_require_serving(state), body))


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's runtime adapter endpoints (lora_admin.py), only with --allow-runtime-lora-updating (else 404)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: lora_admin.LoadLoRAAdapterRequest) -> Response:
        engine, name = _require_engine(state), body.lora_name
        await answering_shutdown(lora_admin.load(engine, state.config.model_name, name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: lora_admin.UnloadLoRAAdapterRequest) -> Response:
        await answering_shutdown(lora_admin.unload(_require_engine(state), body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def drain(app: FastAPI) -> None:
    """Readiness false, new API calls 503, wait for in-flight ones (abort after the grace period or on `hurry`)."""
    state: ServerState = app.state.tidepool
    state.is_draining = True
    state.drain_started.set()
    timeout = state.config.drain_timeout_s
    logger.info("draining: %d in-flight request(s), grace period %.0f s", state.num_inflight, timeout)
    deadline = time.monotonic() + timeout
    while state.num_inflight > 0 and time.monotonic() < deadline and not state.hurry.is_set():
        with suppress(TimeoutError):
            await asyncio.wait_for(state.hurry.wait(), 0.05)
    if state.num_inflight > 0 and state.engine is not None:
        if state.hurry.is_set():
            error = ShutdownError("the server is shutting down now (a second shutdown signal); the request was "
                                  "aborted: retry it", "shutdown")  # fmt: skip
        else:
            error = ShutdownError(f"the server is shutting down and its grace period ({timeout:g} s) ended before "
                                  "this request finished; it was aborted: retry it", "drain_timeout")  # fmt: skip
        logger.warning("aborting %d in-flight request(s): %s", state.num_inflight, error.code)
        state.engine.abort_all(error)
        abort_deadline = time.monotonic() + _ABORT_WAIT_S
        while state.num_inflight > 0 and time.monotonic() < abort_deadline:
            await asyncio.sleep(0.05)
    logger.info("drained")


def _load(state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
    """Load the model off the event loop, build what the server needs from it, then hand over to the loop."""
    try:
        from ..llm_engine import LLMEngine

        engine = LLMEngine(state.config.engine)
        config = state.config
        async_engine = AsyncEngine(engine, None, config.max_queue_len, config.retry_after_s)
        info = async_engine.info
        async_engine.metrics = EngineMetrics(config.model_name, info.max_model_len, info.max_num_batched_tokens,
                                             info.cache_config)  # fmt: skip
        async_engine.metrics.record_startup(engine.startup_phases)
        if state.sleep is not None:
            state.sleep.export_to(async_engine.metrics.registry, config.model_name)
        registry = engine.lora
        register = registry.register if registry is not None else None
        lora_admin.load_modules(register, info.load_lora, config.lora_modules)  # before the server is ready
        if registry is not None:
            async_engine.metrics.enable_lora(registry.max_loras)
        encoder = PromptEncoder(info.tokenizer, info.max_model_len)
        tools = ToolSettings(config.enable_auto_tool_choice, config.tool_call_parser)
        serving = Serving(async_engine, config.model_name, encoder, LogprobFormatter(info.tokenizer), tools)
    except BaseException as err:
        if isinstance(err, lora_admin.LoRAModuleError):
            logger.error("failed to start: %s", err)
        else:
            logger.exception("failed to load the model")
        state.load_error = err
        if state.on_fatal is not None:
            loop.call_soon_threadsafe(state.on_fatal)
        return
    loop.call_soon_threadsafe(_engine_ready, state, async_engine, serving, loop)


def _engine_ready(state: ServerState, engine: AsyncEngine, serving: Serving, loop: asyncio.AbstractEventLoop) -> None:
    state.engine, state.metrics, state.serving = engine, engine.metrics, serving
    engine.on_dead = state.on_fatal
    engine.start(loop)
    logger.info("ready: serving %s as %r", state.config.engine.model, state.config.model_name)


def _require_engine(state: ServerState) -> AsyncEngine:
    if state.engine is None:
        raise _still_loading()
    return state.engine


def _require_serving(state: ServerState) -> Serving:
    if state.serving is None:
        raise _still_loading()
    return state.serving


def _still_loading() -> APIError:
    return APIError("the model is still loading", status_code=503, type="service_unavailable", code="loading")


def error_response(err: APIError) -> Response:
    return Response(error_bytes(err.body()), status_code=err.status_code, headers=err.headers,
                    media_type="application/json")  # fmt: skip


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> Response:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> Response:
        errors = err.errors()
        # A union reports a type mismatch for every member it was not; the other errors say more.
        first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0] if errors else {})
        param = param_from_loc(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('msg', '')}", None
        elif first.get("type") == "invalid_unicode":
            message, param = str(first.get("msg")), str(first.get("ctx", {}).get("param"))
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
            if "input" in first and param is not None:
                message += f" (got {_shown(first['input'])})"
        return error_response(APIError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> Response:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = _body_error(err.__cause__) if err.status_code == 400 and err.__cause__ is not None else None
        error = APIError(message or str(err.detail), status_code=err.status_code, type=kind,
                         headers=getattr(err, "headers", None))  # fmt: skip
        return error_response(error)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(APIError(f"internal error: {err!r}", status_code=500, type="internal_error"))


def _body_error(cause: BaseException) -> str | None:
    """What was wrong with a body FastAPI could not parse (it says only "There was an error parsing the body").

    FastAPI turns JSON syntax errors into validation errors itself; what reaches here are the
    failures of `json.loads` that are not syntax errors.
    """
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not valid {cause.encoding.upper()} (byte {cause.start}: {cause.reason}); "
                "send JSON encoded as UTF-8")  # fmt: skip
    if isinstance(cause, RecursionError):
        return "the request body nests arrays or objects too deeply to parse; flatten it"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        limit = sys.get_int_max_str_digits()
        return f"the request body holds a number with more than {limit} digits; no parameter takes one that large"
    return None


def _shown(value: Any) -> str:
    """A short rendering of an offending input value for an error message."""
    try:
        text = json.dumps(value, default=str)
    except ValueError:  # NaN/infinity are not JSON
        text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
