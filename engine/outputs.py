"""What the engine returns: vLLM-shaped `RequestOutput` / `CompletionOutput` (plain dataclasses).

A request whose own processing failed inside a step (a per-request error the engine isolated,
so the other requests carried on) finishes with `finish_reason="abort"` and `error` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .stats import RequestMetrics


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # while running: only text that no stop string can still cut
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    # Per generated token: {token id: logprob} with the sampled token and the top-n alternatives.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # monotonic timestamps and counts, for the server's metrics
    error: str | None = None  # set when the engine finished this request because processing it failed
