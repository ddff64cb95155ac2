"""Speculative decoding at batch size 1: decode speed with a draft model and with n-gram lookup vs none.

Two workloads, greedy, one request at a time (bs=1):
- input-grounded ("edit this code"): a Python standard-library function, then a comment asking for
  it again with a small change, then its first line: the continuation mostly repeats the input;
- free generation: the opening line of a function or docstring, continued freely.
Each configuration runs the same prompts, interleaved (prompt by prompt, method by method, `--repeats`
rounds) so load drift on a shared machine hits all alike; the greedy token ids must be identical to
the run without speculation (asserted). Printed per workload: tokens/s, speedup (ratio against no speculation in the
same run), acceptance rate (accepted / proposed tokens) and mean tokens per target step.

Models: the trained demo pair (`scripts/train_demo_models.py`, in ~/.cache/tidepool/models/demo-target and
demo-draft) by default; `--target/--draft` choose others. Without the pair it falls back to `tidepool
make-model`'s random `small` preset with a draft made of the target's first layer (same tokenizer);
acceptance rates on random models are meaningless (the note is printed and saved).

    nice -n 19 python bench/spec_decode.py                  # writes bench/results/spec_decode_<target>.json
    nice -n 19 python bench/spec_decode.py --quick          # 1 prompt per workload, 32 tokens
    python bench/spec_decode.py --target $TIDEPOOL_CACHE/models/SmolLM2-135M-Instruct.Q4_1-f32 \
        --methods suffix,ngram --threads 2                  # the real model (bench/lm_eval_ppl.py makes the folder)
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, cache_dir

RESULTS = Path(__file__).resolve().parent / "results"
RANDOM_NOTE = "random make-model weights: acceptance rates (and so speedups) say nothing about real models"


def _sources() -> list[str]:
    """Functions from the standard library: present on every machine, and code the demo pair was trained on."""
    import json.decoder as jd
    import shlex
    import textwrap

    funcs = [textwrap.dedent, shlex.split, jd.py_scanstring, textwrap.TextWrapper._split, shlex.quote]
    return [inspect.getsource(f) for f in funcs]


def prompts(tokenizer: Any, max_prompt_tokens: int) -> dict[str, list[list[int]]]:
    grounded, free = [], []
    for source in _sources():
        lines = source.splitlines()
        body = "\n".join(lines[: max(4, len(lines))])
        text = f"{body}\n\n# The same function again, with the comments kept and the names unchanged:\n{lines[0]}\n"
        ids = tokenizer.encode(text)
        if len(ids) > max_prompt_tokens:  # keep the tail: the instruction and the restart are what matter
            ids = ids[:1] + ids[-(max_prompt_tokens - 1) :]
        grounded.append(ids)
        free.append(tokenizer.encode(lines[0] + "\n"))
    return {"grounded": grounded, "free": free}


def layer_draft(target: Path, out: Path, num_layers: int = 1) -> Path:
    """A draft that is the target's first `num_layers` layers (same tokenizer): the random-model fallback."""
    shutil.copytree(target, out, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(target / "model.safetensors"))
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, str(out / "model.safetensors"))
    return out


def build(target: Path, speculative: dict[str, Any] | None, args: Any) -> Any:
    from tidepool.engine import LLM, SamplingParams

    llm = LLM(
        str(target),
        dtype="float32",
        max_model_len=args.max_model_len,
        num_kv_blocks=args.max_model_len // 16 * 2,
        show_progress=False,
        speculative_config=speculative,
    )
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    return llm


def run_interleaved(llms: dict[str, Any], work: dict[str, list[list[int]]], args: Any) -> dict[str, dict]:
    """Every prompt runs under every method back to back (bs=1), `--repeats` times: on a shared machine
    the load then drifts over all methods alike, so the ratios stay fair."""
    from tidepool.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, dict] = {name: {} for name in llms}
    for workload, prompt_list in work.items():
        totals = {name: {"seconds": 0.0, "tokens": 0, "draft": 0, "accepted": 0, "steps": 0} for name in llms}
        token_ids: dict[str, list[list[int]]] = {name: [] for name in llms}
        for repeat in range(args.repeats):
            for prompt in prompt_list:
                for name, llm in llms.items():
                    spec = llm.engine.speculator
                    before = (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_verified_seqs) if spec else None
                    start = time.perf_counter()
                    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                    total = totals[name]
                    total["seconds"] += time.perf_counter() - start
                    total["tokens"] += len(out.token_ids)
                    if spec and before:
                        total["draft"] += spec.num_draft_tokens - before[0]
                        total["accepted"] += spec.num_accepted_tokens - before[1]
                        total["steps"] += spec.num_verified_seqs - before[2]
                    if repeat == 0:
                        token_ids[name].append(out.token_ids)
        for name, total in totals.items():
            entry: dict[str, Any] = {
                "seconds": total["seconds"],
                "tokens": total["tokens"],
                "tokens_per_s": total["tokens"] / total["seconds"],
                "token_ids": token_ids[name],
            }
            if llms[name].engine.speculator is not None:
                steps = total["steps"]
                entry["acceptance_rate"] = total["accepted"] / total["draft"] if total["draft"] else 0.0
                entry["tokens_per_verify_step"] = (total["accepted"] + steps) / steps if steps else 1.0
            results[name][workload] = entry
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = cache_dir() / "models"
    parser.add_argument("--target", type=Path, default=models / "demo-target")
    parser.add_argument("--draft", type=Path, default=models / "demo-draft")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (n-gram, draft)")
    parser.add_argument("--suffix-k", type=int, default=16, help="num_speculative_tokens for suffix decoding: "
                        "the most it proposes; how many it does adapts to the match")  # fmt: skip
    parser.add_argument("--methods", default="none,suffix,ngram,draft",
                        help="comma-separated: suffix, ngram, draft (none, the baseline, always runs)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=600)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the dev machine is shared)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all prompts and methods")
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts per workload (at most 5)")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/spec_decode_<target>.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    note = None
    target, draft = args.target, args.draft
    needs_draft = "draft" in args.methods.split(",")
    if not (target / "config.json").is_file() or (needs_draft and not (draft / "config.json").is_file()):
        target = bench_model("llama", "small")
        draft = layer_draft(target, cache_dir() / "models" / "llama-small-seed0-layer0-draft")
        note = RANDOM_NOTE
        print(f"note: demo pair not found under {models}; using {target} and its first layer as draft ({note})")
    if note is None and needs_draft and "tidepool_demo" not in json.loads((target / "config.json").read_text()):
        note = f"not the trained demo pair; if these are {RANDOM_NOTE}"
    if note:
        print(f"note: {note}")
    if args.quick:
        args.max_tokens, args.repeats = 32, 1

    from tidepool.engine.tokenizer import Tokenizer

    work = prompts(Tokenizer.from_pretrained(target), args.max_prompt_tokens)
    work = {name: p[: 1 if args.quick else args.num_prompts] for name, p in work.items()}
    configs: dict[str, dict[str, Any] | None] = {
        "none": None,
        "suffix": {"method": "suffix", "num_speculative_tokens": args.suffix_k},
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
        "draft": {"method": "draft", "draft_model": str(draft), "num_speculative_tokens": args.k},
    }
    wanted = {"none", *args.methods.split(",")}
    configs = {name: spec for name, spec in configs.items() if name in wanted}
    llms = {name: build(target, spec, args) for name, spec in configs.items()}
    results = run_interleaved(llms, work, args)
    base = results["none"]
    print(f"\ntarget {target}\ndraft  {draft}\nK={args.k}, {args.max_tokens} tokens per request, bs=1, greedy")
    print(f"{'workload':<10} {'method':<6} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/step':>9}")
    for workload in work:
        for name, res in results.items():
            entry = res[workload]
            if entry["token_ids"] != base[workload]["token_ids"]:
                raise RuntimeError(f"{name} changed the greedy output on {workload}: speculation must be lossless")
            entry["speedup"] = base[workload]["seconds"] / entry["seconds"]
            accept = f"{entry['acceptance_rate']:.1%}" if "acceptance_rate" in entry else "-"
            per_step = f"{entry['tokens_per_verify_step']:.2f}" if "tokens_per_verify_step" in entry else "-"
            print(
                f"{workload:<10} {name:<6} {entry['tokens_per_s']:>8.1f} {entry['speedup']:>7.2f}x "
                f"{accept:>7} {per_step:>9}"
            )
    for res in results.values():
        for entry in res.values():
            entry.pop("token_ids")
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / f"spec_decode_{target.name}.json"
    payload = {
        "target": str(target),
        "draft": str(draft),
        "num_speculative_tokens": args.k,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "prompts_per_workload": {name: len(p) for name, p in work.items()},
        "note": note,
        "machine": platform.processor() or platform.machine(),
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"greedy outputs identical across methods; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
