"""Tensor/pipeline parallel engines vs one process on the same seeded workload, in one run.

Each layout generates the same greedy requests (all submitted at once; continuous batching
decides); the table gives output tokens/s, the ratio to the single process, start-up time and
whether the tokens are identical to the single process's (they must be). `pp2 mb1` runs the
2-stage pipeline without micro-batches (TIDEPOOL_PP_MICRO_BATCHES=1): its ratio to `pp2`
is what in-step micro-batching buys. On a CPU-only machine every rank competes for the same
cores, so parallel layouts are not expected to be faster here; the point is the overheads.

    OMP_NUM_THREADS=1 python bench/parallel.py             # small preset, 24 requests
    OMP_NUM_THREADS=1 python bench/parallel.py --quick     # tiny preset, 8 requests
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, random_workload

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = [("single", 1, 1, None), ("tp2", 2, 1, None), ("pp2", 1, 2, None), ("pp2 mb1", 1, 2, "1"),
           ("tp2xpp2", 2, 2, None)]  # fmt: skip


def run(model_dir: Path, work: list, tp: int, pp: int, micro: str | None, budget: int) -> dict:
    from tidepool.engine import LLM, SamplingParams

    if micro is None:
        os.environ.pop("TIDEPOOL_PP_MICRO_BATCHES", None)
    else:
        os.environ["TIDEPOOL_PP_MICRO_BATCHES"] = micro
    start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=budget,
        num_kv_blocks=512,
        show_progress=False,
    )
    startup = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=w.num_output_tokens, ignore_eos=True) for w in work]
    llm.generate([work[0].prompt_token_ids], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([w.prompt_token_ids for w in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.engine.close()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"seconds": elapsed, "startup_s": startup, "tokens": tokens, "tokens_per_s": sum(map(len, tokens)) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    args = parser.parse_args()
    preset = "tiny" if args.quick else "small"
    model_dir = bench_model("llama", preset)
    num = 8 if args.quick else args.num_requests
    work = random_workload(num, seed=0, vocab_size=512, input_len=(16, 160), output_len=(8, 48))
    results = {}
    for name, tp, pp, micro in LAYOUTS:
        results[name] = run(model_dir, work, tp, pp, micro, args.budget)
        print(f"{name}: {results[name]['tokens_per_s']:.1f} tok/s", flush=True)
    base = results["single"]
    print(f"\n{preset} preset, {num} requests, budget {args.budget} tokens/step, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")  # fmt: skip
    print(f"{'layout':<10} {'tok/s':>8} {'vs single':>10} {'start-up s':>11} {'same tokens':>12}")
    for name, r in results.items():
        same = r["tokens"] == base["tokens"]
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{name:<10} {r['tokens_per_s']:>8.1f} {ratio:>9.2f}x {r['startup_s']:>11.1f} {same!s:>12}")
    RESULTS.mkdir(exist_ok=True)
    summary = {
        name: {k: v for k, v in r.items() if k != "tokens"} | {"same_tokens": r["tokens"] == base["tokens"]}
        for name, r in results.items()
    }
    out = RESULTS / f"parallel_{preset}.json"
    record = {"preset": preset, "num_requests": num, "budget": args.budget, "runs": summary}
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
