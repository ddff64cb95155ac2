"""The router's FastAPI app: OpenAI-compatible routes in front of engine pools, and its background tasks.

Routes: `POST /v1/completions`, `/v1/chat/completions` and vLLM's `/tokenize` and
`/detokenize` (proxied, see `proxy`), `GET /v1/models` (the union of the ready replicas of the
serving pool, so every LoRA adapter of the pool is listed once; held like a request while none is
ready), `/health` (the router process is alive), `/ready` (200 as soon as
the router runs, even at zero replicas: it must take requests in to hold them, which is what
makes the pool scale up from zero), `/metrics` (the router's own metrics), `/debug/replicas`
(pool states, JSON).

Background tasks, started with the app and cancelled at shutdown: discovery (static or
Kubernetes) and the health checker. The router never loads a model and never imports torch.

API keys (`RouterConfig.api_keys`, tidepool.common.api_key): every path but `/health`, `/ready` and
`/metrics` needs one of the keys. A client's `Authorization` (or `x-api-key`) is forwarded to the
engines unchanged (the engines of one service hold the same keys); the router's own calls to
engines (health probes, model lists) send its first key.

Shutdown (`drain`, run by tidepool.common.graceful's server on SIGTERM): `/ready` turns 503, new
requests are answered 503 `draining`, in-flight ones (streams included) get `drain_timeout_s` to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidepool.common.api_key import ApiKeyAuth, ApiKeyMiddleware, ApiKeys
from tidepool.common.graceful import Drain, DrainGate

from .discovery import KubernetesDiscovery, StaticDiscovery
from .health import HealthChecker
from .lora import merge_model_lists
from .metrics import RouterMetrics
from .policy import HotThresholds, make_policy
from .pool import Endpoint, NoReplicaError, Pool
from .proxy import Proxy, ProxySettings
from .upstream import FORWARDED_HEADERS, REPLICA_HEADER, error_response

logger = logging.getLogger(__name__)

PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@dataclass(slots=True)
class RouterConfig:
    discovery: StaticDiscovery | KubernetesDiscovery
    pool_names: tuple[str, ...]  # ("unified",) or ("prefill", "decode")
    policy: str = "prefix-aware"
    thresholds: HotThresholds = field(default_factory=HotThresholds)
    num_virtual_nodes: int = 160
    proxy: ProxySettings = field(default_factory=ProxySettings)
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    max_failures: int = 3
    eject_s: float = 5.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # between two bytes of an answer: a long prefill counts here
    max_connections: int = 1000
    api_keys: ApiKeys | None = None  # None: no key needed
    drain_timeout_s: float = 30.0  # after SIGTERM, how long in-flight requests get to finish


@dataclass(slots=True)
class RouterState:
    config: RouterConfig
    pools: dict[str, Pool]
    metrics: RouterMetrics
    proxy: Proxy | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    drain: Drain = field(default_factory=Drain)


def build_app(config: RouterConfig) -> FastAPI:
    """The router's app: one pool per name, the probes and the proxied routes; discovery and health run beside it."""
    pools = {
        name: Pool(
            name,
            make_policy(config.policy, config.thresholds, config.num_virtual_nodes),
            config.max_failures,
            config.eject_s,
        )
        for name in config.pool_names
    }
    state = RouterState(config, pools, RouterMetrics(pools.values()))
    app = FastAPI(title="Tidepool router", lifespan=_lifespan(state))
    app.state.router = state
    app.add_middleware(DrainGate, drain=state.drain)  # type: ignore[arg-type]
    if config.api_keys is not None:  # added last: outermost, so a request without a key is refused first
        app.add_middleware(ApiKeyMiddleware, keys=config.api_keys)  # type: ignore[arg-type]
    _add_error_handlers(app)
    _add_probe_routes(app, state)
    _add_models_route(app, state)
    _add_proxied_routes(app, state)
    return app


def _lifespan(state: RouterState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The upstream client, the proxy and the background tasks (discovery, health), for the app's lifetime."""
    config, pools = state.config, state.pools

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=100)
        # Requests that carry no key of their own (the router's probes and model lists) send the router's first key.
        auth = ApiKeyAuth(config.api_keys) if config.api_keys is not None else None
        async with httpx.AsyncClient(timeout=timeout, limits=limits, auth=auth) as client:
            state.proxy = Proxy(pools, client, state.metrics, config.proxy)
            health = HealthChecker(pools.values(), client, config.health_interval_s, config.health_timeout_s)

            async def on_update(pool_name: str, endpoints: list[Endpoint]) -> None:
                if pool_name == "decode":
                    missing = [e.url for e in endpoints if e.kv_addr is None]
                    if missing:
                        logger.warning("decode replicas without a KV port (named 'kv') are skipped: %s", missing)
                    endpoints = [e for e in endpoints if e.kv_addr is not None]
                added = pools[pool_name].set_members(endpoints)
                if added:
                    await health.probe_now(pools[pool_name], added)

            state.tasks = [
                asyncio.create_task(config.discovery.run(on_update), name="router-discovery"),
                asyncio.create_task(health.run(), name="router-health"),
            ]
            try:
                yield
            finally:
                for task in state.tasks:
                    task.cancel()
                for task in state.tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    return lifespan


def _add_probe_routes(app: FastAPI, state: RouterState) -> None:
    """The router's own state: `/health`, `/ready`, `/metrics` and `/debug/replicas`."""

    @app.get("/health")
    async def health() -> Response:
        # Static discovery finishes after its one update; a task that raised is what makes the router dead.
        dead = [t.get_name() for t in state.tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if dead:
            return JSONResponse({"status": "dead", "failed_tasks": dead}, status_code=500)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.drain.is_draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/replicas")
    async def debug_replicas() -> dict[str, Any]:
        return {
            name: [
                {
                    "url": r.url,
                    "kv_addr": r.endpoint.kv_addr,
                    "state": r.state.value,
                    "inflight": r.num_inflight,
                    "waiting": r.num_waiting,
                    "running": r.num_running,
                    "kv_usage": r.kv_usage,
                    "adapters": None if r.models is None else sorted(r.models.adapters),
                }
                for r in pool.replicas.values()
            ]
            for name, pool in state.pools.items()
        }


def _add_models_route(app: FastAPI, state: RouterState) -> None:
    """`GET /v1/models`: the first ready replica's answer (held like a request), with the other ready replicas' models
    (LoRA adapters held by some replicas only) added; a replica that fails to answer only leaves its own out."""

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        assert state.proxy is not None  # set by the lifespan before any request is served
        pool = state.proxy.serving_pool
        deadline = time.monotonic() + state.config.proxy.hold_timeout_s
        try:
            replica, _ = await pool.acquire(None, deadline)
        except NoReplicaError as err:
            return error_response(503, f"{err}; retry later", "service_unavailable", "no_ready_replica")
        client = state.proxy.client
        headers = {name: raw.headers[name] for name in FORWARDED_HEADERS if name in raw.headers}  # the client's key
        others = [r for r in pool.ready() if r is not replica]
        try:
            upstream, *extra = await asyncio.gather(
                client.get(f"{replica.url}/v1/models", headers=headers),
                *(_model_list(client, r.url, headers) for r in others),
            )
        except httpx.HTTPError as err:
            return error_response(502, f"{replica.label}: {err!r}", "bad_gateway", "upstream_failed")
        finally:
            pool.release(replica)
        content = upstream.content
        if upstream.status_code == 200 and extra:
            with contextlib.suppress(ValueError):
                merged = merge_model_lists([upstream.json(), *extra])
                content = content if merged is None else json.dumps(merged).encode()
        return Response(content, upstream.status_code, {REPLICA_HEADER: replica.label}, media_type="application/json")


async def _model_list(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Any:
    """A replica's `/v1/models` JSON, or None when it does not answer one."""
    try:
        response = await client.get(f"{url}/v1/models", headers=headers)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _add_proxied_routes(app: FastAPI, state: RouterState) -> None:
    """The API calls, forwarded by the proxy once their body is a JSON object."""

    async def proxied(path: str, raw: Request) -> Response:
        assert state.proxy is not None  # set by the lifespan before any request is served
        try:
            body = json.loads(await raw.body())
        except (ValueError, UnicodeDecodeError) as err:
            return error_response(
                400, f"the request body is not valid JSON: {err}", "invalid_request_error", "invalid_json"
            )
        if not isinstance(body, dict):
            return error_response(
                400, "the request body must be a JSON object", "invalid_request_error", "invalid_json"
            )
        return await state.proxy.forward(path, body, raw)

    def proxy_route(path: str) -> None:
        async def route(raw: Request) -> Response:
            return await proxied(path, raw)

        app.post(path, name=path.strip("/").replace("/", "_"))(route)

    for path in PROXIED_PATHS:
        proxy_route(path)


async def drain(app: FastAPI) -> None:
    """Readiness false, new requests 503 `draining`; in-flight ones (streams too) get the grace period."""
    state: RouterState = app.state.router
    state.drain.start()
    timeout = state.config.drain_timeout_s
    logger.info("draining: %d request(s) in flight, grace period %g s", state.drain.num_inflight, timeout)
    if await state.drain.wait_drained(timeout):
        logger.info("drained")
    else:
        logger.warning("stopping with %d request(s) still in flight", state.drain.num_inflight)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> Response:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(err.status_code, str(err.detail), kind, str(err.status_code))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(500, f"internal error in the router: {err!r}", "internal_error", "router_error")
