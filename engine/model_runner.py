"""The model runner: the only place a `SchedulerOutput` becomes tensors.

It owns the KV cache tensors (per layer, K and V, [num_blocks, block_size, num_kv_heads,
head_dim], zero-initialised so padded decode reads are finite), builds input ids, positions,
slot mapping, block tables and masks once per step, runs the model, computes logits only
for the sequences that sample this step, and hands those to the sampler (plus, for requests asking
for prompt logprobs, the rows of their prompt positions: prompt_logprobs.py). On CPU, when the compiled
GEMV is unavailable (`layers.linear`), it first stores the model's wide projections [in, out]
(`layers.weight_layout`), once, at construction; quantized weights are laid out for the compiled CPU
ops where those are available (`quant.runtime.prepare_for_cpu`). On CPU the weights and the KV cache then live in
memory advised for transparent huge pages (`hugepages`): fewer TLB misses while every step streams them.

On CUDA, host lists become device tensors through pinned memory with non-blocking copies, and
decode-only steps replay a CUDA graph per batch-size bucket (`cuda_graphs`; off with
TIDEPOOL_CUDA_GRAPHS=0). The graphs need one extra KV block, `num_blocks`, that the KV cache
manager never hands out: padding rows write their keys there.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from . import hugepages
from .config import ModelConfig
from .cuda_graphs import CudaGraphBackend, DecodeBatch, DecodeGraphs, GraphBackend, GraphInputs, capture_sizes
from .layers.attention_backend import (
    attach_kernel_views,
    build_decode_mask,
    build_prefill_mask,
    cpu_kernel_available,
)
from .layers.attention_metadata import AttentionMetadata, PrefillChunk
from .layers.linear import uses_compiled_gemv
from .layers.weight_layout import apply_weight_layout
from .models.llama import LlamaForCausalLM
from .prompt_logprobs import PromptRows, rows_for
from .prompt_logprobs import compute as compute_prompt_logprobs
from .quant.runtime import prepare_for_cpu
from .request import Request
from .sampler import Sampler
from .sampling_params import SamplingParams
from .sched_output import ModelRunnerOutput, ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)
CUDA_GRAPHS_ENV = "TIDEPOOL_CUDA_GRAPHS"


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        block_size: int,
        num_blocks: int,
        sampler: Sampler,
        device: torch.device,
        *,
        graph_backend: GraphBackend | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`graph_backend`: how decode graphs are captured (default: CUDA graphs on CUDA, none elsewhere).
        `max_model_len` sizes the graphs' block tables (default: the model's rotary table length)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.computes_prompt_logprobs = True  # False for a speculative draft's runner: nobody reads its prompt's
        # The compiled CPU attention op reads the kernel views and needs no decode mask or scratch.
        self.cpu_kernel = device.type == "cpu" and cpu_kernel_available()
        if device.type == "cpu" and isinstance(model, torch.nn.Module):
            if not uses_compiled_gemv():
                apply_weight_layout(model)  # the torch path: per-shape [in, out] storage, faster single-token matmuls
            prepare_for_cpu(model)  # quantized weights laid out for the compiled ops (a no-op without them)
            hugepages.pack_weights(model)  # after the layout changes: it moves the tensors as they now are
        if graph_backend is None and _graphs_wanted(model, device):
            graph_backend = CudaGraphBackend(device)
        self.graphs: DecodeGraphs | None = None
        if graph_backend is not None:
            max_len = max_model_len or model.rotary.cos_cached.shape[0]
            max_blocks = -(-max_len // block_size)
            self.graphs = DecodeGraphs(self._graph_forward, capture_sizes(256), max_blocks, num_blocks, block_size,
                                       device, graph_backend)  # fmt: skip
            num_blocks += 1  # the padding rows' sink block
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        started = time.perf_counter()
        self.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(config.num_hidden_layers)]
        self.kv_alloc_seconds = time.perf_counter() - started  # start-up phase "kv_cache" (engine_builder)

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":  # reserved, not touched: pages fault in (kernel-zeroed) as blocks are used
            return hugepages.zeros(shape, self.config.torch_dtype)
        return torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        if self.graphs is not None:
            decode = self._graph_batch(sched_out)
            if decode is not None:
                return self._execute_graph(*decode)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_requests = []
        spec_rows: list[tuple[str, int, int]] = []  # (request id, first logits row, number of rows)
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        prefill_tables: list[list[int]] = []
        prompt_rows: list[PromptRows] = []
        bs = self.block_size
        window = self.config.sliding_window
        for seq in sched_out.scheduled:
            start, num_new = seq.num_computed_tokens, seq.num_new_tokens
            context_len = start + num_new
            query_start = len(input_ids)
            rows = rows_for(seq, query_start) if self.computes_prompt_logprobs else None
            if rows is not None:
                prompt_rows.append(rows)
            # Speculative proposals follow the request's known tokens (they are not part of it yet).
            num_known = context_len - len(seq.spec_token_ids)
            input_ids.extend(seq.request.token_ids_slice(start, num_known))
            input_ids.extend(seq.spec_token_ids)
            blocks = seq.block_ids
            for pos in range(start, context_len):
                positions.append(pos)
                slots.append(blocks[pos // bs] * bs + pos % bs)
            num_blocks = -(-context_len // bs)
            if num_new == 1 and seq.needs_sample:
                decode_tables.append(blocks[:num_blocks])
                decode_lens.append(context_len)
            else:
                prefill_tables.append(blocks[:num_blocks])
                prefills.append(
                    PrefillChunk(
                        query_start=query_start,
                        num_query_tokens=num_new,
                        context_len=context_len,
                        block_ids=self._to_device(blocks[:num_blocks]),
                        mask=build_prefill_mask(start, num_new, context_len, window, self.device),
                    )
                )
            if seq.needs_sample and seq.spec_token_ids:
                num_rows = len(seq.spec_token_ids) + 1  # the last known token and each proposal
                spec_rows.append((seq.request.request_id, len(input_ids) - num_rows, num_rows))
            elif seq.needs_sample:
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(seq.request)

        decode_mask = None
        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        if decode_tables and not self.cpu_kernel:
            decode_mask = build_decode_mask(decode_lens, max_blocks * bs, window, self.device)
        scratch = None
        if decode_tables and self.device.type == "cpu" and not self.cpu_kernel:
            shape = (len(padded) * max_blocks, *self.kv_caches[0][0].shape[1:])
            dtype = self.config.torch_dtype
            scratch = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            num_decode_seqs=len(decode_tables),
            decode_block_tables=self._to_device([b for row in padded for b in row]).view(len(padded), max_blocks),
            decode_mask=decode_mask,
            decode_kv_scratch=scratch,
            prefills=prefills,
        )
        if self.device.type == "cuda" or self.cpu_kernel:
            attach_kernel_views(
                meta,
                decode_tables + prefill_tables,
                decode_lens + [c.context_len for c in prefills],
                [1] * len(decode_tables) + [c.num_query_tokens for c in prefills],
                window,
            )
        hidden = self.model(self._to_device(input_ids), self._to_device(positions), self.kv_caches, meta)
        out = ModelRunnerOutput()
        if prompt_rows:
            out.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, prompt_rows)
        if spec_rows:
            rows = torch.cat([torch.arange(first, first + n, device=self.device) for _, first, n in spec_rows])
            spec_logits = self.model.compute_logits(hidden[rows])
            offset = 0
            for request_id, _, n in spec_rows:
                out.spec_logits[request_id] = spec_logits[offset : offset + n]
                offset += n
        if not sample_rows:
            return out
        logits = self.model.compute_logits(hidden[self._to_device(sample_rows)])
        tokens, logprobs = self.sampler.sample(logits, sample_requests)
        out.sampled_token_ids = {r.request_id: t for r, t in zip(sample_requests, tokens, strict=True)}
        out.logprobs = logprobs
        return out

    def warm_up(self, what: str) -> None:
        """One prefill and one decode step of a throwaway greedy request, before the engine says it is ready.

        The first step of each kind is the slow one: compiled CPU ops are built (or loaded from the
        machine's cache) on first use, a few seconds each on a small machine, and Triton compiles its
        kernels on first launch. That belongs to startup, not to the first user's request (a new pod
        would pass its readiness probe and then stall its first requests). Uses the KV cache's first
        block(s), which the KV manager never hears of (they stay free and outside the prefix map), and
        zeroes them again after (tensor/pipeline-parallel workers' shards keep finite values there, which
        no request reads before it writes them). Greedy: no generator is touched. `what` names the model
        in the log line (the target, or a speculative draft, whose runner is warmed up the same way).
        """
        started = time.monotonic()
        num_prompt = 2
        request = Request("warm-up", [0] * num_prompt, SamplingParams(temperature=0.0, max_tokens=2))
        blocks = list(range(-(-(num_prompt + 1) // self.block_size)))
        for start, num_new in ((0, num_prompt), (num_prompt, 1)):
            out = self.execute(SchedulerOutput([ScheduledSeq(request, start, num_new, blocks, needs_sample=True)]))
            request.output_token_ids.extend(out.new_token_ids(request.request_id))
        for k_cache, v_cache in self.kv_caches:
            k_cache[blocks] = 0
            v_cache[blocks] = 0
        logger.info("warm-up (%s): one prefill and one decode step in %.1f s", what, time.monotonic() - started)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits for every position of one prompt, through the same paged path (tests and scoring).

        Uses scratch KV tensors of its own, so the shared cache (and its prefix map) is untouched.
        """
        num_tokens = len(token_ids)
        num_blocks = -(-num_tokens // self.block_size)
        shape = (num_blocks, *self.kv_caches[0][0].shape[1:])
        dtype = self.config.torch_dtype
        scratch = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in self.kv_caches
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            num_decode_seqs=0,
            decode_block_tables=torch.zeros(0, 0, dtype=torch.long, device=self.device),
            decode_mask=None,
            prefills=[
                PrefillChunk(
                    0,
                    num_tokens,
                    num_tokens,
                    torch.arange(num_blocks, device=self.device),
                    build_prefill_mask(0, num_tokens, num_tokens, self.config.sliding_window, self.device),
                )
            ],
        )
        if self.device.type == "cuda" or self.cpu_kernel:
            attach_kernel_views(meta, [list(range(num_blocks))], [num_tokens], [num_tokens], self.config.sliding_window)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), scratch, meta)
        return self.model.compute_logits(hidden)

    # ---- host to device, CUDA graphs --------------------------------------------------------------
    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 tensor on the device; on CUDA through pinned memory with a non-blocking copy (no sync)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.long, device=self.device)
        return torch.tensor(values, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    def _graph_batch(self, sched_out: SchedulerOutput) -> tuple[DecodeBatch, list[Request]] | None:
        """The step as a `DecodeBatch` when it is decode-only (one new token, sampled, no proposals) and fits."""
        scheduled = sched_out.scheduled
        if self.graphs is None or self.graphs.bucket_for(len(scheduled)) is None:
            return None
        bs = self.block_size
        batch = DecodeBatch([], [], [], [], [])
        for seq in scheduled:
            if seq.num_new_tokens != 1 or not seq.needs_sample or seq.spec_token_ids:
                return None
            pos = seq.num_computed_tokens
            blocks = seq.block_ids
            batch.input_ids.append(seq.request.token_ids_slice(pos, pos + 1)[0])
            batch.positions.append(pos)
            batch.slots.append(blocks[pos // bs] * bs + pos % bs)
            batch.seq_lens.append(pos + 1)
            batch.block_tables.append(blocks[: -(-(pos + 1) // bs)])
        return batch, [seq.request for seq in scheduled]

    def _execute_graph(self, batch: DecodeBatch, requests: list[Request]) -> ModelRunnerOutput:
        logits = self.graphs.run(batch)
        tokens, logprobs = self.sampler.sample(logits, requests)
        out = ModelRunnerOutput()
        out.sampled_token_ids = {r.request_id: t for r, t in zip(requests, tokens, strict=True)}
        out.logprobs = logprobs
        return out

    def _graph_forward(self, inputs: GraphInputs) -> torch.Tensor:
        """The captured decode forward: reads only the arena views in `inputs`; returns logits [bucket, vocab]."""
        window = self.config.sliding_window
        slots, tables, mask = inputs.slot_mapping, inputs.block_tables, None
        if self.device.type == "cpu":  # the torch attention path (fake-capture tests) indexes with int64
            slots, tables = slots.long(), tables.long()
            keys = torch.arange(tables.shape[1] * self.block_size).unsqueeze(0)
            lens = inputs.seq_lens.long().unsqueeze(1)
            mask = keys < lens
            if window is not None:
                mask &= keys > lens - 1 - window
            mask = mask[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_seqs=inputs.num_seqs,
            decode_block_tables=tables,
            decode_mask=mask,
            block_tables=inputs.block_tables,
            seq_lens=inputs.seq_lens,
            cu_seqlens_q=inputs.cu_seqlens_q,
            sliding_window=window,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)


def _graphs_wanted(model: object, device: torch.device) -> bool:
    """CUDA graphs by default on CUDA for an in-process model; TIDEPOOL_CUDA_GRAPHS=0 turns them off."""
    raw = os.environ.get(CUDA_GRAPHS_ENV, "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{CUDA_GRAPHS_ENV}={raw!r}: expected 1/0 (on/off)")
    if raw in ("0", "false", "off"):
        logger.info("CUDA graphs off (%s=%s): every step runs eagerly", CUDA_GRAPHS_ENV, raw)
        return False
    return device.type == "cuda" and isinstance(model, torch.nn.Module)
