"""The model runner: the only place a `SchedulerOutput` becomes tensors.

A step runs in four stages, each with plain typed inputs and outputs:
1. prepare inputs (`runner_inputs.prepare_inputs`): the scheduled sequences as host lists
   (`StepInputs`: ids, positions, KV slots, block tables, the rows to read back);
2. attention metadata (`RunnerBackend.metadata`): those lists as device tensors and the
   `AttentionMetadata` every layer shares;
3. run (`_run`): the model's forward over the paged KV cache, hidden states out (with each token's
   LoRA slot when the step has adapter tokens: runner_inputs.py);
4. sample (`_sample`): logits only for the rows read back (sampling sequences, speculative
   proposals' rows, prompt logprobs: prompt_logprobs.py), the sampler on the sampling rows.
The attention backend (CPU torch / CPU compiled op / CUDA, runner_backend.py) is chosen once at
construction. A decode-only step that fits a captured CUDA graph (`cuda_graphs`; off with
TIDEPOOL_CUDA_GRAPHS=0) replays it instead of stages 2 and 3. The graphs need one extra KV block,
`num_blocks`, that the KV cache manager never hands out: padding rows write their keys there.

The runner owns the KV cache tensors (per layer, K and V, [num_blocks, block_size, num_kv_heads,
head_dim], zero-initialised so padded decode reads are finite). On the CPU the backend first lays
the model's weights out, once (`RunnerBackend.prepare_model`), and the weights and the KV cache live
in memory advised for transparent huge pages.
"""

from __future__ import annotations

import logging
import time

import torch

from .config import ModelConfig
from .cuda_graphs import CudaGraphBackend, DecodeGraphs, GraphBackend, GraphInputs, capture_sizes, graphs_wanted
from .layers.attention_metadata import AttentionMetadata
from .models.llama import LlamaForCausalLM
from .prompt_logprobs import compute as compute_prompt_logprobs
from .request import Request
from .runner_backend import RunnerBackend, choose_backend
from .runner_inputs import SpecRows, StepInputs, decode_batch, prepare_inputs, whole_prompt_inputs
from .sampler import Sampler
from .sampling_params import SamplingParams
from .sched_output import ModelRunnerOutput, ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)


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
        self.serves_lora = False  # True once the engine attached LoRA slots to the model (engine/lora)
        self.backend: RunnerBackend = choose_backend(device, config, block_size)
        if isinstance(model, torch.nn.Module):
            self.backend.prepare_model(model)
        if graph_backend is None and graphs_wanted(model, device):
            graph_backend = CudaGraphBackend(device)
        self.graphs: DecodeGraphs | None = None
        if graph_backend is not None:
            max_blocks = -(-(max_model_len or model.rotary.cos_cached.shape[0]) // block_size)
            self.graphs = DecodeGraphs(self._graph_forward, capture_sizes(256), max_blocks, num_blocks, block_size,
                                       device, graph_backend)  # fmt: skip
            num_blocks += 1  # the padding rows' sink block
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        started = time.perf_counter()
        self.kv_caches = [
            (self.backend.zeros(shape), self.backend.zeros(shape)) for _ in range(config.num_hidden_layers)
        ]
        self.kv_alloc_seconds = time.perf_counter() - started  # start-up phase "kv_cache" (engine_builder)

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """One step: prepare inputs -> attention metadata -> run -> sample (or a captured graph's replay)."""
        replayed = self._replay(sched_out)
        if replayed is not None:
            return replayed
        inputs = prepare_inputs(sched_out, self.block_size, self.computes_prompt_logprobs, self.serves_lora)
        meta = self.backend.metadata(inputs)
        hidden = self._run(inputs, meta, self.kv_caches)
        return self._sample(hidden, inputs)

    def _run(
        self, inputs: StepInputs, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Stage 3: the forward; hidden states [num_tokens, hidden]."""
        to_device = self.backend.to_device
        ids, positions = to_device(inputs.input_ids), to_device(inputs.positions)
        if not inputs.lora_slots:
            return self.model(ids, positions, kv_caches, meta)
        lora_slots = to_device(inputs.lora_slots).to(torch.int32)
        return self.model(ids, positions, kv_caches, meta, lora_slots=lora_slots)

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> ModelRunnerOutput:
        """Stage 4: logits for the rows read back; sampled tokens for the sampling rows."""
        out = ModelRunnerOutput()
        if inputs.prompt_rows:
            out.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, inputs.prompt_rows)
        if inputs.spec_rows:
            out.spec_logits = self._spec_logits(hidden, inputs.spec_rows)
        if inputs.sample_rows:
            logits = self.model.compute_logits(hidden[self.backend.to_device(inputs.sample_rows)])
            self._sample_tokens(logits, inputs.sample_requests, out)
        return out

    def _spec_logits(self, hidden: torch.Tensor, spec_rows: list[SpecRows]) -> dict[str, torch.Tensor]:
        """Each proposing request's logits rows (its last known token, then each proposal), one matmul for all."""
        rows = torch.cat([torch.arange(s.first, s.first + s.num, device=self.device) for s in spec_rows])
        logits = self.model.compute_logits(hidden[rows])
        by_request, offset = {}, 0
        for s in spec_rows:
            by_request[s.request_id] = logits[offset : offset + s.num]
            offset += s.num
        return by_request

    def _sample_tokens(self, logits: torch.Tensor, requests: list[Request], out: ModelRunnerOutput) -> None:
        tokens, logprobs = self.sampler.sample(logits, requests)
        out.sampled_token_ids = {r.request_id: t for r, t in zip(requests, tokens, strict=True)}
        out.logprobs = logprobs

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
        inputs = whole_prompt_inputs(token_ids, self.block_size)
        shape = (len(inputs.prefills[0].block_table), *self.kv_caches[0][0].shape[1:])
        dtype = self.config.torch_dtype
        scratch = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in self.kv_caches
        ]
        hidden = self._run(inputs, self.backend.metadata(inputs), scratch)
        return self.model.compute_logits(hidden)

    # ---- CUDA graphs ------------------------------------------------------------------------------
    def _replay(self, sched_out: SchedulerOutput) -> ModelRunnerOutput | None:
        """A decode-only step that fits a captured size, replayed and sampled; None when it runs eagerly."""
        if self.graphs is None or self.graphs.bucket_for(len(sched_out.scheduled)) is None:
            return None
        decode = decode_batch(sched_out, self.block_size, self.serves_lora)
        if decode is None:
            return None
        batch, requests = decode
        out = ModelRunnerOutput()
        self._sample_tokens(self.graphs.run(batch), requests, out)
        return out

    def _graph_forward(self, inputs: GraphInputs) -> torch.Tensor:
        """The captured decode forward: reads only the arena views in `inputs`; returns logits [bucket, vocab]."""
        meta = self.backend.graph_metadata(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)
