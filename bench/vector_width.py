"""Decode step time by batch size with the CPU ops built for 8-float and for 16-float vectors.

`engine/cpu_ops/vec.h` picks the SIMD width from the CPU (16 floats with AVX-512, else 8);
TIDEPOOL_CPU_VECTOR_WIDTH forces one. This runs the same engine, model and decode batches once per
width, each in its own process (a library is loaded once per process), alternating the order round by
round so the machine's drift hits both alike. Per batch size and round: the median step time of
`--steps` decode steps at `--context-len` tokens of context, and the ratio 8-float / 16-float; the
median ratio over rounds is reported. It also says whether both widths chose the same greedy tokens
(the summation order differs, so a near-tie may flip; the tests bound the difference in value).

    python bench/vector_width.py --model <SmolLM2 GGUF-converted folder> [--batches 1,16,64,128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_prompts
from tidepool.engine.cpu_ops import build

RESULTS = Path(__file__).resolve().parent / "results"
WIDTHS = build.VECTOR_WIDTHS


def child(model: str, batches: list[int], context_len: int, steps: int) -> None:
    """One process, one width: print one JSON line per batch size."""
    from offline_throughput import tidepool_decode_steps

    from tidepool.engine import LLM

    llm = LLM(model, dtype="float32", max_num_seqs=max(batches), show_progress=False, max_num_batched_tokens=2048)
    built = build.build_library("decoder", "decoder.cpp")
    for batch in batches:
        run = tidepool_decode_steps(llm, decode_prompts(batch, context_len), steps)
        line = {"width": built.vector_width, "batch": batch, "step_s": run["step_s"], "tokens": run["tokens"]}
        print(json.dumps(line), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,16,64,128")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", type=int, choices=WIDTHS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "vector_width.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child is not None:
        child(args.model, batches, args.context_len, args.steps)
        return 0

    runs: list[dict] = []
    order = list(WIDTHS)
    for round_ in tqdm(range(args.rounds), desc="rounds"):
        for width in order:
            env = {**os.environ, build.VECTOR_WIDTH_ENV: str(width)}
            cmd = [sys.executable, __file__, "--model", args.model, "--batches", args.batches, "--child", str(width),
                   "--context-len", str(args.context_len), "--steps", str(args.steps)]  # fmt: skip
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                if line.startswith("{"):
                    runs.append({**json.loads(line), "round": round_})
        order.reverse()
    if {r["width"] for r in runs} != set(WIDTHS):
        raise SystemExit(f"the libraries did not report the widths asked for: {sorted({r['width'] for r in runs})}")
    rows = []
    print(f"{'batch':>5} {'8-float ms':>10} {'16-float ms':>11} {'8 / 16':>7}  same greedy tokens")
    for batch in batches:
        at = {(r["width"], r["round"]): r for r in runs if r["batch"] == batch}
        ratios = [at[8, i]["step_s"] / at[16, i]["step_s"] for i in range(args.rounds)]
        ms = {w: statistics.median(at[w, i]["step_s"] for i in range(args.rounds)) * 1e3 for w in WIDTHS}
        same = all(at[8, i]["tokens"] == at[16, i]["tokens"] for i in range(args.rounds))
        rows.append({"batch": batch, "ms_8": ms[8], "ms_16": ms[16], "ratio": statistics.median(ratios),
                     "ratios": ratios, "same_tokens": same})  # fmt: skip
        print(f"{batch:>5} {ms[8]:>10.1f} {ms[16]:>11.1f} {statistics.median(ratios):>6.2f}x  {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "context_len": args.context_len, "steps": args.steps, "rounds": args.rounds}
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
