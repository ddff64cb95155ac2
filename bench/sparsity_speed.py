"""2:4-sparse decode vs dense, and sparse + int8 beside int8 alone, on one model in one process (issue #41).

Four engines: "dense" loads the pruned model unpacked to a dense float32 folder (`prune.densify_folder`: the
same weights as "sparse", so their greedy tokens must agree, and the dense step's time does not depend on the
values); "sparse" loads the 2:4 checkpoint with float32 kept values (`prune.cached_sparse_checkpoint`, magnitude
pruning unless `--method`); "int8" is the dense folder quantized to per-channel int8 at load; "sparse-int8" the
2:4 checkpoint with int8 kept values. Every engine's decode runs the one-call compiled decode step (the sparse
projections inside it: `engine/cpu_ops/decoder.cpp`, `sparse24.h`). Per round and batch size the four engines
decode the same prompts (`--context-len` tokens) for `--steps` steps with their steps interleaved one by one
(order rotated per round), so a busy neighbour on a shared machine slows them alike; per engine the median step
and the fastest decile's edge ("p10": stalls only ever slow a step down); a ratio is dense / sparse (int8 /
sparse-int8) per round, then the median over rounds.

MBU at bs=1 = bytes read per step (weights as stored: kept values + metadata + scales for the sparse ones, the
tied embedding read whole as the LM head, + the KV cache) / step time (p10) / the streaming read bandwidth
measured in the same run with the same threads (`common.read_bandwidth`, 1 GiB, before and after; the higher).

    python bench/sparsity_speed.py --model ~/.cache/tidepool/models/SmolLM2-135M-Instruct.Q4_1-f32 \\
        [--batches 1,16] [--rounds 3] [--steps 32] [--method magnitude] [--num-threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common import add_decode_arguments, decode_bytes_per_step, decode_prompts, read_bandwidth
from tidepool.engine import LLM, SamplingParams
from tidepool.engine.sparsity.prune import cache_root, cached_sparse_checkpoint, densify_folder

RESULTS = Path(__file__).resolve().parent / "results" / "sparsity_speed"
PAIRS = (("dense", "sparse"), ("int8", "sparse-int8"))  # (baseline, sparse variant)


def checkpoints(model: Path, method: str) -> dict[str, tuple[Path, dict]]:
    """Variant -> (folder, LLM keywords), building the pruned copies once (cached)."""
    sparse = cached_sparse_checkpoint(model, method, "float32")
    sparse_int8 = cached_sparse_checkpoint(model, method, "int8")
    dense = cache_root() / f"{sparse.parent.name}-{sparse.name}-densified"
    if not (dense / "config.json").is_file():
        densify_folder(sparse, dense)
    return {
        "dense": (dense, {}),
        "sparse": (sparse, {}),
        "int8": (dense, {"quantization": "int8"}),
        "sparse-int8": (sparse_int8, {}),
    }


def mbu(llm: LLM, context_len: int, step_s: float, bandwidth: float) -> dict[str, float]:
    model = llm.engine.model
    bytes_per_step = decode_bytes_per_step(model, model.config, context_len)
    return {"bytes_per_step": bytes_per_step, "step_s": step_s, "mbu": bytes_per_step / step_s / bandwidth}


def start(llm: LLM, prompts: list[list[int]], steps: int) -> None:
    """Add the prompts and run their prefill, so that every later step of `llm` is a decode of all of them."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.step()


def paired_steps(engines: dict[str, LLM], batch: int, args: argparse.Namespace, first: int) -> tuple[dict, dict]:
    """One round at one batch size: every engine decodes the same prompts, their steps interleaved one by one
    (engine order rotated by `first`), so a neighbour's burst on this shared machine hits them alike. Returns
    each engine's step times and greedy tokens."""
    names = list(engines)
    names = names[first % len(names) :] + names[: first % len(names)]
    for name in names:
        start(engines[name], decode_prompts(batch, args.context_len), args.steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, dict[str, list[int]]] = {n: {} for n in names}
    while any(engines[n].engine.has_unfinished_requests() for n in names):
        for name in names:
            engine = engines[name].engine
            if not engine.has_unfinished_requests():
                continue
            begin = time.perf_counter()
            outputs = engine.step()
            times[name].append(time.perf_counter() - begin)
            tokens[name].update((o.request_id, list(o.outputs[0].token_ids)) for o in outputs if o.finished)
    ordered = {n: [tokens[n][f"decode-{i}"] for i in range(batch)] for n in names}
    return times, ordered


def measure(engines: dict[str, LLM], batches: list[int], args: argparse.Namespace) -> tuple[dict, dict]:
    """Per engine and batch size, the step times of every round (median and fastest decile per round)."""
    names = list(engines)
    times: dict[str, dict[int, list[list[float]]]] = {n: {b: [] for b in batches} for n in names}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for r in range(args.rounds):
        for b in batches:
            round_times, round_tokens = paired_steps(engines, b, args, r)
            for name in names:
                times[name][b].append(round_times[name])
                tokens.setdefault((name, b), round_tokens[name])
        print(f"round {r}: " + "  ".join(
            f"bs={b} " + "/".join(f"{1e3 * statistics.median(times[n][b][-1]):.1f}" for n in names) + " ms"
            for b in batches
        ) + f"  (median step; {'/'.join(names)})")  # fmt: skip
    return times, tokens


def decile(values: list[float]) -> float:
    """The fastest tenth's upper edge: a step time robust to a busy machine's stalls (which only slow steps)."""
    return sorted(values)[len(values) // 10]


def summarise(times: dict, tokens: dict, batches: list[int]) -> list[dict]:
    rows = []
    for b in batches:
        row: dict = {"batch": b}
        for name in times:
            row[f"{name}_step_s"] = statistics.median(statistics.median(t) for t in times[name][b])
            row[f"{name}_step_s_p10"] = statistics.median(decile(t) for t in times[name][b])
        for base, variant in PAIRS:
            for stat, fn in (("median", statistics.median), ("p10", decile)):
                ratios = [fn(d) / fn(s) for d, s in zip(times[base][b], times[variant][b], strict=True)]
                row[f"{variant}_speedup_{stat}"] = statistics.median(ratios)
                row[f"{variant}_speedup_{stat}_per_round"] = ratios
            same = sum(x == y for x, y in zip(tokens[(base, b)], tokens[(variant, b)], strict=True))
            row[f"{variant}_prompts_with_{base}_greedy_tokens"] = f"{same}/{b}"
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="magnitude", help="pruning method of the checkpoints (prune.py)")
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads per engine (default: the engine's)")
    args = add_decode_arguments(parser, "1,16", steps=16, rounds=3, out=RESULTS).parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(
        show_progress=False, max_num_seqs=max(batches), enable_prefix_caching=False, num_threads=args.num_threads
    )
    folders = checkpoints(Path(args.model).expanduser(), args.method)
    engines = {name: LLM(str(path), **kwargs, **common) for name, (path, kwargs) in folders.items()}
    bandwidth = [read_bandwidth()]
    times, tokens = measure(engines, batches, args)
    bandwidth.append(read_bandwidth())
    read_bw = max(bandwidth)
    rows = summarise(times, tokens, batches)
    bs1 = {n: mbu(llm, args.context_len, rows[batches.index(1)][f"{n}_step_s_p10"], read_bw)
           for n, llm in engines.items()} if 1 in batches else {}  # fmt: skip
    result = {
        "model": str(args.model), "method": args.method, "threads": torch.get_num_threads(),
        "context_len": args.context_len, "steps": args.steps, "rounds": args.rounds,
        "read_bandwidth_GBps": [bw / 1e9 for bw in bandwidth], "rows": rows, "bs1_bytes_and_mbu": bs1,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    threads = "" if args.num_threads is None else f"_t{args.num_threads}"
    path = args.out / f"sparsity_speed_{Path(args.model).name}{threads}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"read bandwidth {read_bw / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
    for name, m in bs1.items():
        print(f"bs=1 {name:11s}: {m['bytes_per_step'] / 2**20:6.1f} MiB per step, {1e3 * m['step_s']:6.2f} ms, "
              f"MBU {100 * m['mbu']:.1f}%")  # fmt: skip
    for row in rows:
        print(f"bs={row['batch']:3d}: " + "; ".join(
            f"{v} {row[f'{v}_speedup_median']:.2f}x (p10 {row[f'{v}_speedup_p10']:.2f}x) {b} "
            f"({1e3 * row[f'{b}_step_s']:.2f} -> {1e3 * row[f'{v}_step_s']:.2f} ms; {b}'s greedy tokens "
            f"{row[f'{v}_prompts_with_{b}_greedy_tokens']})" for b, v in PAIRS
        ))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
