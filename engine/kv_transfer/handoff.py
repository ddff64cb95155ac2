"""The engine's side of the P/D hand-off: which requests send KV, which wait to be admitted with it.

`KVHandoff` is the engine's step hook (step_hooks.py) when its `role` is `prefill` or
`decode`, and runs on the engine thread only; it reaches the engine through the hook points
alone (`on_add` checks and takes the requests that carry a `kv_transfer`). Prefill: a producer
request's prompt KV and first token are copied out in the step that samples that token — before
the scheduler retires the request and frees its blocks — and sent on a sender thread while the
engine keeps stepping. Decode: a received
request waits here until the scheduler has room (`Scheduler.add_prefilled_request`, which
allocates blocks and lets us fill them before anything can read them), in arrival order.
Hook points: `on_add` takes part (a received request is held here and admitted at once when there
is room), `before_schedule` admits (lazily, one request at a time), `before_update` sends,
`on_abort` returns a request still waiting, `on_finish` forgets, `close` closes the connector.
Invariant: a request is in at most one of `producers` and `imports`, and leaves it when it is
sent, admitted, aborted or finished — so no block and no payload outlives its request.
With tensor/pipeline parallelism (`executor` set) the driver's own slab travels as above and the
workers act on the same points through commands (ranks.py): KV_SEND when a producer request sampled
(each rank pushes its pieces), KV_FILL inside the admission's fill (each rank writes its slab into the
blocks just allocated), KV_DROP when a received request is aborted or refused before admission.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from tidepool.contract.wire import MessageType

from ..request import Request
from ..sampling_params import SamplingParams
from ..sched_output import ModelRunnerOutput, SchedulerOutput
from ..step_hooks import BeforeSchedule, HookContext, OnAdd, StepHook, StepView
from . import KVConnector, KVLayout, KVPayload, KVRole, Manifest, ProducerParams, gather_kv, rank_limits, scatter_kv
from .ranks import engine_layout

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..distributed.executor import MultiprocExecutor
    from ..sampler import Sampler
    from ..scheduler import Scheduler


class KVHandoff(StepHook):
    def __init__(
        self,
        role: KVRole,
        layout: KVLayout,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        scheduler: Scheduler,
        sampler: Sampler,
        vocab_size: int,
        port: int,
        timeout_s: float,
        max_blocks: tuple[int, int],
        executor: MultiprocExecutor | None = None,
    ) -> None:
        """`max_blocks`: (blocks of one request at most, blocks of the whole cache)."""
        self.role = role
        self.block_size = layout.block_size
        self._executor = executor
        limits = rank_limits(layout, 0, max_blocks[0], vocab_size)
        self.connector = KVConnector(
            role, layout, limits, port=port, timeout_s=timeout_s,
            rank_addrs=executor.kv_addrs if executor else None, on_drop=self._drop_on_workers,
        )  # fmt: skip
        if executor is not None and self.connector.receiver is not None:
            self.connector.receiver.store.max_pending_blocks = max(max_blocks)
            executor.on_kv_stored = self.connector.receiver.rank_stored
        self._kv_caches = kv_caches
        self._scheduler = scheduler
        self._sampler = sampler
        self._vocab_size = vocab_size
        self.producers: dict[str, ProducerParams] = {}
        self.imports: dict[str, tuple[Request, KVPayload]] = {}

    @classmethod
    def build(
        cls, role: KVRole, port: int, timeout_s: float, ctx: HookContext, executor: MultiprocExecutor | None = None
    ) -> KVHandoff:
        mc = ctx.model_config
        parallel = executor.parallel if executor else None
        tp, pp = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) if parallel else (1, 1)
        layout = engine_layout(mc, ctx.block_size, ctx.dtype, tp, pp)
        max_blocks = (-(-ctx.max_model_len // ctx.block_size), ctx.num_kv_blocks)
        return cls(role, layout, ctx.kv_caches, ctx.scheduler, ctx.sampler, mc.vocab_size, port, timeout_s, max_blocks,
                   executor)  # fmt: skip

    def check(self, kv_transfer: ProducerParams | KVPayload, token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem when this request cannot take part in a hand-off here."""
        if params.prompt_logprobs is not None or params.max_tokens == 0:
            raise ValueError("prompt_logprobs and max_tokens=0 are not supported with a P/D KV hand-off")
        if isinstance(kv_transfer, ProducerParams):
            if self.role != "prefill":
                raise ValueError(f"this engine's role is {self.role!r}; only a 'prefill' engine sends KV")
            if params.max_tokens != 1:
                raise ValueError("a prefill (producer) request must have max_tokens=1: the decode engine generates")
            return
        if self.role != "decode":
            raise ValueError(f"this engine's role is {self.role!r}; only a 'decode' engine takes received KV")
        if kv_transfer.prompt_token_ids != token_ids:
            raise ValueError(
                f"KV transfer {kv_transfer.transfer_id} was prefilled for a different prompt "
                f"({len(kv_transfer.prompt_token_ids)} tokens vs {len(token_ids)}); send the same request "
                "body to the prefill and the decode engine"
            )
        if params.logprobs is not None:
            raise ValueError("logprobs are not supported for disaggregated requests yet")

    # ---- the step hook ------------------------------------------------------------------------
    def on_add(self, request: Request, kv_transfer: ProducerParams | KVPayload | None) -> OnAdd | None:
        """Check and take part in a request that carries a hand-off; a received one waits here for admission."""
        if kv_transfer is None:
            return None
        try:
            self.check(kv_transfer, request.prompt_token_ids, request.sampling_params)
            if isinstance(kv_transfer, KVPayload) and kv_transfer.lora_name != request.lora_name:
                raise ValueError(
                    f"KV transfer {kv_transfer.transfer_id} was prefilled with adapter {kv_transfer.lora_name!r} but "
                    f"this request asks for {request.lora_name!r}; send the same `model` to the prefill and the decode "
                    "engine"
                )
        except ValueError:
            if isinstance(kv_transfer, KVPayload):  # refused: its slabs on the workers will never be claimed
                self._drop_on_workers(kv_transfer.transfer_id)
            raise
        if isinstance(kv_transfer, ProducerParams):
            self.producers[request.request_id] = kv_transfer
            return OnAdd()
        request.output_token_ids.append(kv_transfer.first_token_id)
        self.imports[request.request_id] = (request, kv_transfer)
        return OnAdd(held=True, admitted=self.admit())

    def before_schedule(self, view: StepView) -> BeforeSchedule:
        return BeforeSchedule(admitted=self.admit())

    def before_update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        self.send_prefilled(sched_out, runner_out)

    def on_abort(self, request_id: str) -> Request | None:
        return self.abort(request_id)

    def on_finish(self, request_id: str) -> None:
        self.abort(request_id)

    def has_pending(self) -> bool:
        return bool(self.imports)

    def abort(self, request_id: str) -> Request | None:
        """Forget a request; returns it if it was still waiting for admission (it holds no blocks)."""
        self.producers.pop(request_id, None)
        entry = self.imports.pop(request_id, None)
        if entry is None:
            return None
        self._drop_on_workers(entry[1].transfer_id)
        return entry[0]

    def _drop_on_workers(self, transfer_id: str) -> None:
        """Tell the workers to forget a transfer's slabs (any thread: the executor serialises its sends)."""
        if self._executor is not None and self._executor.kv_addrs:
            try:
                self._executor.command(MessageType.KV_DROP, transfer_id=transfer_id)
            except RuntimeError as err:  # a failed worker: the engine's next step raises it
                logger.warning("could not drop KV transfer %s on the workers: %s", transfer_id, err)

    def _fill(self, payload: KVPayload, block_ids: list[int]) -> None:
        """Write a received transfer into the blocks just allocated: the driver's slab here, each worker's there."""
        scatter_kv(self._kv_caches, block_ids, payload.kv)
        if self._executor is not None:
            self._executor.command(MessageType.KV_FILL, transfer_id=payload.transfer_id, block_ids=block_ids)

    def send_prefilled(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Ship the prompt KV + first token of every producer request that sampled this step."""
        sender = self.connector.sender
        if not self.producers or sender is None:
            return
        for seq in sched_out.scheduled:
            request = seq.request
            token = runner_out.sampled_token_ids.get(request.request_id)
            if token is None or request.request_id not in self.producers:
                continue
            params = self.producers.pop(request.request_id)
            num_blocks = -(-request.num_prompt_tokens // self.block_size)
            block_ids = seq.block_ids[:num_blocks]
            if self._executor is not None:  # each worker copies its slab before the next step can touch the blocks
                # A dead worker: the next step raises WorkerFailedError; the manifest is refused meanwhile.
                with contextlib.suppress(OSError):
                    self._executor.broadcast(MessageType.KV_SEND, transfer_id=params.transfer_id,
                                             block_ids=list(block_ids), addr=params.decode_kv_addr)  # fmt: skip
            kv = gather_kv(self._kv_caches, block_ids)
            manifest = Manifest(params.transfer_id, list(request.prompt_token_ids), token, num_blocks,
                                request.lora_name)  # fmt: skip
            sender.send(params.decode_kv_addr, params.transfer_id, kv, manifest)

    def admit(self) -> Iterator[tuple[Request, int]]:
        """Admit waiting received requests in arrival order while there is room, yielding (request, first token).

        Lazy: the next request is admitted only once the caller has handled the last one (its first
        token may finish it and free its blocks for the next)."""
        for request_id, (request, payload) in list(self.imports.items()):
            if request_id not in self.imports:
                continue  # aborted while an earlier one was handled
            fill = functools.partial(self._fill, payload)
            if not self._scheduler.add_prefilled_request(request, fill):
                return  # no room yet: retried every step, in order
            del self.imports[request_id]
            params = request.sampling_params
            if params.seed is not None and not params.is_greedy:
                # The prefill engine drew the first token's noise from this seed: draw it here too, so a
                # seeded request's later tokens are the ones unified serving would sample.
                noise = torch.empty(self._vocab_size, device=self._sampler.device)
                noise.exponential_(generator=self._sampler.generator_for(request))
            yield request, payload.first_token_id

    def close(self) -> None:
        self.connector.close()
