"""`LLM(quantization=...)` / `tidepool serve --quantization`: make sure the model that loads is quantized as asked.

vLLM's flag, Tidepool's semantics: a folder that already carries a `quantization_config` must
match the method asked for (`gptq`, `awq`, `int8`, `int4`), else a ValueError says what the folder
holds. A dense folder asked for `int8`/`int4` is quantized once into a sibling cache folder
(`$TIDEPOOL_QUANT_CACHE`, default `<tmp>/tidepool-quantized/<name>-<method>-g<group>-<key>`, keyed on
the source's config and weight files' sizes and mtimes), which then loads like any quantized
folder — the operator's pods do this in their writable /tmp. `gptq`/`awq` need such a checkpoint.
A GGUF file is returned as is for `gguf` (keep its Q8_0/Q4_0/Q4_1 weights), `int8` and `int4` (quantized
in memory at load, `engine/gguf/quantized.py`); `gguf` on a folder and `gptq`/`awq` on a GGUF file are errors.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from tidepool.contract.quantization import QUANTIZATION_METHODS

from ..gguf.detect import is_gguf_file
from .load import read_quant_spec
from .quantize import DEFAULT_GROUP_SIZE

logger = logging.getLogger(__name__)

METHODS = QUANTIZATION_METHODS
_KIND = {"int8": "tidepool-int8", "int4": "tidepool-int4", "gptq": "gptq", "awq": "awq"}


def prepare_quantized(model: str, quantization: str | None) -> str:
    """The folder to load for `model` quantized with `quantization` (None: the model as it is)."""
    if quantization is None:
        return model
    if quantization not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {quantization!r}")
    if is_gguf_file(model):
        if quantization in ("gptq", "awq"):
            raise ValueError(
                f"{model} is a GGUF file, not a {quantization.upper()} checkpoint; for GGUF use quantization "
                "'gguf' (keep its Q8_0/Q4_0/Q4_1 weights), 'int8'/'int4' (quantize at load) or none (dequantize)"
            )
        return model  # the GGUF loader applies the mode
    if quantization == "gguf":
        raise ValueError(
            f"quantization 'gguf' keeps a GGUF file's own quantized weights, but {model} is a Hugging Face folder; "
            "use int8, int4, gptq, awq or none"
        )
    folder = Path(model)
    spec = read_quant_spec(folder)
    if spec is not None:
        if spec.kind != _KIND[quantization]:
            raise ValueError(
                f"{folder} is already quantized as {spec.kind}, not {quantization}; drop the quantization option "
                "or point at the matching checkpoint"
            )
        return model
    if quantization in ("gptq", "awq"):
        raise ValueError(
            f"{folder} is a dense checkpoint; {quantization} needs a {quantization.upper()} checkpoint "
            "(or use int8/int4, which Tidepool quantizes at load)"
        )
    from .cli import quantize_folder

    out = _cache_dir(folder, quantization, DEFAULT_GROUP_SIZE)
    if (out / "config.json").is_file():
        logger.info("using the %s copy of %s cached in %s", quantization, folder, out)
        return str(out)
    logger.info("quantizing %s to %s into %s", folder, quantization, out)
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    quantize_folder(folder, partial, quantization)  # int4: groups of 128, narrower where a projection needs it
    partial.rename(out)  # atomic: a crash never leaves a half-written folder under the final name
    return str(out)


def _cache_dir(folder: Path, method: str, group_size: int) -> Path:
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".json", ".safetensors"):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    root = Path(os.environ.get("TIDEPOOL_QUANT_CACHE") or Path(tempfile.gettempdir()) / "tidepool-quantized")
    root.mkdir(parents=True, exist_ok=True)
    return root / f"{folder.name}-{method}-g{group_size}-{digest.hexdigest()[:12]}"
