"""Per-request failure isolation for one engine step: find the sequences that fail on their own.

Role: `LLMEngine.step()` runs the whole scheduled batch at once. When that raises (a sampler
error on one request's parameters, say), `execute_isolated` reruns the step's sequences one at
a time, so only the sequences that also fail alone are reported and the rest of the batch gets
its tokens in the same step.

Invariant: rerunning is safe because a failed run commits nothing: the scheduler advances
requests only in `update_from_output`, after this returns, and the KV slots a failed run may
have written are written again with the same values. Only the rare failing step pays for the
reruns; a healthy step runs exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .sched_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def execute_isolated(
    run: Callable[[SchedulerOutput], ModelRunnerOutput], sched_out: SchedulerOutput
) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
    """`run(sched_out)`, or on failure the merged outputs of the sequences that succeed alone, plus the
    error of each sequence (by request id) that fails alone."""
    try:
        return run(sched_out), {}
    except Exception as err:
        if len(sched_out.scheduled) == 1:
            return ModelRunnerOutput(), {sched_out.scheduled[0].request.request_id: err}
        logger.warning("a step of %d sequences failed (%r); rerunning them one at a time to find the cause",
                       len(sched_out.scheduled), err)  # fmt: skip
    merged = ModelRunnerOutput()
    errors: dict[str, Exception] = {}
    for seq in sched_out.scheduled:
        try:
            single = run(SchedulerOutput([seq], seq.num_new_tokens))
        except Exception as err:
            errors[seq.request.request_id] = err
            continue
        merged.sampled_token_ids.update(single.sampled_token_ids)
        merged.logprobs.update(single.logprobs)
        merged.spec_logits.update(single.spec_logits)
        merged.spec_token_ids.update(single.spec_token_ids)
    return merged, errors
