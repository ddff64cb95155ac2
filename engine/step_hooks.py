"""The one way optional features plug into the engine loop: `StepHook` and what it is given.

Role: `LLMEngine.step()` stays schedule → run → update; speculative decoding and the P/D KV
hand-off (and later features) take part only through the lifecycle points below, which the
engine calls on every hook in `LLMEngine.hooks` (and calls a hook in no other way). `StepHook`
has no-op defaults, so a hook overrides only the points it needs. `HookContext` is what a hook may be built from (see
`engine_builder.py`).

When each point is called (all on the engine thread; hooks are not thread-safe):
- `on_add(request, kv_transfer)`: for every request `LLMEngine.add_request` accepts, once the
  engine's own checks passed and before the request is queued. A hook that takes part in the
  request (the KV hand-off: a request carrying `kv_transfer`) returns an `OnAdd`: whether it
  holds the request outside the scheduler (it is admitted later, through `admitted`), and the
  requests it can admit now. It may raise `ValueError` to refuse the request, but only before
  it records anything (the request is then not queued). A `kv_transfer` no hook takes part in is
  refused by the engine. Otherwise it returns None.
- `before_schedule(view)`: once per step, before `Scheduler.schedule`. A hook contributes to
  the step through its returned `BeforeSchedule`, never by touching the engine: proposed tokens
  to verify this step (`spec_token_ids`), and requests it put into the scheduler's running
  queue with their first token (`admitted`, consumed lazily: the engine emits each one's first
  token before asking for the next). The engine applies a hook's result before calling the
  next hook, so a later hook's `view.running` already holds what an earlier one admitted.
- `after_run(sched_out, runner_out)`: inside the isolated model run, right after the runner,
  possibly several times in one step (the whole batch, then one sequence at a time when the
  batch failed; see isolation.py). It may raise: the requests of that run then fail alone. It
  may fill `runner_out` for the step's sequences (the speculator's emitted tokens).
- `before_update(sched_out, runner_out)`: once per non-empty step, after the isolated run and
  before `Scheduler.update_from_output` (so the blocks of requests about to finish are still
  theirs). `runner_out` holds only the sequences that ran; it must not raise.
- `on_abort(request_id)`: for every id in `LLMEngine.abort_request`, after the scheduler has
  finished its own. A hook that holds a request outside the scheduler (a received request
  waiting for KV room) drops it and returns it; the engine then finishes it. Otherwise None.
- `on_finish(request_id)`: exactly once per request that was added, whether it finished,
  was aborted or failed, when the engine builds its final output; the hook forgets the
  request. It must not raise (a finished request always reaches its caller).
- `has_pending()`: whether the hook holds work that needs more steps (keeps the loop going).
- `stats()`: `EngineStats` fields the hook owns (cumulative counters), by field name.
- `close()`: once, when the engine closes; release threads and sockets.

Ordering: at every point hooks run in registration order. What a hook must not do: build
`RequestOutput`s (every output is built in `LLMEngine`, one output path), advance requests
(only `Scheduler.update_from_output` does), or call back into `LLMEngine`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig
    from .kv_transfer import KVPayload, ProducerParams
    from .request import Request
    from .sampler import Sampler
    from .sched_output import ModelRunnerOutput, SchedulerOutput
    from .scheduler import Scheduler
    from .tokenizer import Tokenizer


class StepView(Protocol):
    """What `before_schedule` may read of the engine: the running requests, in arrival order."""

    @property
    def running(self) -> Sequence[Request]: ...


@dataclass(slots=True)
class BeforeSchedule:
    """A hook's contribution to the coming step."""

    # request id -> proposed tokens to feed after the request's pending token and verify this step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # (request, first token) for each request the hook admitted into the running queue; lazy
    admitted: Iterable[tuple[Request, int]] = ()


@dataclass(slots=True)
class OnAdd:
    """A hook's part in a request being added."""

    held: bool = False  # the hook holds the request outside the scheduler until it admits it
    # (request, first token) for each request the hook admits now, as in `BeforeSchedule.admitted`; lazy
    admitted: Iterable[tuple[Request, int]] = ()


class StepHook:
    """Base of every engine feature hook; each method's default does nothing (see the module docstring)."""

    def on_add(self, request: Request, kv_transfer: ProducerParams | KVPayload | None) -> OnAdd | None:
        return None

    def before_schedule(self, view: StepView) -> BeforeSchedule | None:
        return None

    def after_run(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        return None

    def before_update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        return None

    def on_abort(self, request_id: str) -> Request | None:
        return None

    def on_finish(self, request_id: str) -> None:
        return None

    def has_pending(self) -> bool:
        return False

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class HookContext:
    """The engine parts and sizes a hook may be built from, resolved once by the builder."""

    tokenizer: Tokenizer
    model_config: ModelConfig  # the whole model's (not one rank's shard)
    sampler: Sampler
    scheduler: Scheduler
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # the runner's paged KV cache, per layer
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    show_progress: bool
