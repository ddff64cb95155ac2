"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, computed during prefill.

Role: for a request with `SamplingParams.prompt_logprobs = k`, the model runner keeps, besides the
sampled rows, the hidden rows of every prompt position its prefill chunk computes, and this module
turns them into, for each prompt position p >= 1: log_softmax(logits at p - 1)[prompt[p]] with its
rank, plus the k most likely tokens with theirs. As vLLM's, these are of the raw model distribution
(before temperature, penalties, `logit_bias` or any mask), the convention the sampler's logprobs of
generated tokens follow too. The engine accumulates them per request by position
(`TrackedRequest.add_prompt_logprobs`).

Invariants:
- A chunk covering positions [start, start + num_new) yields entries for prompt positions
  start + 1 .. min(start + num_new, num_prompt - 1): each position exactly once over a request's
  prefill, whatever the chunking; a recomputed chunk (preemption) yields the same positions again,
  which the accumulator skips.
- Positions served from the prefix cache have no hidden states, so, as in vLLM, a request asking
  for prompt logprobs does not use cached prefix blocks for its prompt (the scheduler skips the
  lookup until it has generated a token; its own blocks still enter the prefix cache for others).
- Logits are computed in slices of at most `_MAX_ROWS` rows, so a long prefill chunk never holds a
  [num_tokens, vocab] float32 matrix at once. Tensor/pipeline parallelism needs nothing more: the
  runner's model (or its distributed stand-in) computes logits for any rows it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .outputs import Logprob
from .sampler import token_logprobs
from .sched_output import ScheduledSeq

_MAX_ROWS = 1024  # logits rows per slice: 1024 x a 128k vocabulary in float32 is 512 MiB


@dataclass(slots=True)
class PromptRows:
    """The hidden rows of one sequence's chunk that predict prompt tokens."""

    request_id: str
    first_row: int  # row in the step's hidden states of the first predicting position
    first_position: int  # prompt position the first row predicts (>= 1)
    target_ids: list[int]  # the prompt tokens predicted, one per row
    num_top: int  # alternatives wanted per position


def rows_for(seq: ScheduledSeq, query_start: int) -> PromptRows | None:
    """What `seq`'s chunk (its tokens starting at row `query_start`) contributes; None when nothing."""
    request = seq.request
    num_top = request.sampling_params.prompt_logprobs
    if num_top is None:
        return None
    start = seq.num_computed_tokens
    stop = min(start + seq.num_new_tokens, request.num_prompt_tokens - 1)  # rows [start, stop) predict a prompt token
    if stop <= start:
        return None
    targets = request.prompt_token_ids[start + 1 : stop + 1]
    return PromptRows(request.request_id, query_start, start + 1, targets, num_top)


@torch.inference_mode()
def compute(
    model: torch.nn.Module, hidden: torch.Tensor, plans: list[PromptRows]
) -> dict[str, tuple[int, list[dict[int, Logprob]]]]:
    """request id -> (first position, entries), the prompt token first in each entry, then its top alternatives."""
    result: dict[str, tuple[int, list[dict[int, Logprob]]]] = {}
    for plan in plans:
        entries: list[dict[int, Logprob]] = []
        for offset in range(0, len(plan.target_ids), _MAX_ROWS):
            targets = plan.target_ids[offset : offset + _MAX_ROWS]
            first = plan.first_row + offset
            entries.extend(_entries(model, hidden[first : first + len(targets)], targets, plan.num_top))
        result[plan.request_id] = (plan.first_position, entries)
    return result


def _entries(
    model: torch.nn.Module, hidden: torch.Tensor, targets: list[int], num_top: int
) -> list[dict[int, Logprob]]:
    logprobs = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
    chosen, top_ids, top_values, ranks = token_logprobs(logprobs, targets, num_top, with_ranks=True)
    assert ranks is not None  # asked for
    entries = []
    for row, target in enumerate(targets):
        entry = {target: Logprob(chosen[row], ranks[row])}
        for rank, (token_id, value) in enumerate(zip(top_ids[row], top_values[row], strict=True), start=1):
            entry.setdefault(token_id, Logprob(value, rank))
        entries.append(entry)
    return entries
