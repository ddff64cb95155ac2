"""Construction of an engine's parts from its config: model, KV cache, scheduler, runner, step hooks.

Role: `build_engine(config)` does everything `LLMEngine` needs done once — resolve the model
(catalogue names, GGUF, quantization), load it (or start the tensor/pipeline-parallel workers),
size the KV cache from memory, build the scheduler, sampler and model runner, run the runner's
warm-up step (first-use builds and compiles happen here, not in a request), and build the optional
features' step hooks from one `HookContext` — and returns it all as `EngineParts`. `LLMEngine`
then only runs the loop. It times each start phase (`startup_phases.PHASES`) into
`EngineParts.startup_phases` and logs them in one INFO line.

Invariants: the hooks are registered in the order their lifecycle points must run: the KV
hand-off first (requests it admits are running when the speculator proposes), then the
speculator. A config the parts cannot honour raises `ValueError` naming what to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .distributed.executor import MultiprocExecutor
from .engine_config import CPU_KV_CACHE_BYTES, EngineConfig, ResolvedConfig, check_kv_capacity, resolve, resolve_model
from .kv_cache import KVCacheManager
from .kv_transfer import KVConnector, check_handoff_config
from .kv_transfer.handoff import KVHandoff
from .layers.linear import uses_compiled_gemv
from .loading.formats import detect_format, read_model_config
from .loading.loader import load_model
from .loading.prepare import prepare_quantized
from .lora.build import build_lora
from .lora.registry import LoRARegistry
from .model_runner import ModelRunner, kv_bytes_per_block
from .sampler import Sampler
from .scheduler import Scheduler
from .sparsity.load import check_sparsity_request
from .spec_decode.speculator import Speculator
from .startup_phases import StartupClock, process_age_s
from .step_hooks import HookContext, StepHook
from .threads import ThreadDecision, configure_threads
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)
IMPORT_S = process_age_s()  # process start -> the engine's modules imported (this one imports after them)


@dataclass(slots=True)
class EngineParts:
    config: EngineConfig  # as loaded: the model field names the folder or file actually read
    resolved: ResolvedConfig
    tokenizer: Tokenizer
    model: torch.nn.Module
    model_config: ModelConfig  # the whole model's
    threads: ThreadDecision
    executor: MultiprocExecutor | None  # tensor/pipeline-parallel workers, when more than one rank
    num_kv_blocks: int
    kv_cache: KVCacheManager
    scheduler: Scheduler
    sampler: Sampler
    runner: ModelRunner
    speculator: Speculator | None
    kv_connector: KVConnector | None  # the P/D hand-off's transport (prefill/decode roles), for the server
    hooks: list[StepHook]  # in registration order
    lora: LoRARegistry | None  # adapters (engine/lora), with enable_lora
    startup_phases: dict[str, float]  # seconds per start phase (startup_phases.PHASES order), for logs and metrics


def build_engine(config: EngineConfig) -> EngineParts:
    clock = StartupClock(IMPORT_S)
    config = resolve_model(config)  # catalogue names, GGUF folders -> the folder or file to load
    check_handoff_config(config.role, config.kv_port, config.tensor_parallel_size * config.pipeline_parallel_size)
    check_sparsity_request(config.model, config.sparsity, config.quantization)  # --sparsity 2:4 of a dense model
    if config.quantization is not None:
        quantized = prepare_quantized(config.model, config.quantization)
        config = config.model_copy(update={"model": quantized, "tokenizer": config.tokenizer or config.model})
    clock.mark("resolve")
    tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
    clock.mark("tokenizer")
    rc = resolve(config, read_model_config(config.model))
    threads = configure_threads(config.num_threads, is_cpu=rc.device.type == "cpu")
    clock.mark("resolve")
    model, model_config, runner_config, sizing_config, executor = _load(config, rc)
    clock.mark("weights")
    num_blocks = rc.num_kv_blocks or size_kv_cache(config, rc, model_config, sizing_config)
    if executor is not None:
        executor.init_kv_cache(num_blocks)
    kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    lora = build_lora(config, model, model_config, rc.dtype, rc.device, executor.lora_slots if executor else None)
    scheduler = Scheduler(
        kv_cache,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=rc.max_num_batched_tokens,
        max_model_len=rc.max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        lora_gate=lora,
    )
    sampler = Sampler(config.seed, rc.device)
    clock.mark("kv_cache")  # sized, and the block pool built (the scheduler and sampler: microseconds)
    runner = ModelRunner(model, runner_config, config.block_size, num_blocks, sampler, rc.device)
    runner.serves_lora = lora is not None  # each step passes its adapter tokens' slots to the model
    if executor is not None:
        executor.model.bind_kv_caches(runner.kv_caches)
    runner_s = clock.lap()  # the runner lays out the weights, then reserves the KV cache
    clock.add("kv_cache", runner.kv_alloc_seconds)
    clock.add("weight_layout", runner_s - runner.kv_alloc_seconds)
    runner.warm_up("target model")  # compiled ops and kernels built now, not on the first request
    clock.mark("warmup")
    ctx = HookContext(
        tokenizer=tokenizer,
        model_config=model_config,
        sampler=sampler,
        scheduler=scheduler,
        kv_caches=runner.kv_caches,
        dtype=rc.dtype,
        device=rc.device,
        max_model_len=rc.max_model_len,
        max_num_batched_tokens=rc.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
        num_kv_blocks=num_blocks,
        show_progress=config.show_progress,
    )
    speculator = Speculator.build(config.speculative_config, ctx) if config.speculative_config is not None else None
    handoff = None
    if config.role != "unified":  # with TP/PP every rank ships its own KV slab (kv_transfer/ranks.py)
        handoff = KVHandoff.build(config.role, config.kv_port, config.kv_transfer_timeout, ctx, executor)
    hooks: list[StepHook] = [hook for hook in (handoff, speculator) if hook is not None]
    clock.mark("features")
    logger.info("start-up phases (s): %s", clock.summary(), extra={"startup_phases": clock.phases})
    return EngineParts(
        config, rc, tokenizer, model, model_config, threads, executor, num_blocks, kv_cache, scheduler, sampler,
        runner, speculator, handoff.connector if handoff is not None else None, hooks, lora, clock.phases,
    )  # fmt: skip


def _load(
    config: EngineConfig, rc: ResolvedConfig
) -> tuple[torch.nn.Module, ModelConfig, ModelConfig, ModelConfig, MultiprocExecutor | None]:
    """`(model, model_config, runner_config, sizing_config, executor)`: the model (rank 0's stage when there are
    several ranks: the executor starts the others' worker processes), the whole model's config, the one rank
    0's runner caches for, and the one the KV cache is sized for (the largest stage)."""
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        executor = MultiprocExecutor(config, rc)
        return executor.model, executor.model_config, executor.runner_config, executor.sizing_config, executor
    model, model_config = load_model(
        config.model,
        dtype=rc.dtype,
        device=rc.device,
        max_positions=rc.max_model_len,
        show_progress=config.show_progress,
        quantization=config.quantization,
        pack_weights=_loads_in_place(config, rc),
    )
    return model, model_config, model_config, model_config, None


def _loads_in_place(config: EngineConfig, rc: ResolvedConfig) -> bool:
    """A dense model (GGUF file or Hugging Face folder) for this process's CPU runner, which will not re-lay its
    weights out (the compiled GEMV reads them as loaded): load it straight into the runner's huge-page arena
    (`loading.loader`), one write per weight instead of a load and a copy."""
    dense = config.quantization is None and detect_format(config.model).name in ("gguf", "hf")
    return rc.device.type == "cpu" and dense and uses_compiled_gemv()


def size_kv_cache(config: EngineConfig, rc: ResolvedConfig, model_config: ModelConfig, kv_config: ModelConfig) -> int:
    """Blocks that fit the budget; `kv_config` describes one rank's cache (its layers, its kv heads)."""
    per_block = kv_bytes_per_block(kv_config, config.block_size, rc.dtype)
    if rc.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(rc.device)
        # Keep headroom for activations: one full step's logits and hidden states, doubled.
        activations = 2 * rc.max_num_batched_tokens * (model_config.vocab_size + 8 * model_config.hidden_size) * 4
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activations
    else:
        budget = config.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
    useful = -(-config.max_num_seqs * rc.max_model_len // config.block_size)
    num_blocks = min(budget // per_block, useful)
    check_kv_capacity(num_blocks, config.block_size, rc.max_model_len)
    return num_blocks
