"""`tidepool quantize`: write a weight-only int8/int4 copy of a Hugging Face model folder (the command line).

The work is `engine/loading/quantized_copy.quantize_folder` (a library call, also used when a dense
folder is quantized at load); this module parses the arguments, reports sizes and turns bad input
(unknown method, a `--group-size` that does not tile a projection, an already quantized or GGUF IN, a
non-empty OUT) into exit status 2 with the message saying what to change, before anything is written.
Without `--group-size` int4 groups are 128 wide, narrower where a projection's inputs need it; the
written config.json records every projection's size (`quant/spec.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from ..loading.quantized_copy import quantize_folder
from .quantize import DEFAULT_GROUP_SIZE, METHODS


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
    if args.method == "int4":  # what the checkpoint records, read back
        sizes = json.loads((out / "config.json").read_text())["quantization_config"]["group_sizes"]
        groups = ", group size by input width " + ", ".join(f"{k}: {size}" for k, size in sizes.items())
    print(
        f"wrote {out} ({args.method}{groups}): "
        f"weights {src_bytes / 2**20:.1f} MiB -> {dst_bytes / 2**20:.1f} MiB in {time.perf_counter() - start:.1f}s"
    )
    return 0
