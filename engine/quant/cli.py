"""`tidepool quantize`: write a weight-only int8/int4 copy of a Hugging Face model folder.

Role: reads IN (config.json + safetensors), quantizes every decoder projection with
`quantize.quantize_tensors`, and writes OUT: ``model.safetensors``, config.json with a
``quantization_config`` (``quant_method: "tidepool"``) and every other file of IN (tokenizer,
generation config, chat template) copied unchanged, so ``LLM(model=OUT)`` loads it back.

Invariants: IN is never modified; OUT must not exist or be empty (no mixing with stale shards);
bad input (unknown method, a `--group-size` that does not tile a projection, an already quantized
IN) exits with status 2 and a message saying what to change, before anything is written. Without
`--group-size` int4 groups are 128 wide, narrower where a projection's inputs need it
(`quantize.int4_group_size`; SmolLM2's 576 -> 96), the rule the loader applies too.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..gguf.detect import is_gguf_file
from .quantize import DEFAULT_GROUP_SIZE, METHODS, check_method, quantize_tensors

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _load_dense(folder: Path) -> dict[str, torch.Tensor]:
    from ..models.loader import safetensors_files

    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                tensors[key] = f.get_tensor(key)
    return tensors


def quantize_folder(src: str | Path, dst: str | Path, method: str, group_size: int | None = None) -> Path:
    """Quantize the model in `src` into a new folder `dst`; returns `dst`. Raises ValueError on bad input.

    `group_size` None: int4 groups of `DEFAULT_GROUP_SIZE`, narrower where a projection needs it; a
    size given must divide every projection's inputs.
    """
    check_method(method)
    src, dst = Path(src), Path(dst)
    config_path = src / "config.json"
    if is_gguf_file(src):
        raise ValueError(
            f"{src} is a GGUF file; `tidepool quantize` converts Hugging Face folders. Load the GGUF with "
            "--quantization int8/int4 (quantized at load) or gguf (its own Q8_0/Q4_0/Q4_1 weights kept) instead"
        )
    if not config_path.is_file():
        raise ValueError(f"{src} is not a model folder (no config.json)")
    config = json.loads(config_path.read_text())
    if "quantization_config" in config:
        raise ValueError(
            f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); give a dense model"
        )
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"output folder {dst} already exists and is not empty; remove it or pick another")
    if src.resolve() == dst.resolve():
        raise ValueError("output folder must differ from the input folder")
    dtype = _DTYPES.get(str(config.get("torch_dtype", "float32")), torch.float32)
    tensors = _load_dense(src)
    size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    quantized = quantize_tensors(tensors, method, size, scale_dtype=dtype, adapt_group_size=group_size is None)
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        is_weights = item.name.endswith(".safetensors") or item.name == "model.safetensors.index.json"
        if item.is_file() and item.name != "config.json" and not is_weights:
            shutil.copy2(item, dst / item.name)
    config["quantization_config"] = {
        "quant_method": "tidepool",
        "method": method,
        "bits": 8 if method == "int8" else 4,
        "group_size": size if method == "int4" else None,  # at most: see quantize.int4_group_size
        "zero_point": method == "int4",
        "modules": "decoder projections (q/k/v/o, gate/up/down); embeddings, norms and lm_head dense",
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(
        {k: v.contiguous() for k, v in quantized.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    (dst / "model.safetensors").chmod(0o644)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tidepool quantize", description="Write a weight-only int8/int4 quantized copy of a model folder."
    )
    parser.add_argument("--method", required=True, choices=METHODS, help="int8: per-channel; int4: group-wise")
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"int4 group size along the input; must divide every projection's inputs (default: "
        f"{DEFAULT_GROUP_SIZE}, or the largest multiple of 8 below it that divides a projection's inputs)",
    )
    parser.add_argument("input", type=Path, help="dense Hugging Face model folder")
    parser.add_argument("output", type=Path, help="new folder to write (must not exist or be empty)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        out = quantize_folder(args.input, args.output, args.method, args.group_size)
    except (ValueError, FileNotFoundError) as err:
        print(f"tidepool quantize: error: {err}", file=sys.stderr)
        return 2
    src_bytes = sum(p.stat().st_size for p in args.input.glob("*.safetensors"))
    dst_bytes = (out / "model.safetensors").stat().st_size
    groups = ""
    if args.method == "int4":
        given = args.group_size is not None
        groups = f", group size {args.group_size}" if given else f", groups of at most {DEFAULT_GROUP_SIZE}"
    print(
        f"wrote {out} ({args.method}{groups}): "
        f"weights {src_bytes / 2**20:.1f} MiB -> {dst_bytes / 2**20:.1f} MiB in {time.perf_counter() - start:.1f}s"
    )
    return 0
