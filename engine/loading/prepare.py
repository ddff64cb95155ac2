"""`LLM(quantization=...)` / `tidepool serve --quantization`: the checkpoint to load so the model is quantized as asked.

vLLM's flag, Tidepool's semantics, decided on the path's format (`formats.detect_format`): a folder
that already carries a `quantization_config` must match the method asked for (`gptq`, `awq`, `int8`,
`int4`), else a ValueError says what the folder holds. A dense folder asked for `int8`/`int4` is
quantized once (`quantized_copy.quantize_folder`) into a sibling cache folder (`$TIDEPOOL_QUANT_CACHE`,
default `<tmp>/tidepool-quantized/<name>-<method>-g<group>-<key>`, keyed on the source's config and
weight files' sizes and mtimes and on the `quantization_config` the writer records), which then loads
like any quantized folder — the operator's pods do this in their writable /tmp. `gptq`/`awq` need such
a checkpoint. A GGUF file is returned as is for `gguf` (keep its Q8_0/Q4_0/Q4_1 weights), `int8` and
`int4` (quantized in memory at load, `engine/gguf/quantized.py`); `gguf` on a folder and `gptq`/`awq`
on a GGUF file are errors.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from tidepool.contract.quantization import QUANTIZATION_METHODS

from ..quant.quantize import DEFAULT_GROUP_SIZE
from ..quant.spec import tidepool_config
from .formats import detect_format
from .quantized_copy import quantize_folder

logger = logging.getLogger(__name__)

_KIND = {"int8": "tidepool-int8", "int4": "tidepool-int4", "gptq": "gptq", "awq": "awq"}


def prepare_quantized(model: str, quantization: str | None) -> str:
    """The folder or file to load for `model` quantized with `quantization` (None: the model as it is)."""
    if quantization is None:
        return model
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}")
    model_format = detect_format(model)
    if model_format.name == "gguf":
        if quantization in ("gptq", "awq"):
            raise ValueError(
                f"{model} is a GGUF file, not a {quantization.upper()} checkpoint; for GGUF use quantization "
                "'gguf' (keep its Q8_0/Q4_0/Q4_1 weights), 'int8'/'int4' (quantize at load) or none (dequantize)"
            )
        return model  # the GGUF reader applies the mode
    if quantization == "gguf":
        raise ValueError(
            f"quantization 'gguf' keeps a GGUF file's own quantized weights, but {model} is a Hugging Face folder; "
            "use int8, int4, gptq, awq or none"
        )
    if model_format.sparsity is not None:
        return model  # a 2:4 checkpoint carries its own int8 kept values (sparsity.load.check_sparsity_request)
    if model_format.name != "hf":
        if model_format.name != _KIND[quantization]:
            raise ValueError(
                f"{model} is already quantized as {model_format.name}, not {quantization}; drop the quantization "
                "option or point at the matching checkpoint"
            )
        return model
    if quantization in ("gptq", "awq"):
        raise ValueError(
            f"{model} is a dense checkpoint; {quantization} needs a {quantization.upper()} checkpoint "
            "(or use int8/int4, which Tidepool quantizes at load)"
        )
    return str(_cached_copy(model_format.path, quantization))


def _cached_copy(folder: Path, method: str) -> Path:
    out = _cache_dir(folder, method, DEFAULT_GROUP_SIZE)
    if (out / "config.json").is_file():
        logger.info("using the %s copy of %s cached in %s", method, folder, out)
        return out
    logger.info("quantizing %s to %s into %s", folder, method, out)
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    quantize_folder(folder, partial, method)  # int4: groups of 128, narrower where a projection needs it
    partial.rename(out)  # atomic: a crash never leaves a half-written folder under the final name
    return out


def _cache_dir(folder: Path, method: str, group_size: int) -> Path:
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".json", ".safetensors"):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(repr(sorted(tidepool_config(method, {}))).encode())  # a copy in another config layout is stale
    root = Path(os.environ.get("TIDEPOOL_QUANT_CACHE") or Path(tempfile.gettempdir()) / "tidepool-quantized")
    root.mkdir(parents=True, exist_ok=True)
    return root / f"{folder.name}-{method}-g{group_size}-{digest.hexdigest()[:12]}"
