"""vLLM's sleep-mode endpoints: `POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping` (contract/sleep.py).

Role: registered by app.py only with --enable-sleep-mode (else the three paths are 404, as in vLLM). A
`SleepControl` per server orders the calls (one at a time), tells the `AsyncEngine` to refuse new work,
runs the engine's `EngineSleeper` (engine/sleep.py) on the engine thread through a `CallEngine` command,
and exports the state as vLLM's `vllm:engine_sleep_state` gauge.

Decisions (vLLM's where it has one):
- Requests in flight when `/sleep` arrives are aborted, as vLLM's default `mode="abort"`: each is
  answered (503 `sleeping`, or on a stream an error event after `finish_reason: "abort"`), never left
  hanging, and their KV blocks are freed before the engine releases the memory.
- While asleep, new generation requests get 503 (OpenAI error body, type `service_unavailable`, code
  `sleeping`) naming the state; vLLM has no refusal of its own (a sleeping vLLM must not be sent work).
  `/tokenize`, `/detokenize`, `/v1/models` and the LoRA admin endpoints keep working (no model run).
- `/health` and `/ready` stay 200 while asleep: the pod is alive and stays routed, so a pool kept asleep on
  purpose is not restarted or unrouted; its router or operator wakes it (POST /wake_up) when work comes.
- `/sleep` while asleep at that level or deeper, and `/wake_up` while awake, are no-ops answered 200
  (a level 1 engine told to sleep at level 2 releases its weights too). `/wake_up` takes vLLM's
  optional `tags` (weights, kv_cache) and always wakes the engine whole.

Invariants: `SleepControl.level` changes only after the engine thread finished the change; `paused_error`
is set before the engine sleeps and cleared only after it woke, so no request ever runs on released memory;
a wake that fails (level 2: the model files unreadable) leaves the engine asleep and refusing, and says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from tidepool.contract import metrics_names as names
from tidepool.contract import sleep as contract

from ..sleep import EngineSleeper, SleepReport
from .async_engine import AsyncEngine, EngineDeadError, ShutdownError
from .commands import CallEngine
from .protocol import APIError
from .replies import engine_error

if TYPE_CHECKING:
    from ..llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineSleepingError(ShutdownError):
    """The engine sleeps (or was put to sleep while the request ran): 503 with code `sleeping`."""

    def __init__(self, message: str) -> None:
        super().__init__(message, contract.SLEEPING_CODE)


class ServerSide(Protocol):
    """What the control needs of the server's `ServerState` (state.py imports this module's names, not back)."""

    engine: AsyncEngine | None
    sleep: SleepControl | None


class SleepControl:
    """The server's sleep state; its methods run on the event loop."""

    def __init__(self, state: ServerSide) -> None:
        self.state = state
        self.level = 0  # 0: awake; what /is_sleeping and the gauge report
        self._lock = asyncio.Lock()
        self._sleeper: EngineSleeper | None = None  # made and used on the engine thread only

    @property
    def is_sleeping(self) -> bool:
        return self.level > 0

    async def sleep(self, level: int) -> None:
        async with self._lock:
            engine = self._async_engine()
            if level <= self.level:
                return
            first = self.level == 0
            if first:
                engine.paused_error = EngineSleepingError(
                    f"the engine is asleep (sleep level {level}); it serves again after POST {contract.WAKE_UP_PATH}"
                )
                aborted = EngineSleepingError(
                    "the engine was put to sleep while this request ran; it was aborted: retry it once the engine "
                    f"is awake (POST {contract.WAKE_UP_PATH})"
                )
                engine.abort_all(aborted, final=False)
            try:
                report: SleepReport = await self._call(engine, lambda e: self._sleeper_of(e).sleep(level))
            except BaseException:
                if first:
                    engine.paused_error = None
                raise
            self.level = report.level

    async def wake(self) -> None:
        async with self._lock:
            engine = self._async_engine()
            if self.level == 0:
                return
            await self._call(engine, lambda e: self._sleeper_of(e).wake())
            self.level = 0
            engine.paused_error = None

    def export_to(self, registry: CollectorRegistry, model_name: str) -> None:
        """vLLM's `vllm:engine_sleep_state{sleep_state}` gauge, read from `level` at each scrape."""
        registry.register(_SleepStateCollector(self, model_name))

    def _async_engine(self) -> AsyncEngine:
        engine = self.state.engine
        if engine is None:
            raise APIError("the model is still loading", status_code=503, type="service_unavailable", code="loading")
        return engine

    def _sleeper_of(self, engine: LLMEngine) -> EngineSleeper:
        if self._sleeper is None:
            self._sleeper = EngineSleeper(engine)
        return self._sleeper

    async def _call(self, engine: AsyncEngine, fn: Any) -> Any:
        try:
            return await engine.ask(CallEngine(fn, Future()))
        except (ShutdownError, EngineDeadError) as err:
            raise engine_error(err) from err
        except (RuntimeError, ValueError, OSError) as err:
            logger.error("sleep mode: %s", err)
            raise APIError(f"sleep mode: {err}", status_code=409 if isinstance(err, RuntimeError) else 500,
                           type="internal_error", code="sleep_failed") from err  # fmt: skip


class _SleepStateCollector:
    def __init__(self, control: SleepControl, model_name: str) -> None:
        self.control = control
        self.model_name = model_name

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            names.ENGINE_SLEEP_STATE,
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            labels=[names.MODEL_NAME_LABEL, names.SLEEP_STATE_LABEL],
        )
        current = contract.sleep_state(self.control.level)
        for value in contract.SLEEP_STATES:
            family.add_metric([self.model_name, value], 1.0 if value == current else 0.0)
        yield family

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return self.collect()


def add_routes(app: FastAPI, state: ServerSide) -> SleepControl:
    """Register the three endpoints on `app`; the returned control is also `state.sleep`."""
    control = SleepControl(state)
    state.sleep = control

    @app.post(contract.SLEEP_PATH)
    async def sleep(raw: Request) -> Response:
        try:
            level = contract.parse_level(raw.query_params.get(contract.LEVEL_PARAM))
        except ValueError as err:
            raise APIError(str(err), param=contract.LEVEL_PARAM) from err
        await control.sleep(level)
        return Response(status_code=200)

    @app.post(contract.WAKE_UP_PATH)
    async def wake_up(raw: Request) -> Response:
        try:
            tags = contract.parse_tags(raw.query_params.getlist(contract.TAGS_PARAM))
        except ValueError as err:
            raise APIError(str(err), param=contract.TAGS_PARAM) from err
        if tags:
            logger.info("wake_up tags %s: the engine wakes whole (weights and KV cache)", list(tags))
        await control.wake()
        return Response(status_code=200)

    @app.get(contract.IS_SLEEPING_PATH)
    async def is_sleeping() -> Response:
        return JSONResponse({contract.IS_SLEEPING_KEY: control.is_sleeping})

    return control
