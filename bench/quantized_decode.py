"""Decode with a GGUF's 4-bit weights kept, int8 and int4 weights, vs the same file dequantized to float32, one process.

Four engines load the same .gguf (Q4_0/Q4_1 projections): "dense" dequantizes every weight to float32;
"int4" keeps the projections as Tidepool int4 (`quantization="gguf"`: group 32, tiled for the compiled
CPU op, `engine/cpu_ops/int4_gemv.cpp`); "int8" quantizes the dequantized projections to per-channel
int8 at load (`quantization="int8"`, the compiled GEMV's int8 rows); "int4-load" re-quantizes the
dequantized projections to int4 at load (`quantization="int4"`: groups of 128, 96 where the 576
inputs need it). The one-call decode step reads all four (1-128 sequences). Rounds rotate the order;
per batch size and round, the median step time of `--steps` decode steps at `--context-len` tokens of
context; a speedup is dense / variant per round, then the median. bs=1 is also reported as bytes read
per step (weights as stored + KV) / step time / the read bandwidth measured in the same run. Finally,
once, the int4 model on torch's int4 path (`TIDEPOOL_CPU_INT4=torch`, what the engine did before the
compiled op) at bs=1. Writes JSON and a PNG of tokens/s by batch size.

    python bench/quantized_decode.py --model <SmolLM2 Q4_1 GGUF> [--batches 1,4,8,16] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from offline_throughput import tidepool_decode_steps

from common import add_decode_arguments, decode_bytes_per_step, decode_prompts, read_bandwidth
from tidepool.engine import LLM, cpu_ops

RESULTS = Path(__file__).resolve().parent / "results" / "quantized_decode"
VARIANTS = {
    "dense": {"dtype": "float32"},
    "int4": {"quantization": "gguf"},
    "int8": {"quantization": "int8"},
    "int4-load": {"quantization": "int4"},
}


def mbu(llm: LLM, context_len: int, step_s: float, bandwidth: float) -> dict[str, float]:
    model = llm.engine.model
    bytes_per_step = decode_bytes_per_step(model, model.config, context_len)
    return {"bytes_per_step": bytes_per_step, "mbu": bytes_per_step / step_s / bandwidth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_decode_arguments(parser, "1,4,8,16", steps=24, rounds=4, out=RESULTS).parse_args()
    model = Path(args.model)
    if model.suffix != ".gguf":
        raise SystemExit(f"--model {model}: expected a .gguf file with 4-bit projections")
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(show_progress=False, max_num_seqs=max(batches), enable_prefix_caching=False)
    engines = {name: LLM(str(model), **kwargs, **common) for name, kwargs in VARIANTS.items()}
    bandwidth = [read_bandwidth()]
    times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in engines}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    names = list(engines)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
            for b in batches:
                out = tidepool_decode_steps(engines[name], decode_prompts(b, args.context_len), args.steps)
                times[name][b].append(out["step_s"])
                tokens.setdefault((name, b), out["tokens"])
        print(f"round {r}: " + "  ".join(
            f"bs={b} " + "/".join(f"{1e3 * times[n][b][-1]:.1f}" for n in names) + " ms" for b in batches
        ))  # fmt: skip
    bandwidth.append(read_bandwidth())
    read_bw = max(bandwidth)

    os.environ[cpu_ops.INT4_MODE_ENV] = "torch"  # the path before the compiled op, for reference (not interleaved)
    cpu_ops.reset()
    try:
        before = LLM(str(model), quantization="gguf", **common)
        torch_path = tidepool_decode_steps(before, decode_prompts(1, args.context_len), max(4, args.steps // 4))
    finally:
        os.environ.pop(cpu_ops.INT4_MODE_ENV)
        cpu_ops.reset()

    rows = []
    for b in batches:
        row: dict = {"batch": b}
        dense = times["dense"][b]
        for name in names:
            row[f"{name}_step_s"] = statistics.median(times[name][b])
            row[f"{name}_tok_s"] = b / row[f"{name}_step_s"]
            if name != "dense":
                ratios = [d / q for d, q in zip(dense, times[name][b], strict=True)]
                same = sum(x == y for x, y in zip(tokens[("dense", b)], tokens[(name, b)], strict=True))
                row[f"{name}_speedup_median"] = statistics.median(ratios)
                row[f"{name}_speedup_per_round"] = ratios
                row[f"{name}_prompts_with_dense_greedy_tokens"] = f"{same}/{b}"
        rows.append(row)
    bs1 = {name: mbu(llm, args.context_len, statistics.median(times[name][1]), read_bw)
           for name, llm in engines.items()} if 1 in batches else {}  # fmt: skip
    result = {
        "model": model.name, "variants": VARIANTS, "threads": torch.get_num_threads(),
        "context_len": args.context_len, "steps": args.steps, "rounds": args.rounds,
        "read_bandwidth_GBps": [bw / 1e9 for bw in bandwidth], "rows": rows, "bs1_bytes_and_mbu": bs1,
        "int4_torch_path_bs1": {"step_s": torch_path["step_s"], "tok_s": 1 / torch_path["step_s"]},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"quantized_decode_{model.stem}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, names, model.name, stem.with_suffix(".png"))
    print(f"read bandwidth {read_bw / 1e9:.1f} GB/s; int4 on torch's path (before): "
          f"{1 / torch_path['step_s']:.1f} tok/s at bs=1")  # fmt: skip
    for name, m in bs1.items():
        print(f"bs=1 {name}: {m['bytes_per_step'] / 2**20:.0f} MiB per step, {100 * m['mbu']:.1f}% of read bandwidth")
    for row in rows:
        print(f"bs={row['batch']:3d}: dense {row['dense_tok_s']:6.1f} tok/s; " + "; ".join(
            f"{n} {row[f'{n}_tok_s']:6.1f} tok/s ({row[f'{n}_speedup_median']:.2f}x, dense's greedy tokens "
            f"{row[f'{n}_prompts_with_dense_greedy_tokens']})" for n in names[1:]
        ))  # fmt: skip
    print(f"wrote {stem.with_suffix('.json')}")


def plot(rows: list[dict], names: list[str], model: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    labels = {
        "dense": "float32 (dequantized)",
        "int4": "int4 kept (compiled op)",
        "int8": "int8 (compiled GEMV)",
        "int4-load": "int4 quantized at load (compiled op)",
    }
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in names:
        ax.plot([r["batch"] for r in rows], [r[f"{name}_tok_s"] for r in rows], marker="o", label=labels[name])
    ax.set_xlabel("sequences decoding")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{model}: decode with quantized weights vs float32")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
