"""Decode step time by batch size, four ways in one engine: the one-call step with and without the panel kernel,
the layers with the compiled GEMV, torch.

- step: the one-call decode step (`engine/cpu_ops/decoder.cpp`) for every batch up to the GEMV's row limit
  (128): the whole step in one parallel region; projections of as many inputs as the library's threshold
  (`PANEL_MIN_INPUTS`, 24) or more take the packed-panel kernel (`engine/cpu_ops/panel.h`), fewer the
  row kernel in groups of 8.
- rows: the same step with the panel kernel turned off (every batch on the row kernel, as before it).
- layers: the one-call step to 8 sequences only, above it layer by layer: ~10 compiled calls per layer
  from Python, each projection the compiled GEMV (`engine/cpu_ops/gemv.cpp`, the same kernels as step).
- torch: as `layers`, but above 8 each projection is torch's (the transposed MKL product to 96 rows,
  `F.linear` above: `engine/layers/linear.py`), the path before the compiled GEMV took wide batches.

The four are switched round by round through the ops' row limits (`max_batch`) and panel threshold, so
the machine's noise hits all alike and the order rotates. Per batch size and round: the median step
time of `--steps` decode steps at `--context-len` tokens of context; a ratio (rows / step, layers /
step, torch / step) is taken per round, then the median over rounds. Below the threshold the step and
rows paths are the same code, and at 1-8 all four run the one-call step, so those ratios show the noise. Greedy
tokens are compared across the four. Writes JSON and a PNG of tokens/s by batch size.

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
PANEL_OFF = 1 << 30  # a panel threshold no batch reaches
PANEL_ON = 0  # stands for the library's own threshold (CpuGemv.panel_min_inputs)
# path -> (the one-call step's limit, the GEMV's limit, the panel kernel's threshold in both)
PATHS = {
    "step": (MAX_ROWS, MAX_ROWS, PANEL_ON),
    "rows": (MAX_ROWS, MAX_ROWS, PANEL_OFF),
    "layers": (8, MAX_ROWS, PANEL_ON),
    "torch": (8, 8, PANEL_ON),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    batches = "1,4,8,9,12,16,24,32,48,64,96,128"
    args = add_decode_arguments(parser, batches, steps=12, rounds=2, out=RESULTS).parse_args()

    gemv, step_op = cpu_ops.gemv_op(), cpu_ops.decoder_op()
    if gemv is None or step_op is None:
        raise SystemExit("the compiled GEMV or decode step is unavailable here (no C++ compiler?): nothing to compare")
    folder, name = resolve_model(argparse.Namespace(model=args.model))
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(folder), dtype="float32", show_progress=False, max_num_seqs=max(batches), enable_prefix_caching=False)
    paths = list(PATHS)
    steps: dict[int, dict[str, list[float]]] = {b: {k: [] for k in paths} for b in batches}
    same_tokens: dict[int, bool] = {}
    for r in range(args.rounds):
        for b in batches:
            tokens = []
            for label in paths[r % len(paths) :] + paths[: r % len(paths)]:  # rotate who goes first
                step_op.max_batch, gemv.max_batch, panel_min = PATHS[label]
                step_op.set_panel_min_inputs(panel_min or gemv.panel_min_inputs)
                gemv.set_panel_min_inputs(panel_min or gemv.panel_min_inputs)
                out = tidepool_decode_steps(llm, decode_prompts(b, args.context_len), args.steps)
                steps[b][label].append(out["step_s"])
                tokens.append(out["tokens"])
            same_tokens[b] = same_tokens.get(b, True) and all(t == tokens[0] for t in tokens)
            s, rw, lay, t = (steps[b][k][-1] for k in paths)
            print(f"round {r} bs={b:3d}: step {b / s:5.0f} tok/s  rows {b / rw:5.0f}  layers {b / lay:5.0f}  "
                  f"torch {b / t:5.0f}  rows/step {rw / s:.2f}x", flush=True)  # fmt: skip
    step_op.max_batch, gemv.max_batch, _ = PATHS["step"]
    step_op.set_panel_min_inputs(gemv.panel_min_inputs)
    gemv.set_panel_min_inputs(gemv.panel_min_inputs)
    rows = []
    for b in batches:
        ratio = {
            f"{slow}/{fast}": statistics.median(x / y for x, y in zip(steps[b][slow], steps[b][fast], strict=True))
            for slow, fast in (("rows", "step"), ("layers", "step"), ("torch", "step"))
        }
        rows.append({"batch": b, **{f"{k}_tok_s": b / statistics.median(steps[b][k]) for k in paths},
                     "ratios": ratio, "same_tokens": same_tokens[b], "rounds": steps[b]})  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"decode_batches_{Path(name).stem}"
    result = {"model": name, "context_len": args.context_len, "steps": args.steps,
              "panel_min_inputs": gemv.panel_min_inputs, "rows": rows}  # fmt: skip
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(rows, name, args.out / f"{stem}.png", gemv.panel_min_inputs)
    for row in rows:
        print(f"bs={row['batch']:3d}: " + "  ".join(f"{k} {row[f'{k}_tok_s']:6.0f} tok/s" for k in paths) + "  "
              + "  ".join(f"{k} {v:.2f}x" for k, v in row["ratios"].items())
              + ("" if row["same_tokens"] else "  (greedy tokens differ)"))  # fmt: skip
    print(f"wrote {args.out / stem}.json and .png")


def plot(rows: list[dict], name: str, path: Path, panel_from: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = {
        "step": f"one-call step (panel kernel from {panel_from})",
        "rows": "one-call step, row kernel only",
        "layers": "layer by layer above 8, compiled GEMV",
        "torch": "torch GEMM above 8",
    }
    for key, label in labels.items():
        ax.plot([r["batch"] for r in rows], [r[f"{key}_tok_s"] for r in rows], marker="o", label=label)
    ax.set(xlabel="sequences decoding", ylabel="output tokens/s", title=f"{name.split(' (')[0]}: decode by batch size")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
