"""`quantize_folder`: write a weight-only int8/int4 copy of a dense Hugging Face model folder (a library call).

Role: reads IN (config.json + safetensors), quantizes every decoder projection with
`quant.quantize.quantize_tensors`, and writes OUT: ``model.safetensors``, config.json with a
``quantization_config`` (`quant.spec.tidepool_config`: ``quant_method: "tidepool"``; for int4 the group
size of every projection by input width, exactly what the tensors hold) and every other file of IN
(tokenizer, generation config, chat template) copied unchanged, so ``LLM(model=OUT)`` loads it back.
Callers: `tidepool quantize` (`quant/cli.py`) and `prepare.prepare_quantized` (quantization at load).

Invariants: IN is never modified; OUT must not exist or be empty (no mixing with stale shards); bad
input (unknown method, a group size that does not tile a projection, a GGUF file, an already quantized
IN) raises ValueError saying what to change, before anything is written. Without a group size int4
groups are `DEFAULT_GROUP_SIZE` wide, narrower where a projection's inputs need it
(`quant.quantize.int4_group_size`; SmolLM2's 576 -> 96).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import DTYPES, read_config_json
from ..quant.quantize import DEFAULT_GROUP_SIZE, check_method, quantize_tensors
from ..quant.spec import tidepool_config
from .formats import detect_format
from .safetensors import read_tensors


def _dense_source(src: Path, dst: Path) -> dict[str, Any]:
    """IN's config.json, once IN is known to be a dense folder and OUT free; else ValueError."""
    try:
        model_format = detect_format(src)
    except FileNotFoundError:
        raise ValueError(f"{src} is not a model folder (no config.json)") from None
    if model_format.name == "gguf":
        raise ValueError(
            f"{src} is a GGUF file; `tidepool quantize` converts Hugging Face folders. Load the GGUF with "
            "--quantization int8/int4 (quantized at load) or gguf (its own Q8_0/Q4_0/Q4_1 weights kept) instead"
        )
    if model_format.name != "hf":
        raise ValueError(f"{src} is already quantized ({model_format.name}); give a dense model")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"output folder {dst} already exists and is not empty; remove it or pick another")
    if src.resolve() == dst.resolve():
        raise ValueError("output folder must differ from the input folder")
    return read_config_json(src)


def quantize_folder(src: str | Path, dst: str | Path, method: str, group_size: int | None = None) -> Path:
    """Quantize the model in `src` into a new folder `dst`; returns `dst`. Raises ValueError on bad input.

    `group_size` None: int4 groups of `DEFAULT_GROUP_SIZE`, narrower where a projection needs it; a
    size given must divide every projection's inputs.
    """
    check_method(method)
    src, dst = Path(src), Path(dst)
    config = _dense_source(src, dst)
    dtype = DTYPES.get(str(config.get("torch_dtype", "float32")), torch.float32)
    size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    quantized, group_sizes = quantize_tensors(
        read_tensors(src), method, size, scale_dtype=dtype, adapt_group_size=group_size is None
    )
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        is_weights = item.name.endswith(".safetensors") or item.name == "model.safetensors.index.json"
        if item.is_file() and item.name != "config.json" and not is_weights:
            shutil.copy2(item, dst / item.name)
    config["quantization_config"] = tidepool_config(method, group_sizes)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(
        {k: v.contiguous() for k, v in quantized.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    (dst / "model.safetensors").chmod(0o644)
    return dst
