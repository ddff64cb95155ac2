"""Decode GEMM orientation: `F.linear(x, W)` against `(W @ x.T).T` for float32 projections on the CPU.

Both compute the same products; MKL picks a different kernel and threading for each orientation.
For each row count (decode batch size) the layer projections of `--layers` SmolLM2-135M-shaped
layers (q/k/v fused, o, gate/up fused, down) and a 49,152-row LM head run both ways, interleaved
round by round in one process; medians and the speedup of the transposed form are printed and
written to results/gemm_orientation.json. `engine/layers/linear.py` uses the transposed form where
this shows it faster (above the compiled GEMV's rows, up to TRANSPOSED_MAX_ROWS).

    python bench/gemm_orientation.py                 # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of SmolLM2-135M's projections
LM_HEAD = (49152, 576)


def median_ms(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}


def both_ways(weights: list[torch.Tensor], rows: int, rounds: int) -> dict[str, float]:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def linear() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def transposed() -> None:
        for w in weights:
            torch.mm(w, inputs[w.shape[1]].t()).t().contiguous()

    got = median_ms({"F.linear": linear, "(W @ x.T).T": transposed}, rounds)
    x = inputs[weights[0].shape[1]]
    got["max_abs_diff"] = float((F.linear(x, weights[0]) - torch.mm(weights[0], x.t()).t()).abs().max())
    got["speedup"] = got["F.linear"] / got["(W @ x.T).T"]
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[9, 16, 32, 64, 96, 128, 256, 2048])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "gemm_orientation.json")
    args = parser.parse_args()
    layers = [torch.randn(*shape) for _ in range(args.layers) for shape in LAYER_SHAPES]
    head = [torch.randn(*LM_HEAD)]
    result: dict = {"threads": torch.get_num_threads(), "layers": args.layers, "rows": {}}
    for rows in tqdm(args.rows, desc="row counts"):
        result["rows"][rows] = {
            "layers": both_ways(layers, rows, args.rounds),
            "lm_head": both_ways(head, rows, args.rounds),
        }
    print(f"{args.layers} layers' projections and the LM head, {result['threads']} threads (median ms):")
    for rows, r in result["rows"].items():
        lay, lm = r["layers"], r["lm_head"]
        print(
            f"  rows {rows:5d}: layers {lay['F.linear']:8.1f} vs {lay['(W @ x.T).T']:8.1f} ({lay['speedup']:.2f}x)"
            f"   lm_head {lm['F.linear']:7.1f} vs {lm['(W @ x.T).T']:7.1f} ({lm['speedup']:.2f}x)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
