"""GPU check of 2:4 sparsity (issue #41) for when a CUDA machine is lent: self-checking, exits non-zero on a failure.

1. Exactness: `SparseWeight`'s F.linear on CUDA (torch's semi-structured sparse tensor, `engine/sparsity/cuda.py`)
   against F.linear over the same pruned weight densely in float32, for SmolLM2's projection shapes, float16 and
   bfloat16, 1-2048 input rows, float32 and int8 kept values; and that the semi-structured path really ran (not
   the dense fallback).
2. Speed: the same products timed with CUDA events, sparse vs cuBLAS dense in the same dtype (ratios, one run).
3. Engine: a random model of SmolLM2's shapes (`bench/common.bench_model`) pruned 2:4 (magnitude) and served on
   CUDA in float16: greedy tokens compared with the densified pruned model on CUDA (reported; float16 summation
   order may flip a near tie, so only a crash or no tokens fails) and decode tokens/s of both.

Writes bench/results/gpu_check_sparsity.json.

    python3 bench/gpu_check_sparsity.py          # about 2 minutes on an H100
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model
from tidepool.engine.sparsity.format import pack_2to4
from tidepool.engine.sparsity.weight import SparseWeight

RESULT = Path(__file__).resolve().parent / "results" / "gpu_check_sparsity.json"
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M's [out, in]
ROWS = (1, 8, 16, 128, 2048)


def pruned(out: int, inner: int, seed: int) -> torch.Tensor:
    w = torch.randn(out, inner, generator=torch.Generator().manual_seed(seed)) * 0.05
    groups = w.view(out, inner // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.abs().topk(2, dim=-1).indices, True)
    return (groups * keep).view(out, inner)


def weight_of(dense: torch.Tensor, int8: bool) -> SparseWeight:
    if not int8:
        values, meta = pack_2to4(dense)
        return SparseWeight(values, meta, dense.shape[1])
    scales = dense.abs().amax(1).clamp_min(1e-12) / 127
    values, meta = pack_2to4((dense / scales[:, None]).round().clamp(-127, 127), mask=dense != 0)
    return SparseWeight(values.to(torch.int8), meta, dense.shape[1], scales)


def exactness(failures: list[str]) -> list[dict]:
    rows = []
    for out, inner in SHAPES:
        dense = pruned(out, inner, out + inner)
        for int8 in (False, True):
            weight = weight_of(dense, int8).cuda()
            reference = weight.dense().float().cuda()
            for dtype in (torch.float16, torch.bfloat16):
                weight.semi = None
                for n in ROWS:
                    x = torch.randn(n, inner, device="cuda", dtype=dtype)
                    got = F.linear(x, weight).float()
                    want = F.linear(x.float(), reference)
                    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
                    semi = type(weight.semi).__name__
                    ok = err < (2e-2 if dtype == torch.bfloat16 else 4e-3) and "SemiStructured" in semi
                    rows.append({"shape": [out, inner], "int8": int8, "dtype": str(dtype), "rows": n,
                                 "max_rel_err": err, "weight_type": semi, "ok": ok})  # fmt: skip
                    if not ok:
                        failures.append(f"exactness {out}x{inner} int8={int8} {dtype} rows={n}: err {err:.2e}, {semi}")
    return rows


def timed(fn, repeats: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


def speed() -> list[dict]:
    rows = []
    for out, inner in SHAPES:
        dense = pruned(out, inner, 1)
        for dtype in (torch.float16, torch.bfloat16):
            weight = weight_of(dense, False).cuda()
            dense_w = dense.to(device="cuda", dtype=dtype)
            for n in ROWS:
                x = torch.randn(n, inner, device="cuda", dtype=dtype)
                t_dense = timed(lambda x=x, w=dense_w: F.linear(x, w))
                t_sparse = timed(lambda x=x, w=weight: F.linear(x, w))
                rows.append({"shape": [out, inner], "dtype": str(dtype), "rows": n, "dense_us": 1e6 * t_dense,
                             "sparse_us": 1e6 * t_sparse, "speedup": t_dense / t_sparse})  # fmt: skip
    return rows


def engine(failures: list[str]) -> dict:
    from tidepool.engine import LLM, SamplingParams
    from tidepool.engine.sparsity.prune import densify_folder, sparsify_folder

    src = bench_model("llama", "smollm-135m", 0)
    with tempfile.TemporaryDirectory() as tmp:
        sparse = sparsify_folder(src, Path(tmp) / "sparse", "magnitude", "float16", show_progress=False)
        dense = densify_folder(sparse, Path(tmp) / "dense")
        prompts = [[1 + (7 * i + j) % 400 for j in range(32)] for i in range(8)]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        result: dict = {}
        for name, path in (("sparse", sparse), ("dense", dense)):
            llm = LLM(str(path), device="cuda", dtype="float16", show_progress=False, max_num_seqs=8)
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            result[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "tok_s": 8 * 64 / elapsed}
            del llm
            torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(result["sparse"]["tokens"], result["dense"]["tokens"], strict=True))
    if not all(len(t) == 64 for t in result["sparse"]["tokens"]):
        failures.append("engine: the sparse model did not generate 64 tokens per prompt")
    return {"prompts_with_dense_greedy_tokens": f"{same}/8", "sparse_tok_s": result["sparse"]["tok_s"],
            "dense_tok_s": result["dense"]["tok_s"]}  # fmt: skip


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    capability = torch.cuda.get_device_capability()
    if capability < (8, 0):
        print(f"compute capability {capability}: no sparse tensor cores, nothing to check")
        return 2
    failures: list[str] = []
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["exactness"] = exactness(failures)
    report["speed"] = speed()
    for row in report["speed"]:
        print(f"{row['shape']} {row['dtype']:15s} rows={row['rows']:5d}: dense {row['dense_us']:7.1f} us, "
              f"sparse {row['sparse_us']:7.1f} us ({row['speedup']:.2f}x)")  # fmt: skip
    try:
        report["engine"] = engine(failures)
        print(f"engine: {report['engine']}")
    except Exception as err:  # reported as a failure with its message
        failures.append(f"engine: {type(err).__name__}: {err}")
    report["failures"] = failures
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(failures) if failures else "all 2:4 GPU checks passed", f"\nwrote {RESULT}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
