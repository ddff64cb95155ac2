"""Offline throughput: Tidepool vs transformers on the same model and seeded workload, in one run.

Workload (default): 200 requests, prompt 32–512 random tokens, output 16–256 tokens, ignore_eos.
Tidepool gets every request at once (continuous batching decides). transformers is run the way
its users batch: static batches of `--hf-batch-size` in arrival order, left-padded, each batch
generating until its longest request is done; only the tokens each request asked for count.
Also measured: bs=1 decode step time and MBU for both (see bench/common.py), and the copy
bandwidth they are judged against. Prints a table, writes JSON and a PNG under bench/results/.

    python bench/offline_throughput.py                 # the full run reported in README.md
    python bench/offline_throughput.py --quick         # a smoke run on the tiny preset
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import WorkItem, bench_model, copy_bandwidth, decode_bytes_per_step, random_workload

RESULTS = Path(__file__).resolve().parent / "results"


def run_tidepool(model_dir: Path, work: list[WorkItem], args: argparse.Namespace) -> dict[str, float]:
    from tidepool.engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        show_progress=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=w.num_output_tokens, ignore_eos=True) for w in work]
    llm.generate([work[0].prompt_token_ids], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([w.prompt_token_ids for w in work], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_out != sum(w.num_output_tokens for w in work):
        raise RuntimeError("Tidepool produced a different number of tokens than requested")
    step = tidepool_decode_step(llm, args.context_len, args.decode_steps)
    nbytes = decode_bytes_per_step(llm.engine.model, llm.engine.model_config, args.context_len)
    return {
        "seconds": elapsed,
        "output_tokens": num_out,
        "tokens_per_s": num_out / elapsed,
        "preemptions": llm.engine.scheduler.num_preemptions_total,
        "bs1_step_s": step,
        "bs1_bytes": nbytes,
    }


def tidepool_decode_step(llm, context_len: int, steps: int) -> float:
    from tidepool.engine import SamplingParams

    engine = llm.engine
    engine.add_request(
        "bs1", list(range(3, 3 + context_len)), SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    )
    engine.step()  # prefill
    engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def run_transformers(model_dir: Path, work: list[WorkItem], args: argparse.Namespace) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = 0
    start = time.perf_counter()
    num_useful = 0
    batches = [work[i : i + args.hf_batch_size] for i in range(0, len(work), args.hf_batch_size)]
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
    step = transformers_decode_step(model, args.context_len, args.decode_steps)
    nbytes = decode_bytes_per_step(model, model.config, args.context_len)
    return {
        "seconds": elapsed,
        "output_tokens": num_useful,
        "tokens_per_s": num_useful / elapsed,
        "bs1_step_s": step,
        "bs1_bytes": nbytes,
    }


def transformers_decode_step(model, context_len: int, steps: int) -> float:
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


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["transformers", "Tidepool"]
    ax1.bar(names, [result["transformers"]["tokens_per_s"], result["tidepool"]["tokens_per_s"]], color=["#999", "#2a7"])
    ax1.set_title(f"output tokens/s ({result['workload']['num_requests']} requests)")
    ax2.bar(
        names, [100 * result["transformers"]["bs1_mbu"], 100 * result["tidepool"]["bs1_mbu"]], color=["#999", "#2a7"]
    )
    ax2.set_title("bs=1 decode MBU (%)")
    ax2.set_ylim(0, 100)
    fig.suptitle(result["model"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm-135m")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--context-len", type=int, default=128, help="prompt length for the bs=1 decode timing")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="tiny preset, 8 requests: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.preset, args.num_requests, args.input_len, args.output_len = "tiny", 8, (8, 64), (4, 16)
        args.decode_steps = 4

    model_dir = bench_model(args.arch, args.preset, args.seed)
    from tidepool.engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    work = random_workload(args.num_requests, args.seed, vocab, tuple(args.input_len), tuple(args.output_len))
    bandwidth = copy_bandwidth((64 << 20) if args.quick else (1 << 30))
    tidepool = run_tidepool(model_dir, work, args)
    hf = run_transformers(model_dir, work, args)
    for r in (tidepool, hf):
        r["bs1_mbu"] = r["bs1_bytes"] / r["bs1_step_s"] / bandwidth
    result = {
        "model": f"{args.arch} {args.preset} ({args.dtype}, random weights)",
        "workload": {
            "num_requests": args.num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "hf_batch_size": args.hf_batch_size,
        },
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "tidepool": tidepool,
        "transformers": hf,
        "throughput_ratio": tidepool["tokens_per_s"] / hf["tokens_per_s"],
    }
    print()
    print(f"| {'':14} | {'output tok/s':>12} | {'wall s':>8} | {'bs=1 step ms':>12} | {'bs=1 MBU':>8} |")
    print(f"|{'-' * 16}|{'-' * 14}|{'-' * 10}|{'-' * 14}|{'-' * 10}|")
    for name, r in (("transformers", hf), ("Tidepool", tidepool)):
        print(
            f"| {name:14} | {r['tokens_per_s']:12.1f} | {r['seconds']:8.1f} | {1e3 * r['bs1_step_s']:12.2f} | "
            f"{100 * r['bs1_mbu']:7.1f}% |"
        )
    print(
        f"\nthroughput ratio Tidepool / transformers: {result['throughput_ratio']:.2f}x; "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; Tidepool preemptions: {tidepool['preemptions']}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"offline_throughput_{args.arch}_{args.preset}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
