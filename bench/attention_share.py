"""Attention's share of a batch-64 decode step: the compiled CPU op against the torch path (gather + SDPA).

Each backend runs in its own process (TIDEPOOL_CPU_ATTENTION is read when the engine starts), layer by
layer (TIDEPOOL_CPU_DECODER=torch: the one-call decode step has no attention call to time), on the
same model and the same 64 prompts; the share is attention's wall time over the step's, median over
the decode steps (`offline_throughput.tidepool_decode_steps`). Rounds alternate the backends so a
noisy neighbour affects both alike.

    python bench/attention_share.py --model DIR [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one(model: str, batch: int, context_len: int) -> dict[str, float]:
    sys.path.insert(0, str(HERE))
    from offline_throughput import tidepool_decode_steps

    from tidepool.engine import LLM

    llm = LLM(model, dtype="float32", show_progress=False, max_num_batched_tokens=2048)
    prompts = [[3 + (i * 7 + j) % 1000 for j in range(context_len)] for i in range(batch)]
    return tidepool_decode_steps(llm, prompts, 8, attention=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.model, args.batch, args.context_len)))
        return
    runs = []
    for _ in range(args.rounds):
        for backend in ("compiled", "torch"):
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--batch", str(args.batch),
                   "--context-len", str(args.context_len)]  # fmt: skip
            # Attention is timed around the layers' calls; the one-call decode step makes none, so it is off.
            env = {**os.environ, "TIDEPOOL_CPU_ATTENTION": backend, "TIDEPOOL_CPU_DECODER": "torch"}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd="/tmp")
            result = {"backend": backend, **json.loads(out.stdout.strip().splitlines()[-1])}
            print(f"{backend:9s} step {result['step_s'] * 1e3:7.1f} ms  attention {result['attention_share']:.1%}")
            runs.append(result)
    out_path = HERE / "results" / f"attention_share_b{args.batch}.json"
    out_path.write_text(json.dumps({"model": args.model, "batch": args.batch, "runs": runs}, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
