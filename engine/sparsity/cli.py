"""`tidepool sparsify`: write a 2:4-sparse copy of a Hugging Face model folder (the command line).

The work is `prune.sparsify_folder` (a library call, also behind the cached checkpoints of the tests and
benches); this module parses the arguments, logs, and turns bad input (unknown method, a projection
whose inputs do not divide by 4, a quantized or already sparse IN, a non-empty OUT, a missing calibration
file) into exit status 2 with a message naming what to change, before anything is written.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .calibration import DEFAULT_SOURCE, SOURCES
from .format import METHODS, VALUES_DTYPES
from .prune import DEFAULT_NUM_SAMPLES, DEFAULT_SEQ_LEN, sparsify_folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tidepool sparsify",
        description="One-shot 2:4 pruning of the decoder projections (q/k/v/o, gate/up/down) into the "
        "tidepool-2:4 compressed layout (kept values + 2-bit index metadata).",
    )
    parser.add_argument("input", type=Path, help="dense Hugging Face model folder")
    parser.add_argument("output", type=Path, help="new folder to write (must not exist or be empty)")
    parser.add_argument(
        "--method",
        required=True,
        choices=METHODS,
        help="wanda: |W|·‖X‖ per input channel; sparsegpt: OBS second-order update; magnitude: |W|, no data",
    )
    parser.add_argument(
        "--values-dtype",
        choices=tuple(VALUES_DTYPES),
        default=None,
        help="dtype of the kept values (default: the model's); int8 adds per-output-channel scales",
    )
    parser.add_argument(
        "--calibration",
        default=DEFAULT_SOURCE,
        help=f"calibration text: {' or '.join(SOURCES)} (Python's bundled docs topics, the even half) "
        "or a path to a UTF-8 text file",
    )
    parser.add_argument("--num-samples", type=int, default=DEFAULT_NUM_SAMPLES, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per calibration window")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        out = sparsify_folder(
            args.input,
            args.output,
            args.method,
            args.values_dtype,
            calibration=args.calibration,
            num_samples=args.num_samples,
            seq_len=args.seq_len,
            show_progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"tidepool sparsify: error: {err}", file=sys.stderr)
        return 2
    src_bytes = sum(p.stat().st_size for p in args.input.glob("*.safetensors"))
    dst_bytes = (out / "model.safetensors").stat().st_size
    print(
        f"wrote {out} (2:4 {args.method}): weights {src_bytes / 2**20:.1f} MiB -> {dst_bytes / 2**20:.1f} MiB "
        f"in {time.perf_counter() - start:.1f}s"
    )
    return 0
