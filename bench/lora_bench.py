"""Multi-LoRA decode cost (issue #37): 32 decodes over 8 adapters vs 32 base-model decodes, one process.

What it measures, on the real SmolLM2-135M-Instruct (float32 Hugging Face folder) with 8 adapters made
here once with `peft` (ranks 8 and 16, targets mixing attention and MLP projections, one rsLoRA, every
lora_B non-zero; cached under $TIDEPOOL_CACHE/lora_bench):

- adapter load: wall time of `LoRARegistry.read` (peft files -> validated tensors) and of `register`
  per adapter; bytes per adapter in host memory (`AdapterInfo.num_bytes`) and per device slot (the
  stacked slot tensors of every site, `LoRASlots.num_bytes / max_loras`, rank padded to max_lora_rank);
- the engine's decode step: one `LLM(enable_lora=True, max_loras=8, max_lora_rank=16)`, 32 requests
  (the same prompts every time) decoding greedily, three ways: request i on adapter i % 8 ("lora"), all on
  the base model ("base": today's path, one compiled call per float32 CPU decode step), and all on the
  base model layer by layer ("base_layers": the one-call step switched off, the path a step with adapter
  tokens takes). Each repetition adds the 32 requests, prefills them, then times `--steps` decode steps
  and keeps the median step; the order of the three rotates every repetition. Reported: the median of
  the per-repetition ratios lora/base (#37's target: <= 1.3), lora/base_layers (what the LoRA work
  costs) and base_layers/base (what leaving the one-call step costs), and the share of a lora step
  spent inside `lora_apply` (the profile);
- kernel level: on the engine's own weights and filled slots, the 4 projection sites of every layer at
  batch 32: the base projections (`layers.linear.linear`) vs `lora_apply` on the same inputs, with the
  sites' per-sub-target ranks and with one rank per slot (what skipping left-out sub-targets saves), and
  the torch reference for scale.

    python bench/lora_bench.py [--model <float32 SmolLM2 folder>] [--reps 4] [--steps 12] [--context-len 128]

Prints a table; writes bench/results/lora_bench.json. Timings on a shared machine are noisy: compare the
ratios, which are taken within one process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common import cache_dir, decode_prompts
from tidepool.engine import LLM, SamplingParams, cpu_ops
from tidepool.engine.layers.linear import linear
from tidepool.engine.lora import ops, slots
from tidepool.kernels.lora_ref import lora_apply_ref

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1-f32"
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
# (rank, lora_alpha, targets, use_rslora): 8 adapters of ranks 8-16 over attention and MLP projections.
ADAPTERS = [
    (8, 16, ("q_proj", "v_proj"), False),
    (16, 32, ATTN, False),
    (16, 16, ATTN + MLP, False),
    (8, 8, MLP, False),
    (16, 32, ("q_proj", "v_proj", "gate_proj", "up_proj"), True),
    (8, 16, ("o_proj", "down_proj"), False),
    (8, 16, ATTN + MLP, False),
    (16, 16, ("k_proj", "v_proj", "up_proj", "down_proj"), False),
]
NUM_SEQS, MAX_RANK = 32, 16
# "base": the base model as it runs today (a float32 CPU decode step of up to 128 sequences is one compiled
# call); "base_layers": the same layer by layer, the path a step with adapter tokens takes.
KINDS = ["lora", "base", "base_layers"]
RATIOS = {"lora/base": ("lora", "base"), "lora/base_layers": ("lora", "base_layers"),
          "base_layers/base": ("base_layers", "base")}  # fmt: skip
_request_ids = itertools.count()


def make_adapters(model: Path, root: Path) -> list[Path]:
    """The bench's adapters as PEFT folders (made once; lora_B drawn N(0, 0.02), seeded, so never zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i, (rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        path = root / f"adapter-{i}-r{rank}"
        paths.append(path)
        if (path / "adapter_model.safetensors").is_file():
            continue
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora)
        peft_model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
        peft_model.save_pretrained(path)  # adapter_config.json + adapter_model.safetensors
    return paths


def load_adapters(llm: LLM, paths: list[Path]) -> list[dict[str, Any]]:
    """Register every adapter, timing the read (files -> tensors) and the registration apart."""
    registry = llm.engine.lora
    rows = []
    for i, path in enumerate(paths):
        start = time.perf_counter()
        adapter = registry.read(f"a{i}", str(path))
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        info = registry.register(adapter)
        rows.append({"name": info.name, "rank": info.rank, "targets": list(info.targets), "read_s": read_s,
                     "register_s": time.perf_counter() - start, "host_bytes": info.num_bytes})  # fmt: skip
    return rows


def decode_steps(llm: LLM, prompts: list[list[int]], names: list[str | None], steps: int) -> dict[str, Any]:
    """Median decode step time with every prompt running (prefill excluded), the tokens, lora_apply's share."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"r{next(_request_ids)}" for _ in prompts]
    for request_id, prompt, name in zip(ids, prompts, names, strict=True):
        engine.add_request(request_id, prompt, params, lora_name=name)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.step()
    spent = [0.0]

    def timed(*args: Any) -> None:
        start = time.perf_counter()
        ops.lora_apply(*args)
        spent[0] += time.perf_counter() - start

    times, shares, tokens = [], [], {}
    slots.lora_apply = timed  # SiteSlots.apply calls it by this module's name
    try:
        while engine.has_unfinished_requests():
            spent[0] = 0.0
            start = time.perf_counter()
            outputs = engine.step()
            times.append(time.perf_counter() - start)
            shares.append(spent[0] / times[-1])
            tokens.update((o.request_id, o.outputs[0].token_ids) for o in outputs if o.finished)
    finally:
        slots.lora_apply = ops.lora_apply
    full = times[: steps - 1]  # every sequence still running
    return {"step_s": statistics.median(full), "lora_share": statistics.median(shares[: steps - 1]),
            "tokens": [tokens[i] for i in ids]}  # fmt: skip


def run_reps(llm: LLM, adapter_names: list[str], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """`args.reps` repetitions of every kind, the order rotating each repetition (lora, base, base_layers, then
    base, base_layers, lora, ...), so a slow spell of the shared machine hits all kinds alike."""
    prompts = decode_prompts(NUM_SEQS, args.context_len)
    step_op = cpu_ops.decoder_op()
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for rep in range(args.reps):
        for kind in KINDS[rep % len(KINDS) :] + KINDS[: rep % len(KINDS)]:
            names = adapter_names if kind == "lora" else [None] * NUM_SEQS
            limit = None if step_op is None else step_op.max_batch
            if step_op is not None and kind == "base_layers":
                step_op.max_batch = 0  # the model then runs layer by layer, as a step with adapter tokens does
            try:
                runs[kind].append(decode_steps(llm, prompts, names, args.steps))
            finally:
                if step_op is not None:
                    step_op.max_batch = limit
        print(f"rep {rep}: " + "  ".join(f"{k} {runs[k][-1]['step_s'] * 1e3:.1f} ms" for k in KINDS)
              + f"  lora/base {runs['lora'][-1]['step_s'] / runs['base'][-1]['step_s']:.3f}", flush=True)  # fmt: skip
    return runs


def median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_level(llm: LLM, repeats: int) -> dict[str, float]:
    """Every layer's 4 sites at batch 32 over the 8 slots: base projections vs lora_apply (with the sites' own
    per-sub-target ranks, and with one rank per slot as the contract's [S] form: what skipping the sub-targets
    an adapter leaves out saves) vs the torch reference."""
    model = llm.engine.runner.model
    registry = llm.engine.lora
    gen = torch.Generator().manual_seed(0)
    hidden, inter = model.layers[0].mlp.down_weight.shape
    xs = {hidden: torch.randn(NUM_SEQS, hidden, generator=gen), inter: torch.randn(NUM_SEQS, inter, generator=gen)}
    token_slots = (torch.arange(NUM_SEQS) % registry.max_loras).to(torch.int32)
    sites = []
    for layer, layer_slots in zip(model.layers, registry.slots.layers, strict=True):
        weights = (
            layer.self_attn.qkv_weight,
            layer.self_attn.o_weight,
            layer.mlp.gate_up_weight,
            layer.mlp.down_weight,
        )
        for weight, site in zip(weights, layer_slots.values(), strict=True):
            sites.append((weight, site, xs[weight.shape[1]], torch.empty(NUM_SEQS, weight.shape[0])))

    def base() -> None:
        for weight, _, x, _ in sites:
            linear(x, weight)

    def apply(fn: Callable[..., None], per_sub: bool = True) -> Callable[[], None]:
        def run() -> None:
            for _, site, x, y in sites:
                ranks = site.ranks if per_sub else registry.slots.ranks
                fn(y, x, site.a, site.b, site.sub_offsets, token_slots, ranks)

        return run

    result = {"projections_s": median_time(base, repeats), "lora_apply_s": median_time(apply(ops.lora_apply), repeats)}
    result["lora_apply_slot_ranks_s"] = median_time(apply(ops.lora_apply, per_sub=False), repeats)
    result["torch_reference_s"] = median_time(apply(lora_apply_ref), max(1, repeats // 3))
    result["ratio"] = (result["projections_s"] + result["lora_apply_s"]) / result["projections_s"]
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="float32 SmolLM2 Hugging Face folder")
    parser.add_argument("--reps", type=int, default=4, help="repetitions of each of lora and base (alternating)")
    parser.add_argument("--steps", type=int, default=12, help="decode steps per repetition")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--kernel-repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "lora_bench.json")
    return parser.parse_args()


def resolve_model(path: Path) -> Path:
    """The float32 folder; made from the catalogue's SmolLM2 GGUF once where it is missing (a fresh machine)."""
    if (path / "config.json").is_file():
        return path
    from offline_throughput import resolve_model as convert

    from tidepool.engine.gguf.pull import pull

    gguf = pull("smollm2-135m-instruct", show_progress=False)
    return convert(argparse.Namespace(model=str(gguf)))[0]


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    paths = make_adapters(model, cache_dir() / "lora_bench")
    llm = LLM(str(model), dtype="float32", enable_lora=True, max_loras=len(paths), max_lora_rank=MAX_RANK,
              max_num_seqs=NUM_SEQS, enable_prefix_caching=False, show_progress=False)  # fmt: skip
    loads = load_adapters(llm, paths)
    slot_bytes = llm.engine.lora.slots.num_bytes // llm.engine.lora.max_loras
    runs = run_reps(llm, [f"a{i % len(paths)}" for i in range(NUM_SEQS)], args)
    ratios = {name: [a["step_s"] / b["step_s"] for a, b in zip(runs[top], runs[bottom], strict=True)]
              for name, (top, bottom) in RATIOS.items()}  # fmt: skip
    kernel = kernel_level(llm, args.kernel_repeats)
    differ = sum(a != b for a, b in zip(runs["lora"][0]["tokens"], runs["base"][0]["tokens"], strict=True))
    result = {
        "model": str(model), "threads": torch.get_num_threads(), "num_seqs": NUM_SEQS, "steps": args.steps,
        "context_len": args.context_len, "ratio_median": statistics.median(ratios["lora/base"]),
        "ratios": ratios, **{f"{kind}_step_s": [r["step_s"] for r in runs[kind]] for kind in KINDS},
        "lora_apply_share": statistics.median(r["lora_share"] for r in runs["lora"]),
        "requests_whose_tokens_differ_from_base": differ, "adapters": loads, "device_slot_bytes": slot_bytes,
        "kernel_level": kernel,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"wrote {args.out}")


def print_table(r: dict[str, Any]) -> None:
    print(f"\n32 decodes over 8 adapters vs 32 base decodes ({r['threads']} threads, context {r['context_len']}):")
    for name, values in r["ratios"].items():
        print(f"  {name:17s} median {statistics.median(values):.3f} ({', '.join(f'{x:.3f}' for x in values)})"
              + ("  target <= 1.3" if name == "lora/base" else ""))  # fmt: skip
    steps = ", ".join(f"{kind} {statistics.median(r[f'{kind}_step_s']) * 1e3:.1f} ms" for kind in KINDS)
    print(f"  median steps: {steps}; lora_apply: {r['lora_apply_share']:.1%} of a lora step")
    k = r["kernel_level"]
    print(
        f"  kernel level (4 sites x all layers, batch 32): projections {k['projections_s'] * 1e3:.1f} ms, lora_apply "
        f"{k['lora_apply_s'] * 1e3:.1f} ms ({k['ratio']:.3f}x; one rank per slot "
        f"{k['lora_apply_slot_ranks_s'] * 1e3:.1f} ms), torch reference {k['torch_reference_s'] * 1e3:.1f} ms"
    )
    print(f"  {r['requests_whose_tokens_differ_from_base']}/32 requests' greedy tokens differ from the base model's")
    print(f"  device slot: {r['device_slot_bytes'] / 2**20:.1f} MiB per adapter (rank padded to 16)")
    print("  adapter  rank  targets  read ms  register ms  host MiB")
    for a in r["adapters"]:
        print(f"  {a['name']:7s} {a['rank']:5d} {len(a['targets']):8d} {a['read_s'] * 1e3:8.1f} "
              f"{a['register_s'] * 1e3:12.1f} {a['host_bytes'] / 2**20:9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
