"""Decode projections on CPU: the compiled GEMV vs torch, batch 1..8 and grouped up to 128, as % of read bandwidth.

Every projection of one decode step of a model shape (per layer q/k/v, o, gate/up, down; then the LM
head) is run back to back, as the engine does, with three implementations interleaved round by
round in one process: the compiled op (`engine/cpu_ops/gemv.py`, weights `[out, in]`), `x @ W`
with `[in, out]` weights (the torch path's layout for wide projections) and `F.linear` with
`[out, in]` weights. Each is reported as the median time of a step's projections and as % of the
streaming read bandwidth measured in the same run (bytes of weights read / time / bandwidth).

    python bench/gemv.py                       # SmolLM2-135M's shapes, torch's thread count
    python bench/gemv.py --threads 1 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import read_bandwidth
from tidepool.engine import cpu_ops

RESULTS = Path(__file__).resolve().parent / "results"
# SmolLM2-135M: hidden 576, 9 heads x 64 + 2 x 3 KV heads x 64 -> qkv 960, intermediate 1536, 30 layers, vocab 49152.
SHAPES = {"smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576))}


def step_fns(shapes: list[tuple[int, int]], batch: int, op: cpu_ops.CpuGemv) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(batch)
    weights = [torch.randn(o, i, generator=gen) for o, i in shapes]
    inputs = [torch.randn(batch, i, generator=gen) for _, i in shapes]
    input_major = [w.t().contiguous() for w in weights]

    def compiled() -> None:
        for w, x in zip(weights, inputs, strict=True):
            op(x, w)

    def matmul_in_out() -> None:
        for w, x in zip(input_major, inputs, strict=True):
            torch.matmul(x, w)

    def f_linear() -> None:
        for w, x in zip(weights, inputs, strict=True):
            F.linear(x, w)

    return {"compiled": compiled, "x@W [in,out]": matmul_in_out, "F.linear": f_linear}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "gemv.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    op = cpu_ops.gemv_op()
    if op is None:
        parser.error("the compiled GEMV is unavailable here (no C++ compiler?)")
    per_layer, layers, head = SHAPES[args.model]
    shapes = per_layer * layers + [head]
    weight_bytes = sum(o * i * 4 for o, i in shapes)
    results = []
    batches = [b for b in (*range(1, 9), 12, 16, 24, 32, 48, 64, 96, 128) if b <= op.max_batch]  # 9+: grouped
    for batch in tqdm(batches, desc="batch sizes"):
        fns = step_fns(shapes, batch, op)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():  # interleaved: the machine's noise hits all three alike
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        bandwidth = read_bandwidth()
        row = {"batch": batch, "read_bandwidth_gb_s": round(bandwidth / 1e9, 2)}
        for name, samples in times.items():
            median = statistics.median(samples)
            row[name] = {"ms": round(median * 1e3, 2), "pct_read_bw": round(100 * weight_bytes / median / bandwidth, 1)}
        row["speedup_vs_best_torch"] = round(
            min(row["x@W [in,out]"]["ms"], row["F.linear"]["ms"]) / row["compiled"]["ms"], 2
        )
        results.append(row)
    out = {"model": args.model, "threads": torch.get_num_threads(), "weight_mb": round(weight_bytes / 1e6, 1),
           "rounds": args.rounds, "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for row in results:
        cells = "  ".join(f"{n} {row[n]['ms']:7.1f} ms ({row[n]['pct_read_bw']:4.1f}%)" for n in fns)
        print(f"batch {row['batch']}: {cells}  -> {row['speedup_vs_best_torch']}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
