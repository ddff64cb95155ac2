"""Decode step time by batch size with the CPU ops built two ways: vector width, weight prefetch distance, or
the cache level prefetches fill.

`engine/cpu_ops/build.py` takes three build-time settings from the environment: the SIMD width
(TIDEPOOL_CPU_VECTOR_WIDTH; default 16 floats with AVX-512, else 8), how far ahead the weight
streams prefetch (TIDEPOOL_CPU_PREFETCH_BYTES; default 4096, `off` for none) and which cache level the
weight and KV prefetches fill (TIDEPOOL_CPU_PREFETCH_CACHE; default l2, or l1). This runs the same
engine, model and decode batches once per value of one of them, each in its own process (a library
is loaded once per process), alternating the order round by round so the machine's drift hits every
value alike. Per batch size and round: the median step time of `--steps` decode steps at
`--context-len` tokens of context, and the ratio first value / second value; the median ratio over
rounds is reported. It also says whether both builds chose the same greedy tokens (a different width
changes the summation order, so a near-tie may flip; prefetching changes no arithmetic).

    python bench/build_variants.py --model <SmolLM2 GGUF-converted folder> [--variable width] [--rounds 2]
    python bench/build_variants.py --model <folder> --variable prefetch --threads 1 --batches 1,4
    python bench/build_variants.py --model <the GGUF> --quantization gguf --variable prefetch --batches 1,4,16
    python bench/build_variants.py --model <folder> --variable prefetch-cache --batches 1,16,64 --context-len 620
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
from tidepool.engine.threads import ENV_NUM_THREADS

RESULTS = Path(__file__).resolve().parent / "results"
# variable -> (environment variable, the two values compared, what the library reports, results file)
VARIABLES = {
    "width": (build.VECTOR_WIDTH_ENV, tuple(str(w) for w in build.VECTOR_WIDTHS), "vector_width", "vector_width.json"),
    "prefetch": (build.PREFETCH_ENV, ("off", "auto"), "prefetch_bytes", "prefetch.json"),
    "prefetch-cache": (build.PREFETCH_CACHE_ENV, ("l1", "l2"), "prefetch_cache", "prefetch_cache.json"),
}


def child(model: str, batches: list[int], context_len: int, steps: int, reported: str, quant: str | None) -> None:
    """One process, one build: print one JSON line per batch size."""
    from offline_throughput import tidepool_decode_steps

    from tidepool.engine import LLM

    llm = LLM(model, dtype="float32", quantization=quant, max_num_seqs=max(batches), show_progress=False,
              max_num_batched_tokens=2048)  # fmt: skip
    built = getattr(build.build_library("decoder", "decoder.cpp"), reported)
    for batch in batches:
        run = tidepool_decode_steps(llm, decode_prompts(batch, context_len), steps)
        print(
            json.dumps({"built": built, "batch": batch, "step_s": run["step_s"], "tokens": run["tokens"]}), flush=True
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--variable", choices=sorted(VARIABLES), default="width")
    parser.add_argument("--batches", default="1,16,64,128")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantization", help="the engine's quantization (e.g. gguf: a GGUF's int4 weights kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's choice)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: results/<vector_width|prefetch|prefetch_cache>.json"
    )
    args = parser.parse_args()
    env_name, values, reported, out_name = VARIABLES[args.variable]
    batches = [int(b) for b in args.batches.split(",")]
    if args.child is not None:
        child(args.model, batches, args.context_len, args.steps, reported, args.quantization)
        return 0

    runs: list[dict] = []
    order = list(values)
    for round_ in tqdm(range(args.rounds), desc="rounds"):
        for value in order:
            env = {**os.environ, env_name: value}
            if args.threads:
                env[ENV_NUM_THREADS] = str(args.threads)
            cmd = [sys.executable, __file__, "--model", args.model, "--batches", args.batches, "--child", value,
                   "--variable", args.variable, "--context-len", str(args.context_len),
                   "--steps", str(args.steps)]  # fmt: skip
            if args.quantization:
                cmd += ["--quantization", args.quantization]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                if line.startswith("{"):
                    runs.append({**json.loads(line), "value": value, "round": round_})
        order.reverse()
    built = {v: sorted({r["built"] for r in runs if r["value"] == v}) for v in values}
    if len({tuple(b) for b in built.values()}) != len(values):
        raise SystemExit(f"the libraries did not differ as asked ({reported}: {built})")
    first, second = values
    rows = []
    print(f"{'batch':>5} {first + ' ms':>11} {second + ' ms':>11} {'ratio':>6}  same greedy tokens")
    for batch in batches:
        at = {(r["value"], r["round"]): r for r in runs if r["batch"] == batch}
        ratios = [at[first, i]["step_s"] / at[second, i]["step_s"] for i in range(args.rounds)]
        ms = {v: statistics.median(at[v, i]["step_s"] for i in range(args.rounds)) * 1e3 for v in values}
        same = all(at[first, i]["tokens"] == at[second, i]["tokens"] for i in range(args.rounds))
        rows.append({"batch": batch, f"ms_{first}": ms[first], f"ms_{second}": ms[second],
                     "ratio": statistics.median(ratios), "ratios": ratios, "same_tokens": same})  # fmt: skip
        print(f"{batch:>5} {ms[first]:>11.1f} {ms[second]:>11.1f} {statistics.median(ratios):>5.2f}x  {same}")
    out = args.out or RESULTS / out_name
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "quantization": args.quantization, "variable": env_name,
            "built": {v: b[0] for v, b in built.items()},
            "threads": args.threads, "context_len": args.context_len, "steps": args.steps,
            "rounds": args.rounds}  # fmt: skip
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
