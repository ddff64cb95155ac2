"""CPU attention: the compiled op against the torch path, per layer and inside a batch-64 decode step.

Part 1, per layer: one layer's `attention_backend.paged_attention` call (store_kv included) on steps
built the way the model runner builds them (shuffled block ids; decodes first, then prefill chunks),
timed with the kernel views (compiled op) and without them (torch path: gather + SDPA), rounds
interleaved, best round kept. Decode batches of 1/16/64/72 at contexts 128/620/2000 and mixed
lengths; prefill chunks with and without a cached prefix; a mixed step.

Part 2, engine: a batch of `--batch` requests (default 64) with `--context`-token prompts
(default 620) is prefilled once, then decode steps alternate between the two paths (switched
in-process: TIDEPOOL_CPU_ATTENTION, `cpu_ops.reset()` and the runner's attention backend chosen
again), a few steps at a time. Reported per path: the median model step (`ModelRunner.execute`, sampling
included) and the attention inside it (every layer's `paged_attention` call), i.e. the attention
share of the step before (torch path) and after (op).

    flock /tmp/tp/bench.lock python bench/cpu_attention.py                 # smollm-135m preset (random weights)
    flock /tmp/tp/bench.lock python bench/cpu_attention.py --model DIR     # part 2 on a real HF folder
    python bench/cpu_attention.py --quick                                  # a smoke run (tiny shapes)

Writes bench/results/cpu_attention.json (not with --quick). Ratios only mean something within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model
from tidepool.engine import cpu_ops
from tidepool.engine.layers import attention_backend as backend
from tidepool.engine.layers.attention_metadata import AttentionMetadata, PrefillChunk
from tidepool.engine.runner_backend import choose_backend

RESULTS = Path(__file__).resolve().parent / "results"


def make_step(
    seqs: list[tuple[int, int]], heads: tuple[int, int, int], block_size: int, seed: int
) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata, AttentionMetadata]:
    """(q, k, v, k_cache, v_cache), torch-path metadata, kernel-view metadata for (context_len, new tokens) seqs."""
    num_heads, num_kv_heads, head_dim = heads
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-ctx // block_size) for ctx, _ in seqs]
    ids = list(range(sum(needed) + 1))
    rng.shuffle(ids)
    tables = [ids[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(seqs))]
    shape = (len(ids), block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    slots: list[int] = []
    decodes = [(t, c) for t, (c, n) in zip(tables, seqs, strict=True) if n == 1]
    prefills = [(t, c, n) for t, (c, n) in zip(tables, seqs, strict=True) if n > 1]
    chunks: list[PrefillChunk] = []
    for table, ctx in decodes:
        slots.append(table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size)
    for table, ctx, num_new in prefills:
        start = len(slots)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - num_new, ctx)]
        mask = backend.build_prefill_mask(ctx - num_new, num_new, ctx, None, torch.device("cpu"))
        chunks.append(PrefillChunk(start, num_new, ctx, torch.tensor(table), mask))
    width = max((len(t) for t, _ in decodes), default=0)
    padded = torch.tensor([t + [0] * (width - len(t)) for t, _ in decodes], dtype=torch.long).view(len(decodes), width)
    lens = [c for _, c in decodes]
    scratch = (torch.empty(len(decodes) * width, *shape[1:]), torch.empty(len(decodes) * width, *shape[1:]))
    common = {"slot_mapping": torch.tensor(slots), "num_decode_seqs": len(decodes), "decode_block_tables": padded}
    mask = backend.build_decode_mask(lens, width * block_size, None, torch.device("cpu")) if decodes else None
    torch_meta = AttentionMetadata(**common, decode_mask=mask, decode_kv_scratch=scratch, prefills=chunks)
    op_meta = AttentionMetadata(**common, decode_mask=None, prefills=chunks)
    order = decodes + [(t, c) for t, c, _ in prefills]
    backend.attach_kernel_views(
        op_meta, [t for t, _ in order], [c for _, c in order], [1] * len(decodes) + [n for *_, n in prefills], None
    )
    num_tokens = len(slots)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    return (q, k, v, k_cache, v_cache), torch_meta, op_meta


def best_of_rounds(fns: dict[str, Callable[[], object]], rounds: int, min_s: float) -> dict[str, float]:
    """Seconds per call of each fn: rounds interleaved (fn A, fn B, A, B, ...), the best round's mean."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # warm-up: first-touch page faults, thread pool start
    for _ in range(rounds):
        for name, fn in fns.items():
            calls, start = 0, time.perf_counter()
            while calls < 2 or time.perf_counter() - start < min_s:
                fn()
                calls += 1
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def layer_cases(quick: bool) -> list[tuple[str, list[tuple[int, int]]]]:
    rng = random.Random(0)
    if quick:
        return [("decode bs=4 ctx=64", [(64, 1)] * 4), ("prefill 32 after 32", [(64, 32)])]
    cases = [(f"decode bs={bs} ctx={ctx}", [(ctx, 1)] * bs) for bs in (1, 16, 64, 72) for ctx in (128, 620, 2000)]
    for bs in (16, 64, 72):
        cases.append((f"decode bs={bs} mixed 128-2000", [(rng.randint(128, 2000), 1) for _ in range(bs)]))
    cases += [
        ("prefill 512 (no prefix)", [(512, 512)]),
        ("prefill 512 after 1536 cached", [(2048, 512)]),
        ("prefill 4x256 after 0-768 cached", [(256 + 256 * i, 256) for i in range(4)]),
        ("mixed: 32 decodes ctx 620 + 256 after 512", [(620, 1)] * 32 + [(768, 256)]),
    ]
    return cases


def run_layers(args: argparse.Namespace) -> list[dict[str, object]]:
    heads = (args.heads, args.kv_heads, args.head_dim)
    rows = []
    scale = args.head_dim**-0.5
    print(f"\nPart 1: one layer's attention, heads {heads[0]}/{heads[1]} x {heads[2]}, block {args.block_size}")
    print(f"{'case':<44}{'torch ms':>10}{'op ms':>9}{'ratio':>8}")
    for name, seqs in layer_cases(args.quick):
        tensors, torch_meta, op_meta = make_step(seqs, heads, args.block_size, seed=len(rows))
        fns = {
            "torch": lambda t=tensors, m=torch_meta, s=scale: backend.paged_attention(*t, m, s),
            "op": lambda t=tensors, m=op_meta, s=scale: backend.paged_attention(*t, m, s),
        }
        want, got = fns["torch"](), fns["op"]()
        if not torch.allclose(want, got, atol=1e-4, rtol=1e-4):
            raise RuntimeError(f"{name}: the op and the torch path disagree by {(want - got).abs().max():.3g}")
        best = best_of_rounds(fns, args.rounds, args.min_seconds)
        ratio = best["torch"] / best["op"]
        print(f"{name:<44}{best['torch'] * 1e3:>10.2f}{best['op'] * 1e3:>9.2f}{ratio:>7.2f}x")
        rows.append({"case": name, "torch_s": best["torch"], "op_s": best["op"], "ratio": ratio})
    return rows


def _use_path(runner: object, mode: str) -> None:
    os.environ[cpu_ops.MODE_ENV] = mode
    cpu_ops.reset()
    runner.backend = choose_backend(runner.device, runner.config, runner.block_size)  # type: ignore[attr-defined]
    if runner.backend.name != f"cpu-{mode}":  # type: ignore[attr-defined]
        raise RuntimeError(f"could not switch the runner to {mode}")


def run_engine(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    from tidepool.engine import LLM, SamplingParams
    from tidepool.engine.models import llama

    batch, context = args.batch, args.context
    max_len = context + args.steps * 2 + 8
    llm = LLM(
        str(model_dir),
        show_progress=False,
        max_model_len=max_len,
        max_num_seqs=batch,
        max_num_batched_tokens=4096,
        num_kv_blocks=batch * -(-max_len // 16) + 8,
        enable_prefix_caching=False,
    )
    engine, runner = llm.engine, llm.engine.runner
    attention_s = [0.0]
    inner = llama.paged_attention

    def timed_attention(*a: object, **kw: object) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            attention_s[0] += time.perf_counter() - start

    llama.paged_attention = timed_attention
    samples: dict[str, list[tuple[float, float]]] = {"torch": [], "compiled": []}
    execute = runner.execute

    def timed_execute(sched_out: object) -> object:
        attention_s[0] = 0.0
        start = time.perf_counter()
        result = execute(sched_out)
        elapsed = time.perf_counter() - start
        scheduled = sched_out.scheduled  # type: ignore[attr-defined]
        if len(scheduled) == batch and all(s.num_new_tokens == 1 for s in scheduled):
            samples[runner.backend.name.removeprefix("cpu-")].append((elapsed, attention_s[0]))
        return result

    runner.execute = timed_execute
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 2 + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(context)], params)
    _use_path(runner, "compiled")  # the faster path for the prefill; measured steps come after
    print(f"\nPart 2: engine, batch {batch}, prompts of {context} tokens, model {model_dir}")
    while not samples["compiled"]:
        engine.step()
    samples["compiled"].clear()
    per_turn = max(1, args.steps // 4)
    while engine.has_unfinished_requests() and min(len(s) for s in samples.values()) < args.steps:
        for mode in ("torch", "compiled"):
            _use_path(runner, mode)
            for _ in range(per_turn):
                engine.step()
    runner.execute, llama.paged_attention = execute, inner
    out: dict[str, object] = {"batch": batch, "context": context, "model": str(model_dir)}
    print(f"{'path':<10}{'step ms':>10}{'attention ms':>14}{'share':>8}")
    for mode, rows in samples.items():
        step = statistics.median(r[0] for r in rows)
        attn = statistics.median(r[1] for r in rows)
        out[mode] = {"step_s": step, "attention_s": attn, "share": attn / step, "steps": len(rows)}
        print(f"{mode:<10}{step * 1e3:>10.1f}{attn * 1e3:>14.1f}{attn / step:>7.0%}")
    ratio = out["torch"]["step_s"] / out["compiled"]["step_s"]  # type: ignore[index]
    attn_ratio = out["torch"]["attention_s"] / out["compiled"]["attention_s"]  # type: ignore[index]
    print(f"decode step {ratio:.2f}x faster with the op; attention {attn_ratio:.2f}x")
    out["step_ratio"], out["attention_ratio"] = ratio, attn_ratio
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="HF model folder for part 2 (default: smollm-135m preset)")
    parser.add_argument("--heads", type=int, default=9, help="query heads (part 1; default SmolLM2-135M's)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="part 2 batch")
    parser.add_argument("--context", type=int, default=620, help="part 2 prompt length")
    parser.add_argument("--steps", type=int, default=12, help="part 2 decode steps measured per path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.2, help="per round and case")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny shapes and model")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.context, args.steps, args.rounds, args.min_seconds = 4, 40, 4, 1, 0.01
    os.environ[cpu_ops.MODE_ENV] = "compiled"
    cpu_ops.reset()
    if cpu_ops.paged_attention_op() is None:
        raise SystemExit("the compiled op is unavailable")
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    result: dict[str, object] = {"threads": torch.get_num_threads(), "layers": run_layers(args)}
    if not args.skip_engine:
        model_dir = args.model or bench_model("llama", "tiny" if args.quick else "smollm-135m")
        result["engine"] = run_engine(args, model_dir)
    if not args.quick:  # a smoke run's figures are not results
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "cpu_attention.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {RESULTS / 'cpu_attention.json'}")


if __name__ == "__main__":
    main()
