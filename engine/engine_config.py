"""Engine configuration: the keyword arguments of `LLM(...)` (and later `tidepool serve` flags).

Pydantic at the edge: unknown or out-of-range values raise `ValueError` (pydantic's
`ValidationError` is one) naming the field. Cross-field checks that need the model's config
(max_model_len vs positions, KV capacity vs max_model_len) happen in `resolve`.

Model resolution happens here, once, for every entry point (`LLM`, `tidepool serve`, `generate`,
worker nodes): `resolve_model_path` turns what the user wrote into the path the loaders read:
a Hugging Face folder as is; a `.gguf` file as is; a folder holding exactly one `.gguf` (and no
safetensors) -> that file; a catalogue name (`contract/catalogue.py`) -> its cached file,
pulled first if needed. The loaders downstream only ever see folders and files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tidepool.contract.quantization import QUANTIZATION_METHODS

from .config import DTYPES, ModelConfig
from .spec_decode.config import SpeculativeConfig

CPU_KV_CACHE_BYTES = 2 << 30  # default KV budget on CPU (vLLM's CPU backend defaults to 4 GiB)
# `quantization=` values (contract/quantization.py, torch-free, shared with the CLI flags).
Quantization = Literal[QUANTIZATION_METHODS]  # type: ignore[valid-type]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face model folder, .gguf file (or a folder with one) or catalogue name")
    tokenizer: str | None = Field(None, description="Tokenizer folder or .gguf file; defaults to the model")
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
    quantization: Quantization | None = Field(
        None,
        description="Check (gptq/awq/int8/int4 checkpoints) or apply at load (int8/int4 on a dense model); "
        "gguf: keep a GGUF file's Q8_0/Q4_0/Q4_1 weights quantized (default for GGUF: dequantize to dtype)",
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


def resolve_model_path(model: str, pull: bool = True) -> str:
    """The folder or file to load for `model` (see the module docstring); pulls catalogue models.

    Raises FileNotFoundError for a name that is nothing of the above, ValueError for a folder with
    several `.gguf` files or a file that is not GGUF, and `PullError` when a pull fails. With
    `pull=False` a catalogue name comes back as it is (a check before a process that pulls later).
    """
    from tidepool.contract import catalogue

    from .gguf.detect import is_gguf_file

    path = Path(model).expanduser()
    if path.is_file():
        if not is_gguf_file(path):
            raise ValueError(f"{model} is a file but not a GGUF file; give a Hugging Face model folder or a .gguf file")
        return str(path)
    if path.is_dir():
        has_safetensors = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if has_safetensors or not ggufs:
            return str(path)  # a Hugging Face folder; the loader names anything missing
        if len(ggufs) > 1:
            listed = ", ".join(p.name for p in ggufs[:6]) + (", ..." if len(ggufs) > 6 else "")
            raise ValueError(
                f"model folder {model} holds {len(ggufs)} .gguf files ({listed}); give the file to load, "
                f"e.g. {path / ggufs[0].name}"
            )
        return str(ggufs[0])
    entry = catalogue.lookup(model)
    if entry is not None:
        if not pull:
            return model
        from .gguf.pull import pull as pull_model

        return str(pull_model(entry.name))
    raise FileNotFoundError(
        f"model {model} does not exist: it is not a folder, a .gguf file or a catalogue name "
        f"({', '.join(catalogue.names())}; see `tidepool pull`)"
    )


def check_model(path: str) -> None:
    """The checks a loader makes first, without loading weights: for a GGUF file its header, architecture,
    tensor types and tokenizer metadata (`GGUFError` naming the problem). The parse is cached per process,
    so an engine built afterwards in the same process does not parse the file again. Folders are checked
    by their loaders."""
    from .gguf.detect import is_gguf_file

    if not is_gguf_file(path):
        return
    from .gguf.config import model_config_from_gguf
    from .gguf.reader import open_gguf
    from .gguf.tokenizer import GGUFTokenizerSpec

    gguf = open_gguf(path)
    model_config_from_gguf(gguf)
    GGUFTokenizerSpec(gguf)


def resolve_model(config: EngineConfig) -> EngineConfig:
    """`config` with `model` (and `tokenizer`) resolved to what the loaders read; idempotent."""
    model = resolve_model_path(config.model)
    tokenizer = None if config.tokenizer is None else resolve_model_path(config.tokenizer)
    if model == config.model and tokenizer == config.tokenizer:
        return config
    return config.model_copy(update={"model": model, "tokenizer": tokenizer})
