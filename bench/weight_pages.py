"""Decode steps with the weights and KV cache in huge pages vs ordinary 4 KiB pages, in one process.

The engine puts its CPU weights and KV cache in memory advised for transparent huge pages
(`tidepool.engine.hugepages`). This bench keeps a second copy of every weight and cache tensor in
ordinary memory and swaps the model between the two (``tensor.data``) round by round, so both
sides see the same machine state; the one-call decode step notices the moved pointers and
re-prepares. Prefix caching is off: a cached block would hold KV written into the other copy.
Each round is the median step time of `--steps` decode steps per batch size; the ratio is per
round (4k / huge), then the median over rounds. Greedy tokens must match on both sides. The read
bandwidth (both page kinds) is printed alongside, measured in the same run.

    python bench/weight_pages.py --model <SmolLM2 GGUF or folder> [--batches 1,16] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from offline_throughput import resolve_model, tidepool_decode_steps

from common import add_decode_arguments, decode_prompts, read_bandwidths

RESULTS = Path(__file__).resolve().parent / "results" / "hugepages"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_decode_arguments(parser, "1,16", steps=32, rounds=6, out=RESULTS).parse_args()

    from tidepool.engine import LLM, hugepages

    if hugepages.unavailable_reason() is not None:
        raise SystemExit(f"huge pages are off here ({hugepages.unavailable_reason()}): nothing to compare")
    folder, name = resolve_model(argparse.Namespace(model=args.model))
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(folder), dtype="float32", show_progress=False, max_num_seqs=max(batches), enable_prefix_caching=False)
    engine = llm.engine
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    caches = engine.runner.kv_caches
    huge = {"weights": [t.data for t in tensors], "caches": list(caches)}
    plain = {"weights": [t.data.clone() for t in tensors], "caches": [(k.clone(), v.clone()) for k, v in caches]}
    pages = {
        "huge_MiB": hugepages.huge_page_bytes(tensors[0]) / 2**20,
        "plain_copy_huge_MiB": max(hugepages.huge_page_bytes(t) for t in plain["weights"]) / 2**20,
    }

    def use(side: dict) -> None:
        for tensor, data in zip(tensors, side["weights"], strict=True):
            tensor.data = data
        caches[:] = side["caches"]

    times: dict[str, dict[int, list[float]]] = {"huge": {b: [] for b in batches}, "4k": {b: [] for b in batches}}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    bandwidth = [read_bandwidths()]
    for r in range(args.rounds):
        order = [("huge", huge), ("4k", plain)] if r % 2 == 0 else [("4k", plain), ("huge", huge)]
        for label, side in order:
            use(side)
            for b in batches:
                out = tidepool_decode_steps(llm, decode_prompts(b, args.context_len), args.steps)
                times[label][b].append(out["step_s"])
                tokens.setdefault((label, b), out["tokens"])
        print(f"round {r}: " + "  ".join(f"bs={b} {1e3 * times['4k'][b][-1]:.1f}/{1e3 * times['huge'][b][-1]:.1f} ms"
                                        for b in batches))  # fmt: skip
    use(huge)
    bandwidth.append(read_bandwidths())
    result = {
        "model": name, "threads": torch.get_num_threads(), "context_len": args.context_len, "pages": pages,
        "read_bandwidth_GBps": [{k: v / 1e9 for k, v in bw.items()} for bw in bandwidth], "batches": {},
    }  # fmt: skip
    for b in batches:
        ratios = [p / h for p, h in zip(times["4k"][b], times["huge"][b], strict=True)]
        same = tokens[("4k", b)] == tokens[("huge", b)]
        result["batches"][str(b)] = {
            "step_s_4k": times["4k"][b], "step_s_huge": times["huge"][b], "speedup_median": statistics.median(ratios),
            "speedup_per_round": ratios, "same_tokens": same,
        }  # fmt: skip
        print(f"bs={b}: huge pages {statistics.median(ratios):.2f}x faster (median of {len(ratios)} rounds; "
              f"per round {', '.join(f'{x:.2f}' for x in ratios)}); same tokens: {same}")  # fmt: skip
        if not same:
            raise SystemExit(f"bs={b}: greedy tokens differ between the two copies of the weights")
    print("read bandwidth GB/s: " + "; ".join(", ".join(f"{k} {v:.1f}" for k, v in bw.items())
                                             for bw in result["read_bandwidth_GBps"]))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"weight_pages_{Path(name).stem}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
