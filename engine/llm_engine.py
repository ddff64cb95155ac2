"""The engine loop: requests in, one scheduled step at a time, outputs out.

`step()` reads as schedule → run → update: the scheduler picks the work, the model runner
computes it, the scheduler advances the requests, and this class turns new tokens into text
(incremental detokenization, stop strings) and `RequestOutput`s. It is synchronous and has
no HTTP or Kubernetes in it; the server drives it from a thread, `LLM` from a loop.
Invariants: a request that fails validation raises `ValueError` before anything is queued,
so it never affects the requests already running. A request whose own processing raises
inside a step (the sampler on its parameters, its detokenization) is finished alone with
`finish_reason="abort"` and `RequestOutput.error`; when the batched run raises, the step's
sequences are rerun one at a time to find which ones fail (isolation.py), so the others carry
on with the tokens they would have had. A fault of the engine itself still raises.
"""

from __future__ import annotations

import logging
import time

import torch

from .config import ModelConfig
from .detokenizer import IncrementalDetokenizer
from .distributed.executor import MultiprocExecutor
from .engine_config import CPU_KV_CACHE_BYTES, EngineConfig, ResolvedConfig, check_kv_capacity, resolve, resolve_model
from .isolation import StepIsolation
from .kv_cache import KVCacheManager
from .kv_transfer import KVConnector, KVGeometry, KVPayload, ProducerParams
from .kv_transfer.handoff import KVHandoff
from .model_runner import ModelRunner, kv_bytes_per_block
from .models.loader import load_model
from .outputs import RequestOutput, TrackedRequest
from .request import Request, RequestStatus, check_prompt_token_ids
from .sampler import Sampler
from .sampling_params import SamplingParams
from .sched_output import ModelRunnerOutput, SchedulerOutput
from .scheduler import Scheduler
from .spec_decode.emit import feed_tokens
from .spec_decode.speculator import Speculator
from .stats import EngineStats
from .threads import configure_threads
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = resolve_model(config)  # catalogue names, GGUF folders -> the folder or file to load
        if config.quantization is not None:
            from .quant.prepare import prepare_quantized

            quantized = prepare_quantized(config.model, config.quantization)
            config = config.model_copy(update={"model": quantized, "tokenizer": config.tokenizer or config.model})
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
        model_config = ModelConfig.from_pretrained(config.model)
        self.resolved: ResolvedConfig = resolve(config, model_config)
        rc = self.resolved
        self.threads = configure_threads(config.num_threads, is_cpu=rc.device.type == "cpu")
        self.executor: MultiprocExecutor | None = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.executor = MultiprocExecutor(config, rc)  # worker processes; rank 0's shard runs here
            self.model, self.model_config = self.executor.model, self.executor.model_config
            runner_config, sizing_config = self.executor.runner_config, self.executor.sizing_config
        else:
            self.model, self.model_config = load_model(
                config.model,
                dtype=rc.dtype,
                device=rc.device,
                max_positions=rc.max_model_len,
                show_progress=config.show_progress,
                quantization=config.quantization,
            )
            runner_config = sizing_config = self.model_config
        self.max_model_len = rc.max_model_len
        num_blocks = rc.num_kv_blocks or self._size_kv_cache(sizing_config)
        if self.executor is not None:
            self.executor.init_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=rc.max_num_batched_tokens,
            max_model_len=rc.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.sampler = Sampler(config.seed, rc.device)
        self.runner = ModelRunner(self.model, runner_config, config.block_size, num_blocks, self.sampler, rc.device)
        if self.executor is not None:
            self.executor.model.bind_kv_caches(self.runner.kv_caches)
        self.speculator: Speculator | None = None
        if config.speculative is not None:
            self.speculator = Speculator.build(
                config.speculative, self.sampler, self.tokenizer, self.model_config, rc.dtype, rc.device,
                rc.max_model_len, rc.max_num_batched_tokens, config.block_size, num_blocks, config.max_num_seqs,
                config.show_progress,
            )  # fmt: skip
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self._tracked: dict[str, TrackedRequest] = {}
        self.isolation = StepIsolation()
        # P/D disaggregation (kv_transfer): requests whose KV goes to a decode engine once prefilled,
        # received requests waiting for KV room, and first-token outputs of admitted ones.
        self.handoff = self._make_handoff()
        self._import_outputs: list[RequestOutput] = []
        self.last_stats = self._stats_with()
        logger.info(
            "engine ready: %d KV blocks x %d tokens, max_model_len=%d, max_num_seqs=%d, "
            "budget=%d tokens/step, device=%s",
            num_blocks, config.block_size, rc.max_model_len, config.max_num_seqs, rc.max_num_batched_tokens, rc.device,
        )  # fmt: skip

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        kv_transfer: ProducerParams | KVPayload | None = None,
    ) -> Request:
        """Validate and queue one sequence (n must be 1 here; `LLM` fans out n > 1).

        `kv_transfer` (P/D disaggregation): `ProducerParams` on a prefill engine sends the prompt's
        KV and first token on once prefilled; a received `KVPayload` on a decode engine admits the
        request with that KV and continues from the first token, without recomputing the prompt.
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
        if kv_transfer is not None:
            if self.handoff is None:
                raise ValueError("this engine runs kv_role='unified'; start it as 'prefill' or 'decode' for a hand-off")
            self.handoff.check(kv_transfer, token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )
        detok = IncrementalDetokenizer(
            self.tokenizer, token_ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
        )
        tracked = TrackedRequest(request, text, detok, [] if params.logprobs is not None else None)
        if isinstance(kv_transfer, KVPayload):
            request.output_token_ids.append(kv_transfer.first_token_id)
            self._tracked[request_id] = tracked
            self.handoff.imports[request_id] = (request, kv_transfer)
            self.handoff.admit(self._on_admitted)
            return request
        if kv_transfer is not None:
            self.handoff.producers[request_id] = kv_transfer
        self.scheduler.add_request(request)
        self._tracked[request_id] = tracked
        return request

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
        for request_id in ids if self.handoff else ():
            waiting = self.handoff.abort(request_id)
            if waiting is not None:  # never admitted: no blocks to free
                waiting.status = RequestStatus.FINISHED_ABORTED
                finished.append(waiting)
        return [self._finish_output(request) for request in finished]

    def has_unfinished_requests(self) -> bool:
        pending = self.handoff is not None and self.handoff.has_pending
        return self.scheduler.has_unfinished_requests() or pending or bool(self._import_outputs)

    def get_stats(self) -> EngineStats:
        return self._stats_with()

    def _stats_with(self, **step: float) -> EngineStats:
        kv = self.kv_cache
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
            spec_num_draft_tokens=self.speculator.num_draft_tokens if self.speculator else 0,
            spec_num_accepted_tokens=self.speculator.num_accepted_tokens if self.speculator else 0,
            **step,
        )

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled forward pass; returns an output for every request that produced a token."""
        start = time.monotonic()
        if self.handoff is not None:
            self.handoff.admit(self._on_admitted)
        ready, self._import_outputs = self._import_outputs, []
        proposals = self.speculator.propose(self.scheduler.running) if self.speculator else None
        sched_out = self.scheduler.schedule(proposals)
        if sched_out.is_empty:
            return ready
        num_prompt_tokens = sum(
            max(
                0,
                min(seq.num_computed_tokens + seq.num_new_tokens, seq.request.num_prompt_tokens)
                - seq.num_computed_tokens,
            )
            for seq in sched_out.scheduled
        )
        runner_out, errors = self.isolation.execute(self._run, sched_out)
        if self.handoff is not None:
            self.handoff.send_prefilled(sched_out, runner_out)
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
        outputs: list[RequestOutput] = ready + failed
        stopped_by_text: list[str] = []
        emit_errors: dict[str, Exception] = {}
        for seq in sched_out.scheduled:
            request = seq.request
            tokens = runner_out.new_token_ids(request.request_id)
            if not tokens or request.request_id not in self._tracked:
                continue
            try:
                output = self._emit(request, tokens, runner_out, request.request_id in finished, now)
            except Exception as err:  # this request's own text or logprobs: fail it alone
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
        if self.speculator is not None:
            self.speculator.verify(sched_out, runner_out)
        return runner_out

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
                if self.handoff is not None:
                    self.handoff.abort(request_id)
                request.status = RequestStatus.FINISHED_ABORTED
            outputs.append(self._finish_output(request))
        return outputs

    # ---- P/D disaggregation -------------------------------------------------------------------
    @property
    def kv_connector(self) -> KVConnector | None:
        """The KV connector of a prefill or decode engine (None when unified)."""
        return self.handoff.connector if self.handoff is not None else None

    def _make_handoff(self) -> KVHandoff | None:
        config = self.config
        if config.kv_role == "unified":
            return None
        if self.executor is not None:
            raise ValueError(
                f"kv_role={config.kv_role!r} needs tensor_parallel_size=pipeline_parallel_size=1 for now "
                "(each rank would ship its own KV shard); run prefill and decode engines without TP/PP"
            )
        mc = self.model_config
        geometry = KVGeometry(mc.num_hidden_layers, config.block_size, mc.num_key_value_heads, mc.head_dim,
                              self.resolved.dtype)  # fmt: skip
        return KVHandoff(config.kv_role, geometry, self.runner.kv_caches, self.scheduler, self.sampler,
                         mc.vocab_size, config.kv_port, config.kv_transfer_timeout_s)  # fmt: skip

    def _on_admitted(self, request: Request, first_token: int) -> None:
        """A received request now runs: emit its first token (it may already finish the request)."""
        request.first_token_time = request.last_token_time = time.monotonic()
        tracked = self._tracked[request.request_id]
        try:
            match = tracked.detokenizer.update([first_token])
        except Exception as err:
            self._import_outputs.extend(self._fail_requests({request.request_id: err}))
            return
        if request.is_finished:
            if request.stop_token_id is not None:
                tracked.stop_reason = request.stop_token_id
            self._import_outputs.append(self._finish_output(request))
        elif match is not None:
            tracked.stop_reason = match.stop_str
            for done in self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED):
                self._import_outputs.append(self._finish_output(done))
        else:
            self._import_outputs.append(tracked.output())

    def close(self) -> None:
        """Release background resources (the KV connector's sockets and threads, parallel workers)."""
        if self.handoff is not None:
            self.handoff.close()
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
        if self.speculator is not None:
            self.speculator.release(request.request_id)
        return tracked.output(finished=True)

    # ---- sizing -------------------------------------------------------------------------------
    def _size_kv_cache(self, kv_config: ModelConfig) -> int:
        """Blocks that fit the budget; `kv_config` describes one rank's cache (its layers, its kv heads)."""
        rc, config = self.resolved, self.config
        per_block = kv_bytes_per_block(kv_config, config.block_size, rc.dtype)
        if rc.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(rc.device)
            # Keep headroom for activations: one full step's logits and hidden states, doubled.
            activations = (
                2 * rc.max_num_batched_tokens * (self.model_config.vocab_size + 8 * self.model_config.hidden_size) * 4
            )
            budget = int(total * config.gpu_memory_utilization) - (total - free) - activations
        else:
            budget = config.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
        useful = -(-config.max_num_seqs * rc.max_model_len // config.block_size)
        num_blocks = min(budget // per_block, useful)
        check_kv_capacity(num_blocks, config.block_size, rc.max_model_len)
        return num_blocks
