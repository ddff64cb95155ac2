"""Offline throughput: Tidepool vs transformers on the same model and seeded workloads, in one run.

Workloads (`--workloads`, all by default):
- variable: 200 requests, prompts 32-512 random tokens, outputs 16-256 tokens, ignore_eos. Tidepool
  gets every request at once (continuous batching decides); transformers runs static batches of
  `--hf-batch-size` in arrival order, left-padded, each until its longest request is done (only the
  tokens each request asked for count).
- uniform: 64 requests of exactly 128 prompt + 128 new tokens; transformers gets them as one batch,
  so padding gives it nothing to waste. Also the attention share of a batch-64 Tidepool decode step.
- bs1: one sequence decoding at `--context-len` tokens of context: median step time and MBU for both,
  MBU = (weight + KV bytes per step) / step time / read bandwidth, the bandwidth a streaming read of
  1 GiB measured in this run with the same thread count (bench/common.py), before and after the
  steps (the higher of the two: this VM's bandwidth drifts by tens of %). Tidepool's step is taken
  twice, alternating: with the one-call decode step (`cpu_ops.decoder_op()`) and layer by layer
  (TIDEPOOL_CPU_DECODER=torch); the best of each is kept.
- neighbour: Tidepool bs=1 decode quiet and beside one CPU burner process, with the thread count the
  engine picks for a CPU limit of one CPU fewer (bench/neighbour.py).

`--model` is a Hugging Face folder or a GGUF file (converted once with transformers into a float32
folder cached under $TIDEPOOL_CACHE/models, until Tidepool loads GGUF itself); without it the seeded
random `--preset` model. Prints tables, writes JSON and a PNG under bench/results/.

    python bench/offline_throughput.py --model /work/wt/models/SmolLM2-135M-Instruct.Q4_1.gguf
    python bench/offline_throughput.py --quick         # a smoke run on the tiny preset
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import WorkItem, bench_model, cache_dir, decode_bytes_per_step, random_workload, read_bandwidths

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("variable", "uniform", "bs1", "neighbour")


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    if args.model is None:
        return bench_model(args.arch, args.preset, args.seed), f"{args.arch} {args.preset} (random weights)"
    path = Path(args.model)
    if path.is_dir():
        return path, path.name
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(f"--model {path}: expected a Hugging Face folder or a .gguf file")
    folder = cache_dir() / "models" / f"{path.stem}-f32"
    if not (folder / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"converting {path.name} to a float32 Hugging Face folder in {folder} (once)")
        gguf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        config = gguf.config
        config.__dict__.pop("quantization_config", None)  # dequantized: save as a plain float32 model
        dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        dense.load_state_dict(gguf.state_dict())
        dense.generation_config = gguf.generation_config
        partial = folder.with_name(folder.name + ".partial")
        dense.save_pretrained(partial)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(partial)
        partial.rename(folder)
    return folder, f"{path.name} (dequantized to float32)"


# ---- Tidepool ---------------------------------------------------------------------------------
def tidepool_generate(llm, work: list[WorkItem]) -> dict[str, float]:
    from tidepool.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=w.num_output_tokens, ignore_eos=True) for w in work]
    start = time.perf_counter()
    outputs = llm.generate([w.prompt_token_ids for w in work], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_out != sum(w.num_output_tokens for w in work):
        raise RuntimeError("Tidepool produced a different number of tokens than requested")
    return {"seconds": elapsed, "output_tokens": num_out, "tokens_per_s": num_out / elapsed}


@contextmanager
def decoder_mode(mode: str) -> Iterator[None]:
    """Run with TIDEPOOL_CPU_DECODER=`mode` (auto: the one-call decode step where it applies; torch: layer by layer)."""
    from tidepool.engine import cpu_ops

    before = os.environ.get(cpu_ops.DECODER_MODE_ENV)
    os.environ[cpu_ops.DECODER_MODE_ENV] = mode
    cpu_ops.reset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(cpu_ops.DECODER_MODE_ENV)
        else:
            os.environ[cpu_ops.DECODER_MODE_ENV] = before
        cpu_ops.reset()


def tidepool_decode_steps(llm, prompts: list[list[int]], steps: int, attention: bool = False) -> dict[str, Any]:
    """Median decode step time with all `prompts` running (prefill excluded), the greedy tokens each prompt got
    ("tokens", in prompt order); optionally attention's share."""
    from tidepool.engine import SamplingParams
    from tidepool.engine.models import llama

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()  # prefill (chunked) until every sequence decodes
    engine.step()
    attn_s = [0.0]
    original = llama.paged_attention
    if attention:

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            attn_s[0] += time.perf_counter() - start
            return out

        llama.paged_attention = timed
    times, shares, tokens = [], [], {}
    try:
        while engine.has_unfinished_requests():
            attn_s[0] = 0.0
            start = time.perf_counter()
            outputs = engine.step()
            times.append(time.perf_counter() - start)
            tokens.update((out.request_id, out.outputs[0].token_ids) for out in outputs if out.finished)
            shares.append(attn_s[0] / times[-1])
    finally:
        llama.paged_attention = original
    order = sorted(range(len(times)), key=times.__getitem__)
    mid = order[len(order) // 2]
    result = {"step_s": times[mid], "tokens": [tokens[f"decode-{i}"] for i in range(len(prompts))]}
    if attention:
        if not any(shares):
            raise RuntimeError("attention was never called from Python: the one-call decode step ran (time it with "
                               "TIDEPOOL_CPU_DECODER=torch, `decoder_mode`)")  # fmt: skip
        result["attention_share"] = sorted(shares)[len(shares) // 2]
    return result


# ---- transformers -------------------------------------------------------------------------------
def hf_generate(model, work: list[WorkItem], batch_size: int) -> dict[str, float]:
    pad = 0
    start = time.perf_counter()
    num_useful = 0
    batches = [work[i : i + batch_size] for i in range(0, len(work), batch_size)]
    with torch.inference_mode():
        for batch in tqdm(batches, desc="transformers batches"):
            width = max(len(w.prompt_token_ids) for w in batch)
            ids = torch.tensor([[pad] * (width - len(w.prompt_token_ids)) + w.prompt_token_ids for w in batch])
            mask = torch.tensor(
                [[0] * (width - len(w.prompt_token_ids)) + [1] * len(w.prompt_token_ids) for w in batch]
            )
            longest = max(w.num_output_tokens for w in batch)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
            if out.shape[1] - width != longest:
                raise RuntimeError("transformers stopped early")
            num_useful += sum(w.num_output_tokens for w in batch)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": num_useful, "tokens_per_s": num_useful / elapsed}


def hf_decode_step(model, context_len: int, steps: int) -> float:
    with torch.inference_mode():
        out = model(torch.arange(3, 3 + context_len).unsqueeze(0), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return times[len(times) // 2]


# ---- report -------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, v) for k, v in result["workloads"].items() if k in ("variable", "uniform", "bs1")]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.0, 3.6 * len(panels)), 3.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], panels, strict=True):
        if name == "bs1":
            bars = [
                (label, key, color)
                for label, key, color in (
                    ("transformers", "transformers", "#999"),
                    ("Tidepool\nlayer by layer", "tidepool_layer_by_layer", "#8c8"),
                    ("Tidepool", "tidepool", "#2a7"),
                )
                if key in r
            ]
            ax.bar([b[0] for b in bars], [100 * r[b[1]]["mbu"] for b in bars], color=[b[2] for b in bars])
            ax.set_title(f"bs=1 decode MBU % (read {r['read_bandwidth_GBps']:.0f} GB/s)")
            ax.set_ylim(0, 100)
        else:
            ax.bar(
                ["transformers", "Tidepool"],
                [r["transformers"]["tokens_per_s"], r["tidepool"]["tokens_per_s"]],
                color=["#999", "#2a7"],
            )
            ax.set_title(f"{name}: output tok/s ({r['ratio']:.2f}x)")
    fig.suptitle(f"{result['model']}, {result['machine']['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_tables(result: dict) -> None:
    w = result["workloads"]
    for name in ("variable", "uniform"):
        if name in w:
            r = w[name]
            hf, tp = r["transformers"], r["tidepool"]
            print(f"\n{name}: transformers {hf['tokens_per_s']:.1f} tok/s ({hf['seconds']:.0f} s), ")
            print(f"  Tidepool {tp['tokens_per_s']:.1f} tok/s ({tp['seconds']:.0f} s): {r['ratio']:.2f}x transformers")
    if "uniform" in w and "attention_share_b64" in w["uniform"]:
        print(f"attention share of a batch-64 Tidepool decode step: {100 * w['uniform']['attention_share_b64']:.1f}%")
    if "bs1" in w:
        r = w["bs1"]
        print(
            f"\nbs=1 decode at {r['context_len']} tokens, read bandwidth {r['read_bandwidth_GBps']:.1f} GB/s "
            f"({result['machine']['threads']} threads):"
        )
        for reading in r["read_bandwidth_readings_GBps"]:
            print("  read GB/s: " + ", ".join(f"{how} {gbps:.1f}" for how, gbps in reading.items()))
        for engine in ("transformers", "tidepool", "tidepool_layer_by_layer"):
            if engine not in r:
                continue
            e = r[engine]
            mb, mbu = e["bytes"] / 1e6, 100 * e["mbu"]
            print(f"  {engine:24s} step {1e3 * e['step_s']:7.2f} ms  {mb:7.1f} MB/step  MBU {mbu:5.1f}%")
    if "neighbour" in w:
        n = w["neighbour"]
        print("\nbs=1 decode beside a CPU burner (fresh process each):")
        for label, ratio in n["slowdown_vs_quiet"].items():
            run = next(r for r in n["runs"] if r["label"] == label)
            print(
                f"  {label:30s} {1e3 * n['best_step_s'][label]:7.2f} ms/step  {ratio:5.2f}x quiet  "
                f"({run['threads_used']} threads: {run['thread_reason']})"
            )
        print(f"  burner vs quiet at the same CPU limit: {n['burner_vs_quiet_same_limit']:.2f}x")
        cells = ", ".join(f"{label} {gbps:.1f}" for label, gbps in n["read_bandwidth_GBps"].items())
        print(f"  read bandwidth (GB/s, with each run's threads): {cells}")
        ratio = n["read_bandwidth_quiet_vs_limit"]
        print(f"  quiet reads {ratio:.2f}x faster than quiet at the limit: a bandwidth-bound step slows at least that")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: --preset)")
    parser.add_argument("--preset", default="smollm-135m")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--uniform", type=int, nargs=3, default=(64, 128, 128), help="requests, prompt, new tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--context-len", type=int, default=128, help="context of the bs=1 decode timing")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's choice)")
    parser.add_argument("--quick", action="store_true", help="tiny preset and small workloads: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := set(workloads) - set(WORKLOADS):
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    if args.quick:
        args.preset, args.num_requests, args.input_len, args.output_len = "tiny", 8, (8, 64), (4, 16)
        args.uniform, args.decode_steps = (8, 16, 8), 4

    from transformers import AutoModelForCausalLM

    from tidepool.engine import LLM
    from tidepool.engine.loading.formats import read_model_config

    model_dir, model_name = resolve_model(args)
    vocab = read_model_config(model_dir).vocab_size
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        show_progress=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
    )
    threads = torch.get_num_threads()  # the engine's decision; transformers runs with the same
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    result: dict = {
        "model": model_name,
        "dtype": args.dtype,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": threads,
            "thread_reason": llm.engine.threads.reason,
        },
        "workloads": {},
    }
    out = result["workloads"]
    from tidepool.engine import SamplingParams

    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    if "variable" in workloads:
        work = random_workload(args.num_requests, args.seed, vocab, tuple(args.input_len), tuple(args.output_len))
        tp, tr = tidepool_generate(llm, work), hf_generate(hf, work, args.hf_batch_size)
        out["variable"] = {
            **{"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len},
            **{"hf_batch_size": args.hf_batch_size, "tidepool": tp, "transformers": tr},
            "ratio": tp["tokens_per_s"] / tr["tokens_per_s"],
        }
    if "uniform" in workloads:
        n, prompt_len, new = args.uniform
        work = random_workload(n, args.seed + 1, vocab, (prompt_len, prompt_len), (new, new))
        tp, tr = tidepool_generate(llm, work), hf_generate(hf, work, n)
        with decoder_mode("torch"):  # attention is timed around the layers' calls: the one-call step makes none
            step = tidepool_decode_steps(llm, [w.prompt_token_ids for w in work], 8, attention=True)
        out["uniform"] = {
            **{"num_requests": n, "prompt_len": prompt_len, "new_tokens": new, "tidepool": tp, "transformers": tr},
            "ratio": tp["tokens_per_s"] / tr["tokens_per_s"],
            **{"tidepool_b64_step_s": step["step_s"], "attention_share_b64": step["attention_share"]},
        }
    if "bs1" in workloads:
        read_bytes = (64 << 20) if args.quick else (1 << 30)
        readings = [read_bandwidths(read_bytes)]
        prompt = [list(range(3, 3 + args.context_len))]
        steps = {"tidepool": [], "tidepool_layer_by_layer": []}
        for _ in range(2):
            for name, mode in (("tidepool", "auto"), ("tidepool_layer_by_layer", "torch")):
                with decoder_mode(mode):
                    steps[name].append(tidepool_decode_steps(llm, prompt, args.decode_steps)["step_s"])
        hf_step = hf_decode_step(hf, args.context_len, args.decode_steps)
        readings.append(read_bandwidths(read_bytes))
        # The highest reading of any read, either time (this VM's bandwidth drifts): the lower, safer MBU.
        bandwidth = max(max(r.values()) for r in readings)
        entry = {
            "context_len": args.context_len,
            "read_bandwidth_GBps": bandwidth / 1e9,
            "read_bandwidth_readings_GBps": [{k: v / 1e9 for k, v in r.items()} for r in readings],
        }
        tp_model, tp_config = llm.engine.model, llm.engine.model_config
        for name, model, config, step_s in (
            ("tidepool", tp_model, tp_config, min(steps["tidepool"])),
            ("tidepool_layer_by_layer", tp_model, tp_config, min(steps["tidepool_layer_by_layer"])),
            ("transformers", hf, hf.config, hf_step),
        ):
            nbytes = decode_bytes_per_step(model, config, args.context_len)
            entry[name] = {"step_s": step_s, "bytes": nbytes, "mbu": nbytes / step_s / bandwidth}
        out["bs1"] = entry
    if "neighbour" in workloads:
        from neighbour import measure

        del llm, hf  # the child processes load their own
        out["neighbour"] = measure(str(model_dir), args.context_len, args.decode_steps, rounds=1 if args.quick else 2)
    print_tables(result)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "offline_throughput_" + (Path(args.model).stem if args.model else f"{args.arch}_{args.preset}")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    if any(k in out for k in ("variable", "uniform", "bs1")):
        plot(result, args.out / f"{stem}.png")
    print(f"\nwrote {args.out / stem}.json" + (" and .png" if out else ""))


if __name__ == "__main__":
    main()
