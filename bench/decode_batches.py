"""Decode step time by batch size: the compiled GEMV's grouped kernel above 8 rows vs torch's GEMM, one process.

Above 8 sequences a decode step runs layer by layer, and each projection is either the compiled
GEMV's grouped kernel (inputs in groups of 8 over each block of weight rows, `engine/cpu_ops/gemv.cpp`)
or, as before it, torch (the transposed MKL product up to 96 rows, `F.linear` above:
`engine/layers/linear.py`). Both run in one engine, switched round by round (the op's row limit),
so the machine's noise hits both alike. Per batch size and round: the median step time of
`--steps` decode steps at `--context-len` tokens of context; the ratio is torch / grouped per round,
then the median over rounds. Batches of 1-8 (the one-call decode step either way) give the curve's
left end. Writes JSON and a PNG of output tokens/s against batch size.

    python bench/decode_batches.py --model <SmolLM2 GGUF or folder> [--batches 1,8,9,16,32,64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from offline_throughput import resolve_model, tidepool_decode_steps

from common import add_decode_arguments, decode_prompts
from tidepool.engine import LLM, cpu_ops
from tidepool.engine.cpu_ops.gemv import MAX_ROWS

RESULTS = Path(__file__).resolve().parent / "results" / "decode_batches"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    batches = "1,4,8,9,12,16,24,32,48,64,96,128"
    args = add_decode_arguments(parser, batches, steps=12, rounds=2, out=RESULTS).parse_args()

    op = cpu_ops.gemv_op()
    if op is None:
        raise SystemExit("the compiled GEMV is unavailable here (no C++ compiler?): nothing to compare")
    folder, name = resolve_model(argparse.Namespace(model=args.model))
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(folder), dtype="float32", show_progress=False, max_num_seqs=max(batches), enable_prefix_caching=False)
    limits = {"grouped": MAX_ROWS, "torch": 8}
    steps: dict[int, dict[str, list[float]]] = {b: {k: [] for k in limits} for b in batches}
    for r in range(args.rounds):
        for b in batches:
            for label in limits if r % 2 == 0 else reversed(limits):
                op.max_batch = limits[label]
                prompts = decode_prompts(b, args.context_len)
                steps[b][label].append(tidepool_decode_steps(llm, prompts, args.steps)["step_s"])
            g, t = steps[b]["grouped"][-1], steps[b]["torch"][-1]
            print(f"round {r} bs={b:3d}: grouped {1e3 * g:7.1f} ms ({b / g:5.0f} tok/s)  torch {1e3 * t:7.1f} ms "
                  f"({b / t:5.0f} tok/s)  {t / g:.2f}x", flush=True)  # fmt: skip
    op.max_batch = MAX_ROWS
    rows = []
    for b in batches:
        g, t = (statistics.median(steps[b][k]) for k in limits)
        ratio = statistics.median(x / y for x, y in zip(steps[b]["torch"], steps[b]["grouped"], strict=True))
        rows.append({"batch": b, "grouped_step_s": g, "torch_step_s": t, "grouped_tok_s": b / g,
                     "torch_tok_s": b / t, "speedup": ratio, "rounds": steps[b]})  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"decode_batches_{Path(name).stem}"
    (args.out / f"{stem}.json").write_text(json.dumps({"model": name, "context_len": args.context_len, "rows": rows},
                                                      indent=2))  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for key, label in (("grouped_tok_s", "compiled GEMV, grouped above 8"), ("torch_tok_s", "torch GEMM above 8")):
            ax.plot([r["batch"] for r in rows], [r[key] for r in rows], marker="o", label=label)
        title = f"{name.split(' (')[0]}: decode by batch size"
        ax.set(xlabel="sequences decoding", ylabel="output tokens/s", title=title)
        ax.set_xscale("log", base=2)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / f"{stem}.png", dpi=110)
    except ImportError:
        print("matplotlib is not installed: no plot")
    for row in rows:
        print(
            f"bs={row['batch']:3d}: grouped {row['grouped_tok_s']:6.0f} tok/s, torch {row['torch_tok_s']:6.0f} "
            f"tok/s, {row['speedup']:.2f}x (median of {args.rounds} rounds)"
        )
    print(f"wrote {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
