"""The engine loop: requests in, one scheduled step at a time, outputs out.

`step()` reads as schedule → run → update: the scheduler picks the work, the model runner
computes it, the scheduler advances the requests, and this class turns new tokens into text
(incremental detokenization, stop strings) and `RequestOutput`s. It is synchronous and has
no HTTP or Kubernetes in it; the server drives it from a thread, `LLM` from a loop.
`engine_builder.build_engine` constructs the parts. Optional features (speculative decoding,
the P/D KV hand-off) are `StepHook`s in `self.hooks`, called at the points step_hooks.py
documents (a request's `kv_transfer` reaches the hand-off through `on_add`); they contribute
proposals and admitted requests as return values and never build outputs: every `RequestOutput`
is built here, the final one by `_finish_output` alone, and `_decide` alone decides from a
request's new tokens whether it goes on, was stopped by a stop string, or finished (and why).
Prompt logprobs are not a hook: they need the hidden rows only the runner holds, so the runner
returns them in `ModelRunnerOutput.prompt_logprobs` (prompt_logprobs.py) and `step()` adds them to
the request's `TrackedRequest`. A `max_tokens=0` request finishes in the step that completes its
prompt, with no token; its final output is built there too. Neither works with a P/D KV hand-off
(refused by the hand-off's `on_add`: the prompt would be computed on another engine).
Invariants: a request that fails validation raises `ValueError` before anything is queued,
so it never affects the requests already running. A request whose own processing raises
inside a step (the sampler on its parameters, its detokenization) is finished alone with
`finish_reason="abort"` and `RequestOutput.error`; when the batched run raises, the step's
sequences are rerun one at a time to find which ones fail (isolation.py), so the others carry
on with the tokens they would have had. A fault of the engine itself still raises.
LoRA: `self.lora` (engine/lora/registry.py, None unless enable_lora) names the adapters; a request's
`lora_name` is resolved to its adapter's current load at `add_request` (404 `LoRAError` when unknown).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from .detokenizer import IncrementalDetokenizer, StopMatch
from .engine_builder import build_engine
from .engine_config import EngineConfig
from .isolation import StepIsolation
from .kv_transfer import KVConnector, KVPayload, ProducerParams
from .lora.registry import LoRARegistry, load_id_of
from .lora.types import LoRAError
from .outputs import RequestOutput, TrackedRequest
from .request import Request, RequestStatus, check_prompt_token_ids
from .sampling_params import SamplingParams
from .sched_output import ModelRunnerOutput, SchedulerOutput
from .spec_decode.emit import feed_tokens
from .stats import EngineStats
from .step_hooks import OnAdd, StepHook
from .structured_outputs import Grammar, build_compiler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        self.config, self.resolved, self.tokenizer = parts.config, parts.resolved, parts.tokenizer
        self.model, self.model_config, self.threads, self.executor = (
            parts.model, parts.model_config, parts.threads, parts.executor
        )  # fmt: skip
        self.max_model_len = parts.resolved.max_model_len
        self.num_kv_blocks, self.kv_cache, self.scheduler = parts.num_kv_blocks, parts.kv_cache, parts.scheduler
        self.sampler, self.runner = parts.sampler, parts.runner
        # Optional features, as step hooks. The speculator's typed reference is for tests and benches; the
        # KV connector (a P/D engine's transport) is for the server, which waits on transfers.
        self.hooks: list[StepHook] = parts.hooks
        self.speculator = parts.speculator
        self.kv_connector: KVConnector | None = parts.kv_connector
        self.lora: LoRARegistry | None = parts.lora
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self._tracked: dict[str, TrackedRequest] = {}
        # Structured outputs: the server compiles through it off this thread; `add_request` takes the result.
        self.grammars = build_compiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.isolation = StepIsolation()
        self._ready: list[RequestOutput] = []  # built between steps (first tokens of admitted requests)
        self.last_stats = self._stats_with()
        self.startup_phases = parts.startup_phases  # seconds per start phase (engine/startup_phases.py)
        rc = self.resolved
        logger.info(
            "engine ready: %d KV blocks x %d tokens, max_model_len=%d, max_num_seqs=%d, "
            "budget=%d tokens/step, device=%s",
            self.num_kv_blocks, config.block_size, rc.max_model_len, config.max_num_seqs, rc.max_num_batched_tokens,
            rc.device,
        )  # fmt: skip

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        kv_transfer: ProducerParams | KVPayload | None = None,
        grammar: Grammar | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Validate and queue one sequence (n must be 1 here; `LLM` fans out n > 1).

        A request with `params.structured_outputs` is constrained by `grammar`, its compiled form (the
        server compiles it off this thread); without one it is compiled here (cached), and an invalid
        constraint raises `GrammarError` (a ValueError) before anything is queued.

        `kv_transfer` (P/D disaggregation, through the hand-off hook's `on_add`): `ProducerParams` on
        a prefill engine sends the prompt's KV and first token on once prefilled; a received `KVPayload`
        on a decode engine admits the request with that KV and continues from the first token, without
        recomputing the prompt.

        `lora_name` runs the request with that registered adapter (LoRAError 404 `model_not_found` when unknown).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError("LLMEngine.add_request takes n=1; fan out n > 1 into separate requests")
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids, text = self.validate_prompt(prompt)
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}); got {max(params.logit_bias)}")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            lora_name=lora_name,
            lora_id=load_id_of(self.lora, lora_name),
        )
        detok = IncrementalDetokenizer(
            self.tokenizer, token_ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
        )
        tracked = TrackedRequest(request, text, detok, [] if params.logprobs is not None else None)
        if params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None]  # nothing predicts the first prompt token
        joined = self._on_add(request, kv_transfer)
        if self.lora is not None and request.lora_id is not None:
            self.lora.on_add(request)  # counted as waiting for its adapter (the GIE metric) until it runs
        if not any(part.held for part in joined):  # a held request waits in its hook (for KV room), not scheduled
            self.scheduler.add_request(request)
        self._tracked[request_id] = tracked
        # Constrained once queued (nothing left to raise), before anything can sample or finish it.
        if params.structured_outputs is not None and grammar is not None:
            self.sampler.constrain(request, grammar, self.grammars.backend)
        for part in joined:
            self._admit(part.admitted)
        return request

    def _on_add(self, request: Request, kv_transfer: ProducerParams | KVPayload | None) -> list[OnAdd]:
        """The parts the hooks take in a new request (they may refuse it); a hand-off no hook takes is refused."""
        joined = [part for hook in self.hooks if (part := hook.on_add(request, kv_transfer)) is not None]
        if kv_transfer is not None and not joined:
            raise ValueError("this engine runs role='unified'; start it as 'prefill' or 'decode' for a hand-off")
        return joined

    def validate_prompt(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, list | tuple):
            token_ids, text = list(prompt), None
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        check_prompt_token_ids(token_ids, self.model_config.vocab_size, self.max_model_len)
        return token_ids, text

    def abort_request(self, request_ids: list[str] | str) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finished = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for request_id in ids:
            for hook in self.hooks:
                held = hook.on_abort(request_id)
                if held is not None:  # held by the hook, never scheduled: no blocks to free
                    held.status = RequestStatus.FINISHED_ABORTED
                    finished.append(held)
        return [self._finish_output(request) for request in finished]

    def has_unfinished_requests(self) -> bool:
        pending = any(hook.has_pending() for hook in self.hooks)
        return self.scheduler.has_unfinished_requests() or pending or bool(self._ready)

    def get_stats(self) -> EngineStats:
        return self._stats_with()

    def _stats_with(self, **step: float) -> EngineStats:
        kv = self.kv_cache
        owned: dict[str, int] = {}
        for hook in self.hooks:
            owned.update(hook.stats())
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_kv_blocks=kv.pool.num_blocks,
            block_size=kv.block_size,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            **owned,
            **step,
        )

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled forward pass; returns an output for every request that produced a token."""
        start = time.monotonic()
        proposals = self._before_schedule()
        ready, self._ready = self._ready + self._fail_unloadable_adapters(), []
        sched_out = self.scheduler.schedule(proposals)
        if sched_out.is_empty:
            return ready
        num_prompt_tokens = _num_prompt_tokens(sched_out)
        runner_out, errors = self.isolation.execute(self._run, sched_out)
        for hook in self.hooks:
            hook.before_update(sched_out, runner_out)
        failed = self._fail_requests(errors)
        finished = {r.request_id for r in self.scheduler.update_from_output(sched_out, runner_out)}
        now = time.monotonic()
        self.last_stats = self._stats_with(
            step_num_batched_tokens=sched_out.num_batched_tokens,
            step_num_prompt_tokens=num_prompt_tokens,
            step_num_generation_tokens=sum(
                len(runner_out.new_token_ids(s.request.request_id)) for s in sched_out.scheduled
            ),
            step_num_preemptions=sched_out.num_preemptions,
            step_duration_s=now - start,
        )
        return ready + failed + self._step_outputs(sched_out, runner_out, finished, now)

    def _before_schedule(self) -> dict[str, list[int]]:
        """Each hook's contribution, in order: its admitted requests' first tokens, its proposals (returned)."""
        proposals: dict[str, list[int]] = {}
        for hook in self.hooks:
            plan = hook.before_schedule(self.scheduler)
            if plan is not None:
                self._admit(plan.admitted)
                proposals.update(plan.spec_token_ids)
        return proposals

    def _step_outputs(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput, finished: set[str], now: float
    ) -> list[RequestOutput]:
        """The outputs of the step's sequences (a request whose own text or logprobs fail is failed alone)."""
        outputs: list[RequestOutput] = []
        stopped_by_text: list[str] = []
        emit_errors: dict[str, Exception] = {}
        for seq in sched_out.scheduled:
            request = seq.request
            tokens = runner_out.new_token_ids(request.request_id)
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                continue
            try:
                if request.request_id in runner_out.prompt_logprobs:
                    tracked.add_prompt_logprobs(*runner_out.prompt_logprobs[request.request_id])
                if not tokens:
                    if request.request_id in finished:  # max_tokens=0: finished by its prefill, no token
                        outputs.append(self._finish_output(request))
                    continue
                output = self._emit(request, tokens, runner_out, request.request_id in finished, now)
            except Exception as err:  # this request's own text or (prompt) logprobs: fail it alone
                emit_errors[request.request_id] = err
                continue
            if output is None:
                stopped_by_text.append(request.request_id)
            else:
                outputs.append(output)
        outputs.extend(self._fail_requests(emit_errors))
        for request in self.scheduler.finish_requests(stopped_by_text, RequestStatus.FINISHED_STOPPED):
            outputs.append(self._finish_output(request))
        return outputs

    def _emit(
        self, request: Request, tokens: list[int], runner_out: ModelRunnerOutput, is_finished: bool, now: float
    ) -> RequestOutput | None:
        """The output for a request's new tokens; None when a stop string ended it (the caller finishes it)."""
        token = tokens[-1]  # logprobs only come with one-token steps: no speculation for those requests
        tracked = self._tracked[request.request_id]
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        entry = runner_out.logprobs.get(request.request_id)
        if entry is not None and tracked.logprobs is not None:
            sampled_lp, top = entry
            tracked.logprobs.append({**dict(top), token: sampled_lp})
            tracked.cumulative_logprob += sampled_lp
        match = feed_tokens(tracked.detokenizer, request, tokens)
        return self._decide(request, tracked, match, is_finished)

    def _decide(
        self, request: Request, tracked: TrackedRequest, match: StopMatch | None, is_finished: bool
    ) -> RequestOutput | None:
        """After a request's new tokens were detokenized: its final output when the scheduler finished it (the
        stop reason: its stop token, else a stop string that came first); None when a stop string ends it
        now (the caller finishes it as stopped); else its incremental output."""
        if is_finished:
            if request.stop_token_id is not None:
                tracked.stop_reason = request.stop_token_id
            elif match is not None and request.status == RequestStatus.FINISHED_STOPPED:
                tracked.stop_reason = match.stop_str  # a stop string before the scheduler's stop token
            return self._finish_output(request)
        if match is not None:
            tracked.stop_reason = match.stop_str
            return None
        return tracked.output()

    # ---- per-request failure isolation ---------------------------------------------------------
    def _run(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        runner_out = self.runner.execute(sched_out)
        for hook in self.hooks:
            hook.after_run(sched_out, runner_out)
        return runner_out

    def _fail_unloadable_adapters(self) -> list[RequestOutput]:
        """Fail the waiting requests of adapters whose evicted weights could not be read again."""
        failed = self.lora.failed_load_ids() if self.lora is not None else {}
        errors = {r.request_id: LoRAError(failed[r.lora_id]) for r in self.scheduler.waiting if r.lora_id in failed}
        return self._fail_requests(errors) if errors else []

    def _fail_requests(self, errors: dict[str, Exception]) -> list[RequestOutput]:
        """Finish each failed request as aborted, with its error; the others are untouched."""
        outputs = []
        for request_id, err in errors.items():
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            logger.error("request %s failed and is finished with an error; the engine carries on", request_id,
                         exc_info=err)  # fmt: skip
            tracked.error = f"{type(err).__name__}: {err}"
            request = tracked.request
            if not request.is_finished:
                # Its KV may be half-written: drop its own blocks from the prefix cache before freeing them.
                self.kv_cache.discard(request)
                self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
                request.status = RequestStatus.FINISHED_ABORTED
            outputs.append(self._finish_output(request))
        return outputs

    # ---- requests admitted by a hook (P/D disaggregation) -------------------------------------------
    def _admit(self, admitted: Iterable[tuple[Request, int]]) -> None:
        """Emit each admitted request's first token before the hook admits the next (lazy iterable)."""
        for request, first_token in admitted:
            self._on_admitted(request, first_token)

    def _on_admitted(self, request: Request, first_token: int) -> None:
        """A received request now runs: emit its first token (it may already finish the request)."""
        request.first_token_time = request.last_token_time = time.monotonic()
        tracked = self._tracked[request.request_id]
        try:
            match = tracked.detokenizer.update([first_token])
        except Exception as err:
            self._ready.extend(self._fail_requests({request.request_id: err}))
            return
        output = self._decide(request, tracked, match, request.is_finished)
        if output is not None:
            self._ready.append(output)
            return
        for done in self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED):
            self._ready.append(self._finish_output(done))

    def close(self) -> None:
        """Release background resources (the KV connector's sockets and threads, parallel workers)."""
        for hook in self.hooks:
            hook.close()
        self.grammars.close()
        if self.lora is not None:
            self.lora.close()
        if self.executor is not None:
            self.executor.shutdown()

    # ---- outputs ------------------------------------------------------------------------------
    def _finish_output(self, request: Request) -> RequestOutput:
        """The final output; never raises, so a finished request always reaches its caller."""
        tracked = self._tracked.pop(request.request_id)
        request.finished_time = time.monotonic()
        try:
            tracked.detokenizer.finish()
        except Exception as err:
            logger.error("request %s: flushing its text failed", request.request_id, exc_info=err)
            tracked.error = tracked.error or f"{type(err).__name__}: {err}"
        self.sampler.release(request.request_id)
        if self.lora is not None and request.lora_id is not None:
            self.lora.on_finish(request)
        for hook in self.hooks:
            hook.on_finish(request.request_id)
        return tracked.output(finished=True)


def _num_prompt_tokens(sched_out: SchedulerOutput) -> int:
    """Prompt tokens computed in this step (a chunk may end in the prompt or run past it into the output)."""
    return sum(
        max(
            0,
            min(seq.num_computed_tokens + seq.num_new_tokens, seq.request.num_prompt_tokens) - seq.num_computed_tokens,
        )
        for seq in sched_out.scheduled
    )
