"""Load a model from a local Hugging Face folder (config, then safetensors, single or sharded) or a GGUF file.

Errors name what is wrong: a missing file (and the folder it was looked for in), an
unsupported architecture (with the supported list), a tensor with the wrong shape, a weight
the checkpoint lacks; for a GGUF file, a `GGUFError` naming the file (`engine/gguf/load.py`).
A progress bar shows tensors as they are copied in.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..gguf.detect import is_gguf_file
from ..quant.load import load_quantized, read_quant_spec
from .llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file.name} listed in {index.name} is missing from {path}")
        return files
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in model folder {path}")


def iter_weights(
    files: list[Path], dtype: torch.dtype, show_progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            total += len(list(f.keys()))
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                    yield name, f.get_tensor(name).to(dtype)
                    bar.update(1)


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    show_progress: bool = True,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`(model, config)`. `quantization` applies to GGUF files (None: dequantize; "gguf": keep Q8_0/Q4_0/Q4_1;
    "int8"/"int4": quantize at load); a folder's own `quantization_config` decides for a folder."""
    if is_gguf_file(path):
        from ..gguf.load import load_gguf

        return load_gguf(path, dtype, device, max_positions, show_progress, quantization)
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    config = ModelConfig.from_pretrained(folder)
    if dtype is not None:
        config.torch_dtype = dtype
    files = safetensors_files(folder)
    model_class = MODEL_CLASSES[config.architecture]
    model = model_class(config, device=device, max_positions=max_positions)
    # A quantization_config (Tidepool's, GPTQ's or AWQ's) means: convert, swap, then load the rest.
    quant_spec = read_quant_spec(folder)
    if quant_spec is None:
        model.load_weights(iter_weights(files, config.torch_dtype, show_progress))
    else:
        load_quantized(model, files, quant_spec, config.torch_dtype, show_progress)
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s from %s: %.1fM parameters, %s", config.architecture, folder, num_params / 1e6, config.torch_dtype
    )
    return model, config
