"""Engine configuration: the keyword arguments of `LLM(...)`, fed as well by `tidepool serve` and
`tidepool generate` flags.

One source: every field that a `tidepool serve` flag sets is built by `flag_field` from that flag
(tidepool.contract.serve_flags, whose `engine_field` names the field): its default, numeric bounds,
choices and description live in the table, never here. Only what no flag sets (`show_progress`)
and the Python types of the fields are written here.

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
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tidepool.contract.serve_flags import FLAGS

from .config import DTYPES, ModelConfig
from .spec_decode.config import SpeculativeConfig

# Defaults the engine picks when the flag is unset (their flags' help names them; a test keeps the two in step).
CPU_KV_CACHE_BYTES = 2 << 30  # default KV budget on CPU (vLLM's CPU backend defaults to 4 GiB)
MAX_NUM_BATCHED_TOKENS = 2048
# Choices are the flag table's (quantization's are contract/quantization.py's, shared with the CRD).
Dtype = Literal[FLAGS["dtype"].choices]  # type: ignore[valid-type]
Quantization = Literal[FLAGS["quantization"].choices]  # type: ignore[valid-type]
Sparsity = Literal[FLAGS["sparsity"].choices]  # type: ignore[valid-type]
KvRole = Literal[FLAGS["role"].choices]  # type: ignore[valid-type]
SERVE_FLAG_KEY = "serve_flag"  # json_schema_extra key naming the flag a field is built from


def flag_field(name: str, **override: Any) -> Any:
    """A pydantic Field built from serve flag `name`: its default (required when the flag is), bounds and help."""
    flag = FLAGS[name]
    kwargs: dict[str, Any] = {"default": ... if flag.required else flag.default, **flag.bounds, **override}
    return Field(description=flag.help, json_schema_extra={SERVE_FLAG_KEY: name}, **kwargs)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = flag_field("model")
    tokenizer: str | None = flag_field("tokenizer")
    dtype: Dtype = flag_field("dtype")
    device: str = flag_field("device")
    block_size: int = flag_field("block-size")
    max_model_len: int | None = flag_field("max-model-len")
    max_num_seqs: int = flag_field("max-num-seqs")
    max_num_batched_tokens: int | None = flag_field("max-num-batched-tokens")
    num_kv_blocks: int | None = flag_field("num-kv-blocks")
    kv_cache_memory_bytes: int | None = flag_field("kv-cache-memory-bytes")
    gpu_memory_utilization: float = flag_field("gpu-memory-utilization")
    enable_prefix_caching: bool = flag_field("enable-prefix-caching")
    enable_chunked_prefill: bool = flag_field("enable-chunked-prefill")
    seed: int = flag_field("seed")
    show_progress: bool = Field(True, description="Show progress bars while the engine loads")
    num_threads: int | None = flag_field("num-threads")
    quantization: Quantization | None = flag_field("quantization")
    sparsity: Sparsity | None = flag_field("sparsity")
    speculative_config: SpeculativeConfig | None = flag_field("speculative-config")
    enable_lora: bool = flag_field("enable-lora")
    max_loras: int = flag_field("max-loras")
    max_lora_rank: int = flag_field("max-lora-rank")
    max_cpu_loras: int | None = flag_field("max-cpu-loras")
    role: KvRole = flag_field("role")
    kv_port: int = flag_field("kv-port")
    kv_transfer_timeout: float = flag_field("kv-transfer-timeout")
    # Parallelism (engine/distributed): tp x pp ranks, rank 0 in this process, the rest worker processes.
    tensor_parallel_size: int = flag_field("tensor-parallel-size")
    pipeline_parallel_size: int = flag_field("pipeline-parallel-size")
    nnodes: int = flag_field("nnodes")
    # The flag defaults to None so that `tidepool serve` can fall back to $MASTER_ADDR; LLM(...) reads no environment.
    master_addr: str = flag_field("master-addr", default="127.0.0.1")
    master_port: int | None = flag_field("master-port")


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
    batched = config.max_num_batched_tokens or MAX_NUM_BATCHED_TOKENS
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


def resolve_model(config: EngineConfig) -> EngineConfig:
    """`config` with `model` (and `tokenizer`) resolved to what the loaders read; idempotent."""
    model = resolve_model_path(config.model)
    tokenizer = None if config.tokenizer is None else resolve_model_path(config.tokenizer)
    if model == config.model and tokenizer == config.tokenizer:
        return config
    return config.model_copy(update={"model": model, "tokenizer": tokenizer})
