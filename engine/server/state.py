"""What the server is configured with and what it holds while it runs: `ServerConfig` and `ServerState`.

Role: the one object the routes (app.py), the request gate (gate.py) and the command line
(cli.py) share. `ServerState` is built with the app, filled in on the event loop once the model
has loaded (`engine`, `serving`, `metrics`), and read by readiness, the gate and the drain.

Invariants:
- The event-loop thread changes a `ServerState`, so its counters need no lock; the loading thread
  only sets `load_error` when the model fails to load (a working engine is handed over with
  `call_soon_threadsafe`).
- `not_ready_reason()` is the one answer to "may an API call start now?": `/ready` and the gate
  both ask it, so readiness and admission never disagree.
- `ServerConfig`'s defaults are the serve-flag table's (one source for the CLI, the operator and
  this class); --lora-modules arrives parsed (lora_modules.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidepool.contract.serve_flags import flag_default

from ..engine_config import EngineConfig
from .async_engine import AsyncEngine
from .lora_modules import LoRAModule
from .metrics import EngineMetrics
from .serving import Serving

if TYPE_CHECKING:
    from .sleep import SleepControl


@dataclass(slots=True)
class ServerConfig:
    """`tidepool serve`'s settings: the engine's and the HTTP side's (queue bound, drain, bodies, tools)."""

    engine: EngineConfig
    model_name: str
    max_queue_len: int = flag_default("max-queue-len")  # engine requests waiting before new ones get 429
    retry_after_s: int = flag_default("retry-after")  # the Retry-After header sent with 429
    drain_timeout_s: float = flag_default("drain-timeout")  # grace period for in-flight requests after SIGTERM
    max_body_bytes: int = flag_default("max-body-bytes")  # larger request bodies get 413
    body_read_timeout_s: float = flag_default("body-read-timeout")  # a client pausing mid-body gets 408
    enable_auto_tool_choice: bool = flag_default("enable-auto-tool-choice")  # tool_choice "auto" allowed
    tool_call_parser: str | None = flag_default("tool-call-parser")  # the model's tool-call format (tools/parsers.py)
    lora_modules: list[LoRAModule] = field(default_factory=list)  # adapters loaded before the server is ready
    allow_runtime_lora_updating: bool = flag_default("allow-runtime-lora-updating")  # load/unload endpoints
    enable_sleep_mode: bool = flag_default("enable-sleep-mode")  # vLLM's /sleep, /wake_up, /is_sleeping (sleep.py)


@dataclass(slots=True)
class ServerState:
    """The running server: the engine once loaded, readiness, drain signals and in-flight counts."""

    config: ServerConfig
    engine: AsyncEngine | None = None
    serving: Serving | None = None
    metrics: EngineMetrics | None = None
    sleep: SleepControl | None = None  # with --enable-sleep-mode (sleep.py); asleep, /ready stays true
    load_error: BaseException | None = None
    is_draining: bool = False
    num_inflight: int = 0  # API requests with a complete body, until their last byte is sent
    num_receiving: int = 0  # API requests whose body is still arriving (they never hold a drain)
    started: float = field(default_factory=time.time)
    on_fatal: Callable[[], None] | None = None  # asks the server process to exit (set by the CLI)
    drain_started: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)  # a second signal: abort now

    @property
    def engine_died(self) -> bool:
        return self.engine is not None and self.engine.error is not None

    def not_ready_reason(self) -> str | None:
        if self.load_error is not None:
            return "load_failed"
        if self.is_draining:
            return "draining"
        if self.serving is None:
            return "loading"
        if self.engine is not None and not self.engine.is_alive:
            return "engine_dead"
        return None
