"""The commands the event loop sends the engine thread, and the engine requests they carry.

Role: the vocabulary of `AsyncEngine`'s inbox. The HTTP side puts one command per call
(`add`, `abort`, `abort_all`, `stop`); the engine thread drains the inbox before each step and
applies the commands by type, in the order they were put.

Invariants:
- Commands are frozen, and what they carry is handed over: a `Child` is complete (grammar and
  KV transfer attached) before it is put, and the event-loop side never changes it afterwards.
- `EngineCommand` is every command there is; the engine thread matches it exhaustively.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kv_transfer import KVPayload, ProducerParams
from ..sampling_params import SamplingParams
from ..structured_outputs import Grammar


@dataclass(slots=True)
class Child:
    """One engine request of an HTTP request (n > 1 and prompt lists fan out into several)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer: ProducerParams | KVPayload | None = None  # P/D disaggregation (see server/disagg.py)
    grammar: Grammar | None = None  # the compiled form of params.structured_outputs (server/structured.py)


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


EngineCommand = AddRequests | AbortRequests | StopEngine
