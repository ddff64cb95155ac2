"""What one HTTP request becomes for the engine: its engine requests (one per prompt and per `n`), and its state.

Role: `build_job` checks each prompt against the engine's limits (context length, token ids,
`min_tokens`) and builds the `SamplingParams` of each engine request; seeded requests get seed,
seed+1, ... as `LLM.generate` does; every engine request carries the LoRA adapter the request's
`model` selected (None: the base model), and the response echoes `model` as vLLM does.
Invariant: every check that can fail runs here, before anything is queued, and raises
`APIError` naming the parameter.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..outputs import RequestOutput
from ..request import check_prompt_token_ids
from .checks import check_min_tokens, sampling_params
from .commands import Child
from .engine_info import EngineInfo
from .prompt_logprobs import engine_prompt_logprobs
from .protocol import APIError, SamplingRequest, Usage


@dataclass(slots=True)
class Job:
    """One HTTP request's engine requests and what is needed to answer it."""

    response_id: str
    created: int
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    n: int
    model: str  # what the response says in `model`: the served model's name or the adapter's
    children: list[Child] = field(default_factory=list)
    index_of: dict[str, int] = field(default_factory=dict)  # engine request id -> choice index
    finals: dict[str, RequestOutput] = field(default_factory=dict)  # engine request id -> final output

    def usage_so_far(self, req: SamplingRequest, index: int, generated: int = 0) -> Usage | None:
        """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): the usage of streamed choice
        `index` after its first `generated` tokens; None when not asked for."""
        options = req.stream_options
        if options is None or not (options.include_usage and options.continuous_usage_stats):
            return None
        prompt = len(self.prompts[index // self.n])
        return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(out.outputs[0].token_ids) for out in self.finals.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def build_job(
    info: EngineInfo,
    kind: str,
    prompts: list[list[int]],
    texts: list[str | None],
    req: SamplingRequest,
    budget: tuple[int | None, str | None],
    prompt_param: str,
    logprobs: int | None,
    logit_bias: dict[int, float] | None,
    *,
    model: str,
    lora_name: str | None = None,
) -> Job:
    """The engine requests for `prompts` (n each), run with adapter `lora_name` (None: the base model) and
    answered as `model`. `budget` is (max_tokens, the request field it came from; None for a default); a
    max_tokens of None means the room each prompt leaves in the context."""
    max_tokens, max_tokens_from = budget
    job = Job(f"{kind}-{uuid.uuid4().hex}", int(time.time()), prompts, texts, req.n, model)
    limit = info.max_model_len
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise APIError(f"{prompt_param} is empty: give at least one token", param=prompt_param)
        wanted = len(prompt) + (1 if max_tokens is None else max_tokens)
        if wanted > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
                f"({len(prompt)} in the {prompt_param}, {wanted - len(prompt)} in the completion). "
                f"Please reduce the length of the {prompt_param} or completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        try:
            check_prompt_token_ids(prompt, info.vocab_size, limit)
        except ValueError as err:
            raise APIError(str(err), param=prompt_param) from err
        check_min_tokens(req.min_tokens, max_tokens, max_tokens_from, len(prompt), prompt_param, limit)
        budget_left = limit - len(prompt) if max_tokens is None else max_tokens
        params = sampling_params(req, budget_left, logprobs, logit_bias, engine_prompt_logprobs(req))
        for j in range(req.n):
            child = Child(f"{job.response_id}-{i}-{j}", prompt, params.for_completion(j), lora_name=lora_name)
            job.children.append(child)
            job.index_of[child.request_id] = i * req.n + j
    return job
