"""The commands the event loop sends the engine thread, and the engine requests they carry.

Role: the vocabulary of `AsyncEngine`'s inbox. The HTTP side puts one command per call
(`add`, `abort`, `abort_all`, `stop`, LoRA's `register_adapter` / `unregister_adapter`, and `CallEngine` for
sleep mode's sleep and wake, server/sleep.py); the
engine thread drains the inbox before each step and applies the commands by type, in the order
they were put.

Invariants:
- Commands are frozen, and what they carry is handed over: a `Child` is complete (grammar and
  KV transfer attached) before it is put, and the event-loop side never changes it afterwards.
- `EngineCommand` is every command there is; the engine thread matches it exhaustively.
- A command with a `reply` (the adapter registry's, `CallEngine`) gets exactly one answer: its result, its
  `LoRAError`, or `EngineDeadError` when the engine thread ends before applying it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kv_transfer import KVPayload, ProducerParams
from ..sampling_params import SamplingParams
from ..structured_outputs import Grammar

if TYPE_CHECKING:
    from ..llm_engine import LLMEngine
    from ..lora.peft import LoadedAdapter
    from ..lora.types import AdapterInfo


@dataclass(slots=True)
class Child:
    """One engine request of an HTTP request (n > 1 and prompt lists fan out into several)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer: ProducerParams | KVPayload | None = None  # P/D disaggregation (see server/disagg.py)
    grammar: Grammar | None = None  # the compiled form of params.structured_outputs (server/structured.py)
    lora_name: str | None = None  # the adapter the request's `model` selected; None: the base model


@dataclass(frozen=True, slots=True)
class AddRequests:
    """Hand an HTTP request's engine requests to the engine, all arrived at `arrival_time` (monotonic)."""

    children: list[Child]
    arrival_time: float


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Abort these engine requests (ids the engine no longer knows are ignored)."""

    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Abort every unfinished request and end the engine thread."""


@dataclass(frozen=True, slots=True)
class RegisterAdapter:
    """Add a loaded adapter (files read and checked off the engine thread) to the engine's registry."""

    adapter: LoadedAdapter
    reply: Future[AdapterInfo]


@dataclass(frozen=True, slots=True)
class UnregisterAdapter:
    """Remove an adapter: requests already admitted with it finish, new ones are refused (404)."""

    name: str
    reply: Future[None]


@dataclass(frozen=True, slots=True)
class CallEngine:
    """Run `fn(engine)` on the engine thread between two steps (sleep mode: server/sleep.py); its result, or what
    it raised, is the reply."""

    fn: Callable[[LLMEngine], Any]
    reply: Future[Any]


EngineCommand = AddRequests | AbortRequests | StopEngine | RegisterAdapter | UnregisterAdapter | CallEngine
