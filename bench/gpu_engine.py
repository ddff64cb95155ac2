"""Engine smoke and throughput on a GPU: CUDA float32 greedy = CPU float32 greedy, bfloat16 close, graphs on vs off.

Checks (exit status 1 when one fails):
- greedy tokens of the CUDA engine in float32, with and without CUDA graphs, equal the CPU engine's
  (same model, prompts of several lengths decoding side by side, so batches shrink as they finish);
- bfloat16 on CUDA: prompt logits against CPU float32 (max |diff| relative to the logit range, and
  how often the top-1 token agrees) within tolerance.
Timings: output tokens/s of a decode-heavy workload at batch 1, 8 and 64, with CUDA graphs
(TIDEPOOL_CUDA_GRAPHS=1, the default) and without (=0), both in bfloat16. JSON to
bench/results/gpu_engine.json.

    python bench/gpu_engine.py                 # on a CUDA machine, a few minutes on an H200
    python bench/gpu_engine.py --model DIR     # another model folder (default: the seeded 'small' preset)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model

RESULTS = Path(__file__).resolve().parent / "results"
BF16_MAX_REL_DIFF = 0.05  # |logit diff| / logit range
BF16_MIN_TOP1_AGREEMENT = 0.9


def make_llm(model: str, device: str, dtype: str, graphs: bool, **kwargs):
    from tidepool.engine import LLM

    os.environ["TIDEPOOL_CUDA_GRAPHS"] = "1" if graphs else "0"  # read when the runner is built
    return LLM(model, device=device, dtype=dtype, show_progress=False, **kwargs)


def greedy(llm, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    from tidepool.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def throughput(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    from tidepool.engine import SamplingParams

    prompts = [[3 + (7 * i + j) % 500 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_engine.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_engine.py: no CUDA device here; nothing to measure.")
        return 0
    model = args.model or str(bench_model("llama", "small"))
    common = dict(max_model_len=1024, num_kv_blocks=2048, block_size=16)
    prompts = [[3 + (11 * i + j) % 400 for j in range(n)] for i, n in enumerate((5, 40, 130, 300, 17, 64))]
    lengths = [48, 20, 33, 12, 64, 40]
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": model, "checks": []}

    def check(name: str, ok: bool, **details: object) -> None:
        report["checks"].append({"check": name, "ok": ok, **details})
        print(f"{'ok  ' if ok else 'FAIL'} {name} {details}")

    cpu = make_llm(model, "cpu", "float32", graphs=False, **common)
    want = greedy(cpu, prompts, lengths)
    cpu_logits = [cpu.engine.runner.prompt_logits(p) for p in prompts[:4]]
    del cpu
    for graphs in (False, True):
        llm = make_llm(model, "cuda", "float32", graphs, **common)
        got = greedy(llm, prompts, lengths)
        same = sum(g == w for g, w in zip(got, want, strict=True))
        replays = llm.engine.runner.graphs.stats.num_replays if llm.engine.runner.graphs else {}
        check(f"greedy float32 CUDA (graphs {'on' if graphs else 'off'}) == CPU", same == len(want),
              identical=f"{same}/{len(want)}", replays=replays)  # fmt: skip
        del llm
    llm = make_llm(model, "cuda", "bfloat16", True, **common)
    for prompt, ref in zip(prompts[:4], cpu_logits, strict=True):
        got = llm.engine.runner.prompt_logits(prompt).float().cpu()
        rel = float((got - ref).abs().max() / (ref.max() - ref.min()))
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        ok = rel <= BF16_MAX_REL_DIFF and top1 >= BF16_MIN_TOP1_AGREEMENT
        check(f"bfloat16 logits vs CPU float32, {len(prompt)} tokens", ok, max_rel_diff=rel, top1_agreement=top1)
    del llm
    report["throughput"] = []
    for graphs in (False, True):
        llm = make_llm(model, "cuda", "bfloat16", graphs, max_model_len=1024, block_size=16)
        for batch in (1, 8, 64):
            tps = throughput(llm, batch, 128, args.new_tokens)
            report["throughput"].append({"graphs": graphs, "batch": batch, "output_tokens_per_s": tps})
            print(f"graphs {'on ' if graphs else 'off'} batch {batch:3d}: {tps:9.1f} output tok/s")
        del llm
    speed = {(r["graphs"], r["batch"]): r["output_tokens_per_s"] for r in report["throughput"]}
    for batch in (1, 8, 64):
        off, on = speed[(False, batch)], speed[(True, batch)]
        print(f"batch {batch}: CUDA graphs {on / off:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
