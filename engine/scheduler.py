"""Continuous-batching scheduler: one token budget per step, chunked prefill, preemption by recompute.

Every request's `num_computed_tokens` catches up with its `num_tokens`: a prefill, a chunk of
a prefill and a decode are the same thing here, so one loop serves all three and decodes mix
with prefills in one step. Running requests are served first (in arrival order), then waiting
ones, while the budget (`max_num_batched_tokens`) and `max_num_seqs` allow.

When the KV cache is full, a running request not yet scheduled in this step is preempted:
the one whose recompute wastes the least work (fewest computed tokens), preferring requests
never preempted before, so no request is preempted again while others qualify. A preempted
request frees its blocks (its prefix stays in the prefix cache) and goes back to the waiting
queue in its arrival position. Pure Python, no torch.

LoRA: a request with an adapter (`lora_id`) enters the running batch only when `lora_gate.acquire`
gives its adapter a device slot; otherwise it waits and the requests behind it (base ones, those of
resident adapters) still go on, so a missing slot never stalls the step. It releases the slot
whenever it leaves the batch (preempted, finished, aborted).

A request asking for prompt logprobs takes no prefix-cache hits for its prompt (prompt_logprobs.py);
one with `max_tokens=0` never samples (`needs_sample` stays False) and finishes with "length" in
the update that completes its prompt.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from .kv_cache import KVCacheManager
from .request import Request, RequestStatus
from .sched_output import ModelRunnerOutput, ScheduledSeq, SchedulerOutput


class LoRAGate(Protocol):
    """Device slots for adapters (engine/lora/registry.py): held by a request while it is in the running batch."""

    def acquire(self, request: Request) -> bool: ...

    def release(self, request: Request) -> None: ...


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        lora_gate: LoRAGate | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.lora_gate = lora_gate  # None: no adapters served
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[Request] = []  # sorted by (arrival_time, sequence number)
        self.running: list[Request] = []  # in arrival order
        self.requests: dict[str, Request] = {}
        self._order: dict[str, tuple[float, int]] = {}
        self._next_seq = 0
        self.num_preemptions_total = 0

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._order[request.request_id] = (request.arrival_time, self._next_seq)
        self._next_seq += 1
        self._enqueue_waiting(request)

    def add_prefilled_request(self, request: Request, fill: Callable[[list[int]], None]) -> bool:
        """Admit a request whose prompt KV was computed elsewhere (P/D disaggregation) straight into running.

        The request holds its prompt and its first output token. Blocks for the prompt are
        allocated here and `fill(block_ids)` writes the received KV into them at once — before
        anything else can read them, since allocation already offers full blocks to the prefix
        cache. Returns False, changing nothing, when there is no room (sequence limit or KV
        memory); the caller retries later. A first token that already ends the request (EOS,
        max_tokens) retires it right after the fill.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if len(self.running) >= self.max_num_seqs or not self._acquire_adapter(request):
            return False
        if not self.kv_cache.allocate_slots(request, request.num_prompt_tokens):
            self._release_adapter(request)
            return False
        try:
            fill(self.kv_cache.block_ids(request.request_id))
        except BaseException:
            self.kv_cache.discard(request)  # allocation offered the blocks to the prefix cache: withdraw them
            self._release_adapter(request)
            raise
        self.requests[request.request_id] = request
        self._order[request.request_id] = (request.arrival_time, self._next_seq)
        self._next_seq += 1
        request.num_computed_tokens = request.num_prompt_tokens
        request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self._insert_running(request)
        status = self._check_stop(request, request.output_token_ids[-1])
        if status is not None:
            self.running.remove(request)
            self._retire(request, status)
        return True

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort, or stop on a stop string) requests wherever they are; frees everything at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._retire(request, status)
            finished.append(request)
        return finished

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, spec_token_ids: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Pick this step's work; `spec_token_ids` are proposals (request id -> tokens) to verify this step."""
        budget = self.max_num_batched_tokens
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledSeq] = {}
        preempted_this_step = False

        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                continue
            spec = self._fit_proposals(request, num_new, budget, spec_token_ids)
            if spec and not self.kv_cache.allocate_slots(request, num_new + len(spec)):
                spec = []  # proposals never cost another request its place: retry without them
            while not spec and not self.kv_cache.allocate_slots(request, num_new):
                victim = self._choose_victim(exclude=scheduled)
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                preempted_this_step = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            scheduled[request.request_id] = self._scheduled(request, request.num_computed_tokens, num_new, spec)
            budget -= num_new + len(spec)

        # New work only when nothing had to be preempted: memory is tight otherwise.
        index = 0  # waiting requests before it wait for an adapter slot this step
        while index < len(self.waiting) and budget > 0 and not preempted_this_step and self._has_seq_room():
            request = self.waiting[index]
            if not self._acquire_adapter(request):
                index += 1  # its adapter has no device slot this step: it waits, the others go on
                continue
            hits, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0 and not _needs_prompt_states(request):
                hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            if (num_new > budget and not self.enable_chunked_prefill) or not self.kv_cache.allocate_slots(
                request, min(num_new, budget), hits
            ):
                self._release_adapter(request)
                break  # head-of-line waits: later requests never jump a request that does not fit
            num_new = min(num_new, budget)
            self.waiting.pop(index)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens += num_hit_tokens
            request.status = RequestStatus.RUNNING
            self._insert_running(request)
            scheduled[request.request_id] = self._scheduled(request, request.num_computed_tokens, num_new)
            budget -= num_new

        decodes = [seq for seq in scheduled.values() if seq.num_new_tokens == 1 and seq.needs_sample]
        prefills = [seq for seq in scheduled.values() if not (seq.num_new_tokens == 1 and seq.needs_sample)]
        out.scheduled = decodes + prefills
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.num_preemptions = len(out.preempted_request_ids)
        return out

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests that hit a stop condition."""
        finished: list[Request] = []
        for seq in sched_out.scheduled:
            request = seq.request
            if request.is_finished:
                continue
            num_spec = len(seq.spec_token_ids)
            tokens = runner_out.new_token_ids(request.request_id)
            # KV is valid through the known tokens and the accepted proposals: every emitted token but
            # the last (a rejected proposal's slot is recomputed with the right token next step).
            num_accepted = max(len(tokens) - 1, 0)
            request.num_computed_tokens = seq.num_computed_tokens + seq.num_new_tokens - num_spec + num_accepted
            status = None
            if request.sampling_params.max_tokens == 0 and request.num_computed_tokens >= request.num_prompt_tokens:
                status = RequestStatus.FINISHED_LENGTH  # prefill only: done once the prompt is computed
            for index, token in enumerate(tokens):  # stop conditions apply to every token, in order
                request.output_token_ids.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    del tokens[index + 1 :]  # none is emitted past a stop: the runner output lists only emitted ones
                    break
            if status is not None:
                self.running.remove(request)
                self._retire(request, status)
                finished.append(request)
            elif num_spec:
                self.kv_cache.free_tail(request, request.num_tokens)
        return finished

    # ---- internals ----------------------------------------------------------------------------
    def _scheduled(self, request: Request, start: int, num_new: int, spec: list[int] | None = None) -> ScheduledSeq:
        needs_sample = start + num_new == request.num_tokens and request.sampling_params.max_tokens != 0
        spec = spec or []
        block_ids = self.kv_cache.block_ids(request.request_id)
        return ScheduledSeq(request, start, num_new + len(spec), block_ids, needs_sample, list(spec))

    @staticmethod
    def _fit_proposals(
        request: Request, num_new: int, budget: int, spec_token_ids: dict[str, list[int]] | None
    ) -> list[int]:
        """The request's proposals that fit this step: only when it reaches its last known token."""
        if not spec_token_ids or request.num_computed_tokens + num_new != request.num_tokens:
            return []
        if request.sampling_params.max_tokens == 0:
            return []
        return spec_token_ids.get(request.request_id, [])[: budget - num_new]

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.stop_token_id = token
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_token_id = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _choose_victim(self, exclude: dict[str, ScheduledSeq]) -> Request:
        """Running request not yet scheduled this step whose recompute wastes least; never-preempted first."""
        candidates = [r for r in self.running if r.request_id not in exclude]
        return min(candidates, key=lambda r: (r.num_preemptions > 0, r.num_computed_tokens, self._neg_order(r)))

    def _neg_order(self, request: Request) -> tuple[float, int]:
        arrival, seq = self._order[request.request_id]
        return (-arrival, -seq)  # among equals, the latest arrival goes first

    def _has_seq_room(self) -> bool:
        return len(self.running) < self.max_num_seqs

    def _acquire_adapter(self, request: Request) -> bool:
        return request.lora_id is None or self.lora_gate is None or self.lora_gate.acquire(request)

    def _release_adapter(self, request: Request) -> None:
        if request.lora_id is not None and self.lora_gate is not None:
            self.lora_gate.release(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_adapter(request)
        self.kv_cache.free(request, keep_hashes=True)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions_total += 1
        self._enqueue_waiting(request)

    def _retire(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:  # taken out of the running batch by the caller
            self._release_adapter(request)
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        del self._order[request.request_id]

    def _enqueue_waiting(self, request: Request) -> None:
        keys = [self._order[r.request_id] for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self._order[request.request_id]), request)

    def _insert_running(self, request: Request) -> None:
        keys = [self._order[r.request_id] for r in self.running]
        self.running.insert(bisect.bisect(keys, self._order[request.request_id]), request)


def _needs_prompt_states(request: Request) -> bool:
    """Prompt logprobs need every prompt position's hidden state: no prefix-cache hits until a token is out."""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids
