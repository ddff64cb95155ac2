"""2:4 sparsity quality: held-out perplexity of dense, int8, magnitude / Wanda / SparseGPT 2:4, and 2:4 + int8.

Every variant is scored by the engine's own forward pass (`engine/quant/perplexity.py`) on the same
windows of two held-out texts, neither used for calibration:
- prose: the odd half of CPython's ``pydoc_data.topics`` (`sparsity.calibration.heldout_topics`; the
  even half is the calibration text, and every paragraph shared with it is removed),
- code: the demo training script's held-out standard-library files (bench/quant.py's split), less
  ``pydoc_data/topics.py`` itself.
Sparse checkpoints come from `sparsity.prune.cached_sparse_checkpoint` (pruned once per method and
source, then cached; the exactness tests and the speed bench use the same folders); each is densified
(`format.densify_tensors`) into one loaded dense model, so the score is the pruned weights' alone. int8
alone is `tidepool quantize --method int8` (per-channel RTN), loaded by the engine.
Prints a table and writes JSON to bench/results/sparsity_quality_<model>.json.

Usage (from /tmp, dev venv):
  python /path/to/bench/sparsity_quality.py [--model DIR] [--windows 16] [--seq-len 256]
Default model: $TIDEPOOL_CACHE/models/SmolLM2-135M-Instruct.Q4_1-f32.
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

from common import cache_dir

ROOT = Path(__file__).resolve().parent.parent

SPARSE = (("magnitude", "float32"), ("wanda", "float32"), ("sparsegpt", "float32"))
SPARSE += (("wanda", "int8"), ("sparsegpt", "int8"))


def heldout_code_documents() -> list[str]:
    """The demo training script's held-out stdlib files (its split rule), without pydoc_data/topics.py."""
    spec = importlib.util.spec_from_file_location("train_demo_models", ROOT / "scripts" / "train_demo_models.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    _, heldout, _, _ = module.build_corpus(stdlib)
    topics = (stdlib / "pydoc_data" / "topics.py").read_text(encoding="utf-8", errors="replace")
    return [doc for doc in heldout if doc != topics]


def score(model: torch.nn.Module, texts: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, float]:
    from tidepool.engine.quant.perplexity import perplexity

    return {name: perplexity(model, ids, args.seq_len, args.windows) for name, ids in texts.items()}


def measure(args: argparse.Namespace, texts: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    from tidepool.engine.loading.loader import load_model
    from tidepool.engine.loading.quantized_copy import quantize_folder
    from tidepool.engine.loading.safetensors import read_tensors
    from tidepool.engine.sparsity.format import densify_tensors
    from tidepool.engine.sparsity.prune import cached_sparse_checkpoint

    results: dict[str, dict[str, Any]] = {}
    model, _ = load_model(args.model, show_progress=False)
    results["dense"] = score(model, texts, args)
    print("measured dense", file=sys.stderr, flush=True)
    for method, values_dtype in SPARSE:
        start = time.perf_counter()
        folder = cached_sparse_checkpoint(args.model, method, values_dtype, args.num_samples, args.calib_seq_len)
        built_s = time.perf_counter() - start
        model.load_weights(densify_tensors(read_tensors(folder)).items())
        name = f"2:4 {method}" + (" + int8" if values_dtype == "int8" else "")
        results[name] = {**score(model, texts, args), "folder": str(folder), "build_or_cache_s": built_s}
        print(f"measured {name} ({folder})", file=sys.stderr, flush=True)
    del model
    with tempfile.TemporaryDirectory(prefix="tidepool-bench-sparsity-") as tmp:
        int8, _ = load_model(quantize_folder(args.model, Path(tmp) / "int8", "int8"), show_progress=False)
        results["int8 (dense)"] = score(int8, texts, args)
    print("measured int8 (dense)", file=sys.stderr, flush=True)
    return results


def main() -> None:
    from tidepool.engine.sparsity.calibration import heldout_topics, token_stream
    from tidepool.engine.sparsity.prune import DEFAULT_NUM_SAMPLES, DEFAULT_SEQ_LEN

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1-f32")
    parser.add_argument("--seq-len", type=int, default=256, help="perplexity window")
    parser.add_argument("--windows", type=int, default=16, help="perplexity windows per text")
    parser.add_argument("--num-samples", type=int, default=DEFAULT_NUM_SAMPLES, help="calibration windows")
    parser.add_argument("--calib-seq-len", type=int, default=DEFAULT_SEQ_LEN, help="calibration window length")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model at {args.model}; pass --model DIR (a dense Hugging Face folder)")
    texts = {
        "prose": token_stream(args.model, heldout_topics()),
        "code": token_stream(args.model, heldout_code_documents()),
    }
    results = measure(args, texts)
    dense = results["dense"]
    print(f"{'variant':<22}{'prose ppl':>11}{'rise %':>9}{'code ppl':>11}{'rise %':>9}")
    for name, r in results.items():
        for text in texts:
            r[f"{text}_rise_pct"] = 100.0 * (r[text] / dense[text] - 1.0)
        print(f"{name:<22}{r['prose']:>11.2f}{r['prose_rise_pct']:>9.1f}{r['code']:>11.2f}{r['code_rise_pct']:>9.1f}")
    payload = {
        "model": str(args.model),
        "seq_len": args.seq_len,
        "windows": args.windows,
        "tokens_scored": {
            t: min(args.windows, (ids.numel() - 1) // args.seq_len) * args.seq_len for t, ids in texts.items()
        },
        "calibration": {
            "num_samples": args.num_samples,
            "seq_len": args.calib_seq_len,
            "text": "pydoc topics (even half)",
        },
        "results": results,
    }
    out = ROOT / "bench" / "results" / f"sparsity_quality_{args.model.name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
