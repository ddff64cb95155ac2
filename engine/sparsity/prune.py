"""`sparsify_folder`: write a 2:4-sparse copy of a dense Hugging Face model folder (a library call), and its cache.

Role: the driver behind `tidepool sparsify`. It checks IN (dense, every projection's inputs divisible by 4)
and OUT (absent or empty) before any work, builds the calibration windows (`calibration.py`), loads IN
with transformers in float32, prunes it layer by layer (`sequential.prune_model`), and writes OUT through
`format.py`: ``P.values``/``P.meta`` (``P.scales`` for int8) instead of every projection's ``P.weight``,
every other tensor unchanged, config.json with ``sparsity_config`` (method, values dtype, calibration
provenance) and the other files of IN (tokenizer, generation config, chat template) copied.
`cached_sparse_checkpoint` builds such a copy once under ``$TIDEPOOL_CACHE/sparse/`` (default
~/.cache/tidepool), keyed by the source (name + hash of its config and weight files' names, sizes and
mtimes) and by method, values dtype and calibration size, for the exactness tests and benches.
`densify_folder` writes the dense equivalent of a sparse folder that transformers loads as is.

Invariants: IN is never modified; bad input raises ValueError naming the tensor or the field before
anything is written; int8 kept values are quantized per output channel over the kept values with
`quant.quantize.quantize_int8` (float32 scales); a cache entry appears atomically (built aside, renamed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import read_config_json
from ..loading.quantized_copy import _dense_source
from ..loading.safetensors import read_tensors, safetensors_files
from ..quant.quantize import is_quantizable, quantize_int8
from .calibration import DEFAULT_SOURCE, calibration_windows
from .format import (
    CONFIG_KEY,
    META_SUFFIX,
    METHODS,
    VALUES_DTYPES,
    VALUES_SUFFIX,
    check_divisible,
    densify_tensors,
    kept_mask,
    pack_2to4,
    read_sparsity_config,
    sparse_names,
    sparsity_config,
    unpack_2to4,
)
from .sequential import prune_model

logger = logging.getLogger(__name__)

DEFAULT_NUM_SAMPLES = 64
DEFAULT_SEQ_LEN = 256
_WEIGHT = ".weight"


def _check_source(src: Path, dst: Path, method: str, values_dtype: str | None) -> dict[str, Any]:
    if method not in METHODS:
        raise ValueError(f"unknown sparsification method {method!r}; valid methods: {', '.join(METHODS)}")
    if values_dtype is not None and values_dtype not in VALUES_DTYPES:
        raise ValueError(f"unknown values dtype {values_dtype!r}; valid: {', '.join(VALUES_DTYPES)}")
    if (src / "config.json").is_file() and CONFIG_KEY in read_config_json(src):
        raise ValueError(f"{src} is already 2:4 sparse ({CONFIG_KEY} in its config.json); give a dense model")
    return _dense_source(src, dst)


def projection_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"model.layers.i.<proj>": weight}`` for every decoder projection; ValueError naming one that cannot be 2:4."""
    weights = {name[: -len(_WEIGHT)]: t for name, t in tensors.items() if is_quantizable(name)}
    if not weights:
        raise ValueError("the checkpoint has no decoder projections (model.layers.*.{self_attn,mlp}.*_proj.weight)")
    for prefix, weight in weights.items():
        check_divisible(f"{prefix}{_WEIGHT}", weight.shape[-1])
    return weights


def pack_projection(
    prefix: str, weight: torch.Tensor, mask: torch.Tensor, values_dtype: str
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one pruned projection (`format.py` layout), kept values in `values_dtype`."""
    values, meta = pack_2to4(weight.float(), mask, f"{prefix}{_WEIGHT}")
    values_name, meta_name, scales_name = sparse_names(prefix)
    if values_dtype == "int8":
        q, scales = quantize_int8(values, torch.float32)
        return {values_name: q, meta_name: meta, scales_name: scales}
    return {values_name: values.to(VALUES_DTYPES[values_dtype]), meta_name: meta}


def _source_dtype(config: dict[str, Any]) -> str:
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return name if name in VALUES_DTYPES and name != "int8" else "float32"


def sparsify_folder(
    src: str | Path,
    dst: str | Path,
    method: str,
    values_dtype: str | None = None,
    calibration: str = DEFAULT_SOURCE,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
    show_progress: bool = True,
) -> Path:
    """Prune the model in `src` 2:4 with `method` into the new folder `dst`; returns `dst`.

    `values_dtype` None keeps the source dtype (float32/float16/bfloat16); ``"int8"`` adds per-channel
    scales. `calibration` is a `calibration.SOURCES` name or a text file (unused by magnitude).
    """
    src, dst = Path(src), Path(dst)
    config = _check_source(src, dst, method, values_dtype)
    values_dtype = values_dtype or _source_dtype(config)
    tensors = read_tensors(src)
    projections = projection_weights(tensors)  # every projection divisible by 4, before the slow part
    provenance: dict[str, Any] = {"source": None}
    windows = None
    if method != "magnitude":
        windows = calibration_windows(src, calibration, num_samples, seq_len)
        provenance = _provenance(calibration, num_samples, seq_len)
    logger.info("pruning %s 2:4 with %s (%s)", src, method, provenance)
    model = _load_hf(src)
    masks = prune_model(model, method, windows, show_progress)
    if set(masks) != set(projections):
        missed = sorted(set(projections) ^ set(masks))[:3]
        raise ValueError(f"{src}: the checkpoint's projections and the loaded model's differ (e.g. {missed})")
    params = dict(model.named_parameters())
    out = {name: t for name, t in tensors.items() if not is_quantizable(name)}
    for prefix, mask in masks.items():
        out.update(pack_projection(prefix, params[prefix + _WEIGHT].detach(), mask, values_dtype))
    config[CONFIG_KEY] = sparsity_config(method, values_dtype, provenance)
    _write_folder(src, dst, config, out)
    return dst


def _provenance(calibration: str, num_samples: int, seq_len: int) -> dict[str, Any]:
    text = (
        "pydoc_data.topics of CPython (even-indexed topics; odd ones are held out for evaluation)"
        if calibration == DEFAULT_SOURCE
        else f"text file {Path(calibration).name}"
    )
    return {
        "source": calibration,
        "text": text,
        "num_samples": num_samples,
        "seq_len": seq_len,
        "python": sys.version.split()[0],
    }


def _load_hf(src: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _write_folder(src: Path, dst: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        is_weights = item.name.endswith(".safetensors") or item.name == "model.safetensors.index.json"
        if item.is_file() and item.name != "config.json" and not is_weights:
            shutil.copy2(item, dst / item.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    weights = dst / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)


def densify_folder(src: str | Path, dst: str | Path) -> Path:
    """Write the dense equivalent of the sparse folder `src` (unpacked weights, no ``sparsity_config``) to `dst`."""
    src, dst = Path(src), Path(dst)
    config = read_config_json(src)
    if read_sparsity_config(config, str(src / "config.json")) is None:
        raise ValueError(f"{src} has no {CONFIG_KEY} in its config.json; it is not a 2:4 sparse folder")
    dense = densify_tensors(read_tensors(src))
    dtype = VALUES_DTYPES[_source_dtype(config)]
    dense = {k: v.to(dtype) if k.endswith(_WEIGHT) and v.is_floating_point() else v for k, v in dense.items()}
    del config[CONFIG_KEY]
    _write_folder(src, dst, config, dense)
    return dst


def convert_values(src: str | Path, dst: str | Path, values_dtype: str) -> Path:
    """Write the sparse folder `src` (float kept values) to `dst` with its kept values in `values_dtype`.

    The same masks and kept weights; int8 quantizes them per output channel as `sparsify_folder` does, so
    pruning once and converting equals pruning straight to `values_dtype`.
    """
    src, dst = Path(src), Path(dst)
    config = read_config_json(src)
    spec = read_sparsity_config(config, str(src / "config.json"))
    if spec is None or spec.values_dtype == "int8":
        raise ValueError(f"{src} is not a 2:4 sparse folder with float kept values")
    tensors = read_tensors(src)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(VALUES_SUFFIX):
            prefix = name[: -len(VALUES_SUFFIX)]
            meta = tensors[prefix + META_SUFFIX]
            in_features = 2 * tensor.shape[-1]
            dense = unpack_2to4(tensor, meta, in_features, name=prefix)
            out.update(pack_projection(prefix, dense, kept_mask(meta, in_features), values_dtype))
        elif not name.endswith(META_SUFFIX):
            out[name] = tensor
    config[CONFIG_KEY] = sparsity_config(spec.method, values_dtype, spec.calibration, spec.targets)
    _write_folder(src, dst, config, out)
    return dst


def cache_root() -> Path:
    return Path(os.environ.get("TIDEPOOL_CACHE", "~/.cache/tidepool")).expanduser() / "sparse"


def _source_key(src: Path) -> str:
    digest = hashlib.sha256((src / "config.json").read_bytes())
    for file in safetensors_files(src):
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return f"{src.name}-{digest.hexdigest()[:12]}"


def cached_sparse_checkpoint(
    src: str | Path,
    method: str,
    values_dtype: str = "float32",
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> Path:
    """The 2:4 copy of `src` pruned with `method` (built on first use; see the module docstring for the key).

    Other values dtypes than float32 are converted from the float32 entry (`convert_values`): one pruning
    run per method and source.
    """
    src = Path(src)
    calibration = "" if method == "magnitude" else f"-n{num_samples}-l{seq_len}"
    path = cache_root() / _source_key(src) / f"{method}-{values_dtype}{calibration}"
    if (path / "config.json").is_file():
        return path
    building = path.with_name(f".{path.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    if values_dtype == "float32":
        sparsify_folder(src, building, method, "float32", num_samples=num_samples, seq_len=seq_len)
    else:
        convert_values(cached_sparse_checkpoint(src, method, "float32", num_samples, seq_len), building, values_dtype)
    try:
        building.rename(path)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(building, ignore_errors=True)
        if not (path / "config.json").is_file():
            raise
    return path
