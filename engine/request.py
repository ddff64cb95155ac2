"""A request's life inside the engine: its tokens, progress and status.

Invariants: `num_computed_tokens <= num_tokens`; tokens are only ever appended
(`output_token_ids`), never rewritten, so a preempted request resumes by recomputing its
KV from its own tokens. No torch here: the scheduler and KV manager use this class.
`check_prompt_token_ids` is the one definition of a valid token-id prompt, shared by the
engine and the HTTP server (which checks before queueing, from the engine's read-only info).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


def check_prompt_token_ids(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """ValueError saying what to fix unless `token_ids` is a non-empty prompt of in-vocabulary ids that fits."""
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    if len(token_ids) > max_model_len:  # first: a huge list is refused without scanning it
        raise ValueError(
            f"prompt has {len(token_ids)} tokens but max_model_len is {max_model_len}; "
            "shorten the prompt or raise max_model_len"
        )
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. `eq=False`: requests compare by identity."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_token_id: int | None = None  # the token that stopped it, if any
    # LoRA (engine/lora): the adapter's name and load id (None: the base model), fixed at add time; the load id
    # keys the prefix cache. `lora_slot`: its device slot while it runs (set and cleared by the registry's gate).
    lora_name: str | None = None
    lora_id: int | None = None
    lora_slot: int | None = None
    # Timestamps (monotonic seconds) for metrics; filled by the engine, never read by the scheduler.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the full list when avoidable."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
