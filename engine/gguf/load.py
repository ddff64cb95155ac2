"""Build a Tidepool model from a GGUF file: config from metadata, then weights, dense or quantized.

Called by `engine/models/loader.py` for a `.gguf` path. Order: parse and check the file (types,
architecture) before allocating anything; build the model; swap in quantized projections when
asked (`quantized.py`); copy every remaining tensor in through the model's own `load_weights`, which
reports any tensor the file lacks or that has the wrong shape (re-raised as `GGUFError` naming the
file). A progress bar counts tensors.

`pack_weights=True` (the single-process CPU engine, when nothing re-lays the weights out after
loading) moves the parameters into one huge-page-advised arena (`hugepages.pack_weights`) before
the load, so each weight is written once, into its final place, instead of loaded and then copied
into the arena by the model runner (whose own pack then finds nothing to move). Not for a model that
is sharded after loading: a kept shard would hold the whole arena.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import hugepages
from ..config import ModelConfig
from ..models.llama import LlamaForCausalLM
from .config import model_config_from_gguf
from .errors import GGUFError
from .quantized import MODES, swap_quantized
from .reader import open_gguf
from .tensors import WeightSource

logger = logging.getLogger(__name__)


def load_gguf(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    show_progress: bool = True,
    quantization: str | None = None,
    *,
    pack_weights: bool = False,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`(model, config)` from a GGUF file; `quantization` None (dequantize), "gguf", "int8" or "int4".

    `pack_weights`: load straight into a huge-page arena (see the module docstring).
    """
    if quantization is not None and quantization not in MODES:
        raise ValueError(
            f"quantization={quantization!r} does not apply to a GGUF file; use None (dequantize to dtype), "
            f"{', '.join(repr(m) for m in MODES)}"
        )
    gguf = open_gguf(path)
    config = model_config_from_gguf(gguf)
    if dtype is not None:
        config.torch_dtype = dtype
    source = WeightSource(gguf, config.num_attention_heads, config.num_key_value_heads)
    model = LlamaForCausalLM(config, device=device, max_positions=max_positions)
    consumed: set[str] = set()
    if quantization is not None:
        consumed = swap_quantized(model, source, quantization, config.torch_dtype, show_progress)
    names = [name for name in source.by_hf_name if name not in consumed]
    packed = hugepages.pack_weights(model, unwritten=_loaded_whole(model)) if pack_weights else None
    weights = source.iter_dense(names, config.torch_dtype)
    bar = tqdm(weights, total=len(names), desc="Loading GGUF weights", unit="tensor", disable=not show_progress)
    try:
        model.load_weights(bar)  # every parameter `_loaded_whole` named is written here, or this raises
    except GGUFError:
        raise
    except ValueError as err:
        raise GGUFError(f"{gguf.path}: {err}") from None
    if packed is not None and packed.reason is None:
        logger.info("huge pages: %s (loaded in place)", packed.summary())
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s from %s: %.1fM dense parameters, %s%s",
        config.architecture,
        gguf.path.name,
        num_params / 1e6,
        config.torch_dtype,
        f", projections quantized ({quantization})" if quantization else "",
    )
    return model, config


def _loaded_whole(model: LlamaForCausalLM) -> list[torch.nn.Parameter]:
    """Parameters whose every row `load_weights` writes (it raises unless the file has them all)."""
    params = dict(model.named_parameters())
    rows: dict[str, int] = {}
    for name, _, num_rows in model.checkpoint_layout().values():
        rows[name] = rows.get(name, 0) + num_rows
    return [params[name] for name, num_rows in rows.items() if num_rows == params[name].shape[0]]
