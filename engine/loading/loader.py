"""`load_model`: a model path to a loaded model, in stages, whatever the format.

Stages (each a line of `load_model`):
1. format: `formats.open_checkpoint` detects what the path is and picks its reader.
2. config: the reader's `read_config` (config.json, or a GGUF file's metadata), `dtype` applied.
3. build: `build_model` allocates the architecture's model (`MODEL_CLASSES`), parameters unset.
4. quantize: the one transform — the reader's quantized weights (a quantized folder's projections, or a
   GGUF file's kept/quantized ones) swapped in for the dense parameters (`quant.load.apply_quantized`);
   the model code never changes.
5. weights: every remaining tensor copied in through the model's `load_weights`, which names any tensor
   that is missing, unexpected or of the wrong shape.
Sharding (TP/PP) is not a loading stage here: `engine/distributed/worker.py` shards the loaded model last.

`pack_weights=True` (the single-process CPU engine, when nothing re-lays the weights out after
loading) moves the parameters into one huge-page-advised arena (`hugepages.pack_weights`) between
stages 4 and 5, so each weight is written once, into its final place, instead of loaded and then
copied into the arena by the model runner. Not for a model that is sharded after loading: a kept
shard would hold the whole arena.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .. import hugepages
from ..config import ModelConfig
from ..models.llama import LlamaForCausalLM
from ..quant.load import apply_quantized
from ..quant.runtime import weight_bytes
from .formats import open_checkpoint

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", max_positions: int | None = None
) -> LlamaForCausalLM:
    """The architecture's model for `config`, its parameters allocated and unset."""
    return MODEL_CLASSES[config.architecture](config, device=device, max_positions=max_positions)


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    show_progress: bool = True,
    quantization: str | None = None,
    *,
    pack_weights: bool = False,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`(model, config)` for the model at `path` (see the module docstring for the stages). `quantization`
    applies to GGUF files (None: dequantize; "gguf": keep Q8_0/Q4_0/Q4_1; "int8"/"int4": quantize at
    load); a folder's own `quantization_config` decides for a folder."""
    checkpoint = open_checkpoint(path, quantization)
    try:
        config = checkpoint.read_config()
        if dtype is not None:
            config.torch_dtype = dtype
        model = build_model(config, device, max_positions)
        quantized = checkpoint.quantized_weights(model, config.torch_dtype, show_progress)
        apply_quantized(model, quantized)
        packed = hugepages.pack_weights(model, unwritten=_loaded_whole(model)) if pack_weights else None
        checkpoint.load_dense(model, config.torch_dtype, show_progress)
    finally:
        checkpoint.close()
    if packed is not None and packed.reason is None:
        logger.info("huge pages: %s (loaded in place)", packed.summary())
    model.eval()
    logger.info(
        "loaded %s from %s: %.1fM dense parameters, %s, %d projections quantized, %.1f MiB of weights",
        config.architecture,
        checkpoint.path,
        sum(p.numel() for p in model.parameters()) / 1e6,
        config.torch_dtype,
        len(quantized),
        weight_bytes(model) / 2**20,
    )
    return model, config


def _loaded_whole(model: LlamaForCausalLM) -> list[torch.nn.Parameter]:
    """Parameters whose every row `load_weights` writes (it raises unless the checkpoint has them all)."""
    params = dict(model.named_parameters())
    rows: dict[str, int] = {}
    for name, _, num_rows in model.checkpoint_layout().values():
        rows[name] = rows.get(name, 0) + num_rows
    return [params[name] for name, num_rows in rows.items() if num_rows == params[name].shape[0]]
