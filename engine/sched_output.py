"""Plain dataclasses passed between the scheduler, the model runner and back (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .request import Request

if TYPE_CHECKING:
    from .outputs import Logprob


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    num_computed_tokens: int  # tokens already in the KV cache before this step (start position)
    num_new_tokens: int  # tokens whose KV this step computes
    block_ids: list[int]  # the request's whole block table after allocation
    # True when this step reaches the end of the known tokens, so the next token is sampled.
    # Fixed at schedule time: the request grows once the sampled token is appended.
    needs_sample: bool
    # Speculative decoding: proposed tokens fed after the request's known tokens (counted in
    # num_new_tokens); the runner returns logits at the last known token and at each of them.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefills
    num_batched_tokens: int = 0  # sum of num_new_tokens
    preempted_request_ids: list[str] = field(default_factory=list)  # preempted during this schedule
    num_preemptions: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    # request_id -> sampled token id, for the sequences whose `needs_sample` was true
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # request_id -> (sampled token logprob, [(token id, logprob)] top-n), when logprobs were asked for
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    # Speculative decoding, for sequences scheduled with spec_token_ids (never in sampled_token_ids):
    # request_id -> target logits, a float32 torch.Tensor [num_spec + 1, vocab] (typed Any: no torch here)
    spec_logits: dict[str, Any] = field(default_factory=dict)
    # request_id -> tokens the rejection sampler emitted: accepted proposals, then one resampled/bonus token
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> (first prompt position, one {token id: Logprob} per position from there), for the prompt
    # positions this step computed of requests with prompt_logprobs (prompt_logprobs.py)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)

    def new_token_ids(self, request_id: str) -> list[int]:
        """Every token this step produced for the request, in order (empty when it produced none)."""
        spec = self.spec_token_ids.get(request_id)
        if spec is not None:
            return spec
        token = self.sampled_token_ids.get(request_id)
        return [] if token is None else [token]
