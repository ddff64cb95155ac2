"""Where a Tidepool decode step spends its time: torch.profiler over a few steps at a given batch size.

Groups aten ops by what they do (matmul, attention, norm, rotary, elementwise, copies/indexing,
sampler) and counts calls per step, which is the per-op dispatch overhead that dominates small
batches. Step times use the process's CPU time (`time.process_time`) as well as wall time: on a
shared machine the CPU time of the step is far less noisy than its wall time.

    python bench/profile_decode.py --model DIR --batch 1 --threads 1
    python bench/profile_decode.py --model DIR --batch 64 --context-len 512
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv"),
    "attention": ("aten::_scaled_dot_product", "aten::index_select", "aten::index_copy_", "cpu_ops"),
    "norm": ("aten::mean", "aten::pow", "aten::rsqrt", "aten::_fused_rms_norm", "aten::rms_norm"),
    "rotary": ("aten::roll",),
    "embedding/indexing": ("aten::embedding", "aten::index", "aten::gather"),
    "sampler": ("aten::argmax", "aten::topk", "aten::softmax", "aten::log_softmax", "aten::sort"),
    "elementwise": ("aten::add", "aten::mul", "aten::silu", "aten::sub", "aten::where", "aten::div", "aten::neg"),
    "copies/alloc": ("aten::copy_", "aten::empty", "aten::cat", "aten::_to_copy", "aten::clone", "aten::zeros"),
}


def group_of(name: str) -> str:
    for group, prefixes in GROUPS.items():
        if any(name.startswith(p) for p in prefixes):
            return group
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from tidepool.engine import LLM, SamplingParams

    llm = LLM(args.model, show_progress=False, num_threads=args.threads, max_model_len=args.context_len + 64)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3 * args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [3 + (i + j) % 1000 for j in range(args.context_len)], params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(2):
        engine.step()
    wall, cpu = [], []
    for _ in range(args.steps):
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    groups: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    total = 0.0
    for event in prof.key_averages():
        groups[group_of(event.key)] += event.self_cpu_time_total
        calls[group_of(event.key)] += event.count
        total += event.self_cpu_time_total
    wall.sort()
    cpu.sort()
    result = {
        "model": args.model,
        "batch": args.batch,
        "context_len": args.context_len,
        "threads": torch.get_num_threads(),
        "step_wall_ms_median": 1e3 * wall[len(wall) // 2],
        "step_cpu_ms_median": 1e3 * cpu[len(cpu) // 2],
        "aten_calls_per_step": sum(calls.values()) / args.steps,
        "groups": {
            g: {
                "share": groups[g] / total,
                "ms_per_step": groups[g] / 1e3 / args.steps,
                "calls_per_step": calls[g] / args.steps,
            }
            for g in sorted(groups, key=groups.get, reverse=True)
        },
    }
    wall_ms, cpu_ms, num_calls = (
        result["step_wall_ms_median"],
        result["step_cpu_ms_median"],
        result["aten_calls_per_step"],
    )
    print(f"batch {args.batch}, context {args.context_len}, {result['threads']} threads: step {wall_ms:.2f} ms wall, ")
    print(f"  {cpu_ms:.2f} ms CPU; {num_calls:.0f} aten calls per step")
    for g, r in result["groups"].items():
        share, ms, n = 100 * r["share"], r["ms_per_step"], r["calls_per_step"]
        print(f"  {g:20s} {share:5.1f}%  {ms:7.2f} ms/step  {n:6.0f} calls/step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    out = args.out or RESULTS / f"profile_decode_b{args.batch}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
