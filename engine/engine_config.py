"""Engine configuration: the keyword arguments of `LLM(...)` (and later `tidepool serve` flags).

Pydantic at the edge: unknown or out-of-range values raise `ValueError` (pydantic's
`ValidationError` is one) naming the field. Cross-field checks that need the model's config
(max_model_len vs positions, KV capacity vs max_model_len) happen in `resolve`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from .config import DTYPES, ModelConfig
from .spec_decode.config import SpeculativeConfig

CPU_KV_CACHE_BYTES = 2 << 30  # default KV budget on CPU (vLLM's CPU backend defaults to 4 GiB)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Local Hugging Face model folder")
    tokenizer: str | None = Field(None, description="Tokenizer folder; defaults to the model folder")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="'auto' (CUDA when available), 'cpu', 'cuda', 'cuda:N'")
    block_size: int = Field(16, ge=1, le=1024)
    max_model_len: int | None = Field(None, ge=2, description="Prompt + output tokens; default: the model's positions")
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Token budget per step; default 2048")
    num_kv_blocks: int | None = Field(None, ge=1, description="Fix the KV cache size; default: from a memory budget")
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="KV budget on CPU; default 2 GiB")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    show_progress: bool = True
    num_threads: int | None = Field(
        None, ge=1, description="CPU threads for torch ops; default: TIDEPOOL_NUM_THREADS, else from the cgroup quota"
    )
    quantization: Literal["int8", "int4", "gptq", "awq"] | None = Field(
        None, description="Check (gptq/awq/int8/int4 checkpoints) or apply at load (int8/int4 on a dense folder)"
    )
    speculative: SpeculativeConfig | None = Field(
        None, description="Speculative decoding: {'method': 'ngram'|'draft', 'draft_model': PATH, ...}"
    )
    kv_role: Literal["unified", "prefill", "decode"] = Field(
        "unified", description="P/D disaggregation role: 'prefill' sends prompt KV, 'decode' receives it"
    )
    kv_port: int = Field(14579, ge=0, le=65535, description="TCP port of a decode engine's KV receiver (0: any free)")
    kv_transfer_timeout_s: float = Field(30.0, gt=0, description="How long a KV transfer may take end to end")
    # Parallelism (engine/distributed): tp x pp ranks, rank 0 in this process, the rest worker processes.
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks each layer is split over (heads, MLP, vocab)")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages the decoder layers are split into")
    nnodes: int = Field(1, ge=1, description="Machines the tp x pp ranks span; this process is node 0's driver")
    master_addr: str = Field("127.0.0.1", description="Address other nodes reach this node's rendezvous at")
    master_port: int | None = Field(None, ge=1, le=65535, description="Rendezvous port; default: a free port")


@dataclass(slots=True, frozen=True)
class ResolvedConfig:
    """Everything sized: what the engine actually runs with."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_blocks: int | None  # None until sized from memory after the model is loaded


def resolve(config: EngineConfig, model: ModelConfig) -> ResolvedConfig:
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(config.device)
        except RuntimeError as err:
            raise ValueError(
                f"device {config.device!r} is not a torch device; use 'auto', 'cpu' or 'cuda[:N]'"
            ) from err
    dtype = model.torch_dtype if config.dtype == "auto" else DTYPES[config.dtype]
    max_model_len = config.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{model.max_position_embeddings}; lower max_model_len"
        )
    batched = config.max_num_batched_tokens or 2048
    if not config.enable_chunked_prefill and batched < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={batched} is smaller than max_model_len={max_model_len} with chunked prefill "
            "off, so long prompts could never be scheduled; enable chunked prefill or raise max_num_batched_tokens"
        )
    if config.num_kv_blocks is not None:
        check_kv_capacity(config.num_kv_blocks, config.block_size, max_model_len)
    return ResolvedConfig(device, dtype, max_model_len, batched, config.num_kv_blocks)


def check_kv_capacity(num_blocks: int, block_size: int, max_model_len: int) -> None:
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens, "
            f"fewer than max_model_len={max_model_len}; "
            "raise num_kv_blocks (or the memory budget) or lower max_model_len"
        )
