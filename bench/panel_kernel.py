"""The wide-batch projection kernel against the one it replaced, in one process: packed panels vs the row kernel.

Compiles bench/panel_kernel.cpp (the engine's headers, the engine's compile flags, OpenMP) into the
cache and runs, for every projection shape of a model (gemv.py's SHAPES) and every batch and thread
count asked for: the row kernel on the inputs 8 at a time (what `weight_rows` ran for every batch
before) and `panel_rows` (what it runs from PANEL_MIN_INPUTS inputs now), alternating round by round,
threads claiming 32-row blocks as the engine does. Reports GFLOP/s of each and their ratio; the best
round of each is kept (a microbenchmark: the weights of one projection are L3/L2-warm, unlike the
engine's step, so take engine figures from decode_batches.py).

    python bench/panel_kernel.py                          # SmolLM2-135M's shapes, 1 and 2 threads
    python bench/panel_kernel.py --batches 9,10,16 --threads 2 --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import SHAPES

from common import cache_dir
from tidepool.engine.cpu_ops import build

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NAMES = ("qkv", "o_proj", "gate_up", "down")


def compile_harness() -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("no C++ compiler: the engine runs its torch fallback here, and there is nothing to compare")
    out = cache_dir() / "bench" / "panel_kernel"
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = [*build._BASE_FLAGS, *build.define_flags(), "-march=native", "-fopenmp"]
    cmd = [cxx, *flags, "-I", str(build.SOURCE_DIR), str(HERE / "panel_kernel.cpp"), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--batches", default="9,10,12,16,24,32,64,128")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "panel_kernel.json")
    args = parser.parse_args()

    harness = compile_harness()
    layer_shapes, _, lm_head = SHAPES[args.model]
    shapes = [*zip(NAMES, layer_shapes, strict=True), ("lm_head", lm_head)]
    runs = [(name, shape, int(t)) for t in args.threads.split(",") for name, shape in shapes]
    rows = []
    for name, (out_rows, inner), threads in tqdm(runs, desc="shapes x threads"):
        rounds = max(3, args.rounds // 8) if name == "lm_head" else args.rounds
        cmd = [str(harness), name, str(out_rows), str(inner), args.batches, f"{threads},{rounds}"]
        text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows += [json.loads(line) for line in text.splitlines()]
    print(f"{'shape':>8} {'thr':>3} {'batch':>5} {'rows GF/s':>9} {'panel GF/s':>10} {'panel/rows':>10}")
    for r in rows:
        print(f"{r['shape']:>8} {r['threads']:>3} {r['batch']:>5} {r['rows_gflop_s']:>9.1f} "
              f"{r['panel_gflop_s']:>10.1f} {r['panel_speedup']:>9.2f}x")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
