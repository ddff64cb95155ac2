"""What the engine returns: vLLM-shaped `RequestOutput` / `CompletionOutput` (plain dataclasses).

`TrackedRequest` is the engine's per-request output state (detokenizer, logprobs so far, why it
stopped or failed) and builds each `RequestOutput` from it. A request whose own processing
failed inside a step (a per-request error the engine isolated, so the other requests carried
on) finishes with `finish_reason="abort"` and `error` set.

Prompt logprobs (`SamplingParams.prompt_logprobs`) are vLLM-shaped: `RequestOutput.prompt_logprobs`
holds one entry per prompt token, the first None (nothing predicts it), each other a dict token id
-> `Logprob` with the prompt token and its top alternatives. `TrackedRequest.add_prompt_logprobs`
accumulates them over the prefill chunks by position, so a chunk computed twice (a preempted request
recomputing its prompt) adds nothing twice; outputs carry them once the prompt is complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .stats import RequestMetrics

if TYPE_CHECKING:
    from .detokenizer import IncrementalDetokenizer
    from .request import Request


@dataclass(slots=True)
class Logprob:
    """One token's log-probability and its 1-based rank in the distribution (vLLM's `Logprob`)."""

    logprob: float
    rank: int


PromptLogprobs = list[dict[int, Logprob] | None]


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
    # One entry per prompt token (the first None) once the prompt is prefilled, when prompt_logprobs was asked for.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class TrackedRequest:
    """One unfinished request's output state, kept by the engine until its final output."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0
    stop_reason: str | int | None = None
    error: str | None = None  # why the engine failed this request (it then finishes as aborted)
    prompt_logprobs: PromptLogprobs | None = None  # [None] when asked for, grown by position over prefill chunks

    def add_prompt_logprobs(self, first_position: int, entries: list[dict[int, Logprob]]) -> None:
        """Entries for prompt positions first_position, first_position + 1, ...; positions already held are skipped."""
        held = self.prompt_logprobs
        if held is None:
            return
        skip = len(held) - first_position
        if skip < 0:
            raise RuntimeError(f"prompt logprobs from position {first_position} but only {len(held)} held: a gap")
        held.extend(entries[skip:])

    def output(self, finished: bool = False) -> RequestOutput:
        """The request's output now: while running, only the text no stop string can still cut."""
        request = self.request
        detok = self.detokenizer
        if not finished:
            detok.get_delta_text()  # advance the streamed offset past text no stop string can cut
        text = detok.output_text if finished else detok.output_text[: detok.num_sent_chars]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            last_token_time=request.last_token_time,
            finished_time=request.finished_time,
            num_prompt_tokens=request.num_prompt_tokens,
            num_generation_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=self.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=metrics,
            error=self.error,
            prompt_logprobs=self._complete_prompt_logprobs(),
        )

    def _complete_prompt_logprobs(self) -> PromptLogprobs | None:
        held = self.prompt_logprobs
        if held is None or len(held) < self.request.num_prompt_tokens:
            return None
        return list(held)
