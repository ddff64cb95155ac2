"""Decode with a GGUF's 4-bit weights kept (quantization="gguf") vs the same file dequantized to float32, one process.

Both engines load the same .gguf (Q4_0/Q4_1 projections): "dense" dequantizes every weight to float32,
"int4" keeps the projections as Tidepool int4 (group 32, tiled for the compiled CPU op,
`engine/cpu_ops/int4_gemv.cpp`; the one-call decode step reads them for 1-8 sequences). Rounds
alternate the order of the two; per batch size and round, the median step time of `--steps` decode
steps at `--context-len` tokens of context; the speedup is dense / int4 per round, then the median.
bs=1 is also reported as bytes read per step (weights as stored + KV) / step time / the read bandwidth
measured in the same run. Finally, once, the int4 model on torch's int4 path (`TIDEPOOL_CPU_INT4=torch`,
what the engine did before the compiled op) at bs=1. Writes JSON and a PNG of tokens/s by batch size.

    python bench/int4_decode.py --model <SmolLM2 Q4_1 GGUF> [--batches 1,4,8,16] [--rounds 4]
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

RESULTS = Path(__file__).resolve().parent / "results" / "int4"


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
    engines = {
        "dense": LLM(str(model), dtype="float32", **common),
        "int4": LLM(str(model), quantization="gguf", **common),
    }
    bandwidth = [read_bandwidth()]
    times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in engines}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for r in range(args.rounds):
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        for name, llm in order:
            for b in batches:
                out = tidepool_decode_steps(llm, decode_prompts(b, args.context_len), args.steps)
                times[name][b].append(out["step_s"])
                tokens.setdefault((name, b), out["tokens"])
        print(f"round {r}: " + "  ".join(
            f"bs={b} {1e3 * times['dense'][b][-1]:.1f}/{1e3 * times['int4'][b][-1]:.1f} ms" for b in batches
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
        dense, int4 = statistics.median(times["dense"][b]), statistics.median(times["int4"][b])
        ratios = [d / q for d, q in zip(times["dense"][b], times["int4"][b], strict=True)]
        agree = sum(x == y for x, y in zip(tokens[("dense", b)], tokens[("int4", b)], strict=True))
        rows.append({
            "batch": b, "dense_step_s": dense, "int4_step_s": int4, "dense_tok_s": b / dense, "int4_tok_s": b / int4,
            "speedup_median": statistics.median(ratios), "speedup_per_round": ratios,
            "prompts_with_same_greedy_tokens": f"{agree}/{b}",
        })  # fmt: skip
    bs1 = {name: mbu(llm, args.context_len, statistics.median(times[name][1]), read_bw)
           for name, llm in engines.items()} if 1 in batches else {}  # fmt: skip
    result = {
        "model": model.name, "threads": torch.get_num_threads(), "context_len": args.context_len,
        "steps": args.steps, "rounds": args.rounds, "read_bandwidth_GBps": [bw / 1e9 for bw in bandwidth],
        "rows": rows, "bs1_bytes_and_mbu": bs1,
        "int4_torch_path_bs1": {"step_s": torch_path["step_s"], "tok_s": 1 / torch_path["step_s"]},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"int4_decode_{model.stem}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, model.name, stem.with_suffix(".png"))
    print(f"read bandwidth {read_bw / 1e9:.1f} GB/s; int4 on torch's path (before): "
          f"{1 / torch_path['step_s']:.1f} tok/s at bs=1")  # fmt: skip
    for name, m in bs1.items():
        print(f"bs=1 {name}: {m['bytes_per_step'] / 2**20:.0f} MiB per step, {100 * m['mbu']:.1f}% of read bandwidth")
    for row in rows:
        print(
            f"bs={row['batch']:3d}: dense {row['dense_tok_s']:6.1f} tok/s, int4 {row['int4_tok_s']:6.1f} tok/s "
            f"({row['speedup_median']:.2f}x); same greedy tokens {row['prompts_with_same_greedy_tokens']}"
        )
    print(f"wrote {stem.with_suffix('.json')}")


def plot(rows: list[dict], name: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in (("dense_tok_s", "float32 (dequantized)"), ("int4_tok_s", "int4 kept (compiled op)")):
        ax.plot([r["batch"] for r in rows], [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("sequences decoding")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{name}: decode, 4-bit weights kept vs dequantized")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
