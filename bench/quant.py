"""Weight-only quantization benchmark: int8 and int4 against the unquantized model, same run.

For each variant (dense, int8, int4 with `--group-size`), all through `LLM(model=...)`:
- weight memory: bytes of the loaded model's parameters and buffers, in total and for the decoder
  projections alone (the part quantization touches; embeddings/norms/lm_head stay dense), both in
  the checkpoint's dtype and loaded as float16 (the usual deployment: 16-bit scales and zeros),
- bs=1 decode speed: median engine step time of one greedy request at a fixed context length,
- held-out perplexity: the training script's held-out Python standard-library files (every 20th
  file of the sorted list), same windows for every variant.
Ratios are against the dense model measured in the same run. Prints a table and writes JSON to
bench/results/quant_<model>.json.

Usage (from /tmp, dev venv): python /path/to/bench/quant.py [--model DIR] [--group-size 128]
Default model: the trained demo target ($TIDEPOOL_CACHE/models/demo-target, scripts/demo_models.sh).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
PROJECTION_SUFFIXES = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def heldout_token_ids(model_dir: Path) -> torch.Tensor:
    """The demo training script's held-out documents (same split rule and file list), encoded as it does."""
    from tokenizers import Tokenizer

    spec = importlib.util.spec_from_file_location("train_demo_models", ROOT / "scripts" / "train_demo_models.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  # dataclasses look their module up here
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    _, heldout, _, _ = module.build_corpus(Path(sysconfig.get_paths()["stdlib"]))
    return module.encode_stream(Tokenizer.from_file(str(model_dir / "tokenizer.json")), heldout)


def projection_bytes(model: torch.nn.Module) -> int:
    total = 0
    for name, module in model.named_modules():
        if name.endswith(PROJECTION_SUFFIXES):  # a swapped-in quantized weight
            total += sum(b.numel() * b.element_size() for b in module.buffers())
    for name, param in model.named_parameters():
        if name.endswith(PROJECTION_SUFFIXES):
            total += param.numel() * param.element_size()
    return total


def decode_step_s(llm: Any, context_len: int, steps: int) -> float:
    from tidepool.engine.sampling_params import SamplingParams

    engine = llm.engine
    prompt = list(range(10, 10 + context_len))
    engine.add_request("bs1", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def measure(path: Path, token_ids: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    from tidepool.engine.llm import LLM
    from tidepool.engine.loading.loader import load_model
    from tidepool.engine.quant.perplexity import perplexity
    from tidepool.engine.quant.runtime import weight_bytes

    # Memory as a 16-bit deployment would hold it (scales/zeros follow the activation dtype); load only.
    half, _ = load_model(path, dtype=torch.float16, show_progress=False)
    half_bytes, half_projection_bytes = weight_bytes(half), projection_bytes(half)
    del half
    llm = LLM(model=str(path))
    model = llm.engine.model
    step = decode_step_s(llm, args.context_len, args.decode_steps)
    return {
        "weight_bytes": weight_bytes(model),
        "projection_bytes": projection_bytes(model),
        "fp16_weight_bytes": half_bytes,
        "fp16_projection_bytes": half_projection_bytes,
        "bs1_decode_step_s": step,
        "bs1_tokens_per_s": 1.0 / step,
        "perplexity": perplexity(model, token_ids, args.seq_len, args.windows),
    }


def main() -> None:
    from tidepool.engine.loading.quantized_copy import quantize_folder

    cache = Path.home() / ".cache" / "tidepool" / "models"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=cache / "demo-target")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=256, help="perplexity window")
    parser.add_argument("--windows", type=int, default=32, help="perplexity windows (from the held-out start)")
    parser.add_argument("--context-len", type=int, default=128, help="context of the bs=1 decode request")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model at {args.model}; build the demo pair with scripts/demo_models.sh or pass --model")
    token_ids = heldout_token_ids(args.model)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tidepool-bench-quant-") as tmp:
        variants = {
            "dense": args.model,
            "int8": quantize_folder(args.model, Path(tmp) / "int8", "int8"),
            f"int4-g{args.group_size}": quantize_folder(args.model, Path(tmp) / "int4", "int4", args.group_size),
        }
        for name, path in variants.items():
            results[name] = measure(path, token_ids, args)
            print(f"measured {name}", file=sys.stderr, flush=True)
    dense = results["dense"]
    for r in results.values():
        r["weight_ratio"] = dense["weight_bytes"] / r["weight_bytes"]
        r["projection_ratio"] = dense["projection_bytes"] / r["projection_bytes"]
        r["fp16_weight_ratio"] = dense["fp16_weight_bytes"] / r["fp16_weight_bytes"]
        r["fp16_projection_ratio"] = dense["fp16_projection_bytes"] / r["fp16_projection_bytes"]
        r["decode_speedup"] = dense["bs1_decode_step_s"] / r["bs1_decode_step_s"]
        r["perplexity_rise_pct"] = 100.0 * (r["perplexity"] / dense["perplexity"] - 1.0)
    print(
        f"{'variant':<12}{'weights MiB':>12}{'ratio':>8}{'proj MiB':>10}{'ratio':>8}"
        f"{'fp16 ratio':>11}{'proj':>6}{'tok/s':>9}{'speedup':>9}{'ppl':>10}{'rise %':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<12}{r['weight_bytes'] / 2**20:>12.2f}{r['weight_ratio']:>8.2f}"
            f"{r['projection_bytes'] / 2**20:>10.2f}{r['projection_ratio']:>8.2f}"
            f"{r['fp16_weight_ratio']:>11.2f}{r['fp16_projection_ratio']:>6.2f}"
            f"{r['bs1_tokens_per_s']:>9.1f}{r['decode_speedup']:>9.2f}"
            f"{r['perplexity']:>10.3f}{r['perplexity_rise_pct']:>8.2f}"
        )
    config = json.loads((args.model / "config.json").read_text())
    out = ROOT / "bench" / "results" / f"quant_{args.model.name}.json"
    payload = {
        "model": str(args.model),
        "dtype": config.get("torch_dtype"),
        "demo_build": config.get("tidepool_demo"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "heldout_tokens_scored": min(args.windows, (token_ids.numel() - 1) // args.seq_len) * args.seq_len,
        "torch_threads": torch.get_num_threads(),
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
