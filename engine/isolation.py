"""Per-request failure isolation for the engine's steps: fail the request at fault, never hide a broken engine.

Role: `LLMEngine.step()` runs the whole scheduled batch at once. When that raises (a sampler
error on one request's parameters, say), `StepIsolation.execute` reruns the step's sequences one
at a time: the sequences that also fail alone are reported (the engine finishes them with that
error) and the rest of the batch gets its tokens in the same step.

Invariants:
- Rerunning is safe because a failed run commits nothing: the scheduler advances requests only
  in `update_from_output`, after this returns, and the KV slots a failed run may have written are
  written again with the same values. A healthy step runs exactly once.
- A fault of the engine itself is re-raised, so the engine dies loudly (the server then exits
  and is restarted) instead of failing every request forever: errors of `FATAL_ERRORS` types (a
  dead parallel worker, out of memory), a step of several sequences in which every one fails
  alone, and `max_failed_steps` consecutive steps in which nothing could run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .distributed.executor import WorkerFailedError
from .sched_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

FATAL_ERRORS: tuple[type[BaseException], ...] = (WorkerFailedError, MemoryError, torch.cuda.OutOfMemoryError)


class StepIsolation:
    def __init__(self, max_failed_steps: int = 3) -> None:
        self.max_failed_steps = max_failed_steps
        self.num_failed_steps = 0  # consecutive steps in which no sequence could run

    def execute(
        self, run: Callable[[SchedulerOutput], ModelRunnerOutput], sched_out: SchedulerOutput
    ) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        """`run(sched_out)`, or on failure the merged outputs of the sequences that succeed alone, plus the
        error of each sequence (by request id) that fails alone. Raises when the fault is the engine's."""
        try:
            out = run(sched_out)
        except FATAL_ERRORS:
            raise
        except Exception as err:
            return self._isolate(run, sched_out, err)
        self.num_failed_steps = 0
        return out, {}

    def _isolate(
        self, run: Callable[[SchedulerOutput], ModelRunnerOutput], sched_out: SchedulerOutput, first: Exception
    ) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        scheduled = sched_out.scheduled
        merged = ModelRunnerOutput()
        errors: dict[str, Exception] = {}
        if len(scheduled) == 1:
            errors[scheduled[0].request.request_id] = first
        else:
            logger.warning("a step of %d sequences failed (%r); rerunning them one at a time to find the cause",
                           len(scheduled), first)  # fmt: skip
            for seq in scheduled:
                try:
                    single = run(SchedulerOutput([seq], seq.num_new_tokens))
                except FATAL_ERRORS:
                    raise
                except Exception as err:
                    errors[seq.request.request_id] = err
                    continue
                merged.sampled_token_ids.update(single.sampled_token_ids)
                merged.logprobs.update(single.logprobs)
                merged.spec_logits.update(single.spec_logits)
                merged.spec_token_ids.update(single.spec_token_ids)
                merged.prompt_logprobs.update(single.prompt_logprobs)
        if len(errors) < len(scheduled):  # some sequences ran: the fault is the failed ones' own
            self.num_failed_steps = 0
            return merged, errors
        if len(scheduled) > 1:
            raise first  # every sequence fails even alone: nothing about one request explains that
        self.num_failed_steps += 1
        if self.num_failed_steps >= self.max_failed_steps:
            raise first
        return merged, errors
