"""Structured-output overhead: decode tok/s with every request constrained vs the same requests free, one process.

What it measures, on one `LLM` (the real SmolLM2-135M-Instruct from the catalogue by default):
- decode throughput at batch `--batch` (16): chat prompts of the structured-output suite
  (tests/server/structured_schemas.py), greedy, once with every request constrained by its JSON
  schema (strict, as the server sends them) and once unconstrained with each request generating
  exactly as many tokens as its constrained twin did (`max_tokens` = that count, `ignore_eos`), so
  both runs shrink the batch alike. The batch's schemas are the suite's bounded ones with the longest
  greedy answers (one calibration run), to keep the batch full as long as the suite allows. Decode
  tok/s counts steps that compute no prompt token (timed around `LLMEngine.step()`), over all of them
  and over those in which the whole batch still runs ("full batch": the issue's batch-16 figure); runs
  alternate (C,U then U,C) over `--reps` repetitions after one warm-up of each. Reported: the median of
  the per-repetition ratios constrained/unconstrained, and, robust to a busy shared machine (whose
  stalls make single steps tenfold slower), the ratio with every batch size's step time replaced by
  its median over all repetitions, over all decode steps and over full-batch steps (issue 36's
  target: >= 0.9);
- the time the sampler spends in the grammar mask (`GrammarMasks.apply`: keeping each matcher in step,
  filling the bitmasks, applying them), per constrained token and as a share of decode time;
- grammar compile time for every schema of the suite (`StructuredOutputsParams` + the backend's
  `compile`, which includes llguidance's validation and first mask), min / median / max over schemas,
  each schema's time the median of `--compile-repeats` compiles; schemas that fail to compile are listed.

Invariant: greedy decoding is deterministic here, so every repetition's constrained run makes the
same tokens; a repetition whose counts differ from the warm-up is reported (and the ratio still uses
its own token counts). Prints a table; writes bench/results/structured_overhead.json.

    python bench/structured_overhead.py                 # SmolLM2-135M-Instruct, batch 16, 128 tokens
    python bench/structured_overhead.py --quick         # a smoke run: batch 4, 32 tokens, 2 repetitions
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from structured_schemas import SCHEMAS, SchemaCase

from tidepool.engine.llm import LLM
from tidepool.engine.llm_engine import LLMEngine
from tidepool.engine.sampling_params import SamplingParams
from tidepool.engine.structured_outputs import GrammarError, StructuredOutputsParams

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class MaskTimer:
    seconds: float = 0.0
    calls: int = 0
    rows: int = 0  # constrained rows masked (one per constrained token sampled)


@dataclass
class RunResult:
    kind: str  # "constrained" | "unconstrained"
    decode_tokens: int
    decode_s: float
    decode_steps: int
    total_tokens: int
    total_s: float
    token_counts: list[int]
    finish_reasons: list[str | None]
    batch: int = 0
    steps: list[tuple[int, float]] = field(default_factory=list)  # per decode step: (tokens, seconds)
    mask: MaskTimer = field(default_factory=MaskTimer)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def full_tok_s(self) -> float:
        """The batch over its median full-batch step time (a median: robust to a busy shared machine)."""
        full = [seconds for tokens, seconds in self.steps if tokens == self.batch]
        return self.batch / statistics.median(full) if full else 0.0


def robust_tok_s(runs: list[RunResult], batch: int | None = None) -> float:
    """Decode tok/s over all `runs` with each batch size's step time replaced by its median over them (a busy
    shared machine stalls some steps tenfold; medians per batch size keep those out); only full-batch steps
    when `batch` is given."""
    by_size: dict[int, list[float]] = {}
    for run in runs:
        for tokens, seconds in run.steps:
            if batch is None or tokens == batch:
                by_size.setdefault(tokens, []).append(seconds)
    tokens = sum(size * len(times) for size, times in by_size.items())
    seconds = sum(len(times) * statistics.median(times) for times in by_size.values())
    return tokens / seconds if seconds else 0.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name, .gguf file or HF folder")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions of each run")
    parser.add_argument("--compile-repeats", type=int, default=3, help="compiles per schema (median kept)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="batch 4, 32 tokens, 2 repetitions, 1 compile each")
    parser.add_argument("--out", type=Path, default=RESULTS / "structured_overhead.json")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.reps, args.compile_repeats = 4, 32, 2, 1
    return args


def resolve_model(name: str) -> str:
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    from tidepool.engine.gguf.pull import pull

    return str(pull(name, show_progress=False))


def constrained_params(case: SchemaCase, max_tokens: int) -> SamplingParams:
    spec = StructuredOutputsParams(json=case.schema, strict=True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)


def pick_cases(llm: LLM, batch: int, max_tokens: int) -> list[SchemaCase]:
    """The `batch` bounded schemas whose greedy answers are longest (one calibration run of them all), so the
    batch stays full for as many decode steps as the suite allows; cycled if the suite has fewer."""
    candidates = [c for c in SCHEMAS if c.bounded and len(json.dumps(c.example)) >= 30]
    prompts = [chat_prompt(llm, case.prompt) for case in candidates]
    params = [constrained_params(case, max_tokens) for case in candidates]
    try:
        counts = run_batch(llm.engine, "calibration", prompts, params, "calibrate").token_counts
    except RuntimeError as err:  # a schema the engine cannot serve: keep the suite's order
        print(f"calibration failed ({err}); taking the suite's first schemas", flush=True)
        counts = [0] * len(candidates)
    ranked = [case for _, case in sorted(zip(counts, candidates, strict=True), key=lambda p: -p[0])]
    return [ranked[i % len(ranked)] for i in range(batch)]


def chat_prompt(llm: LLM, prompt: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def run_batch(
    engine: LLMEngine, kind: str, prompts: list[list[int]], params: list[SamplingParams], tag: str
) -> RunResult:
    timer = MaskTimer()
    masks = engine.sampler.grammar_masks
    original = masks.apply

    def timed_apply(logits: torch.Tensor, requests: Any) -> None:
        start = time.perf_counter()
        original(logits, requests)
        timer.seconds += time.perf_counter() - start
        timer.calls += 1
        timer.rows += sum(request.request_id in masks for request in requests)

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt, sampling in zip(ids, prompts, params, strict=True):
        engine.add_request(request_id, prompt, sampling)
    masks.apply = timed_apply  # type: ignore[method-assign]
    finished: dict[str, Any] = {}
    decode_tokens = decode_steps = total_tokens = 0
    decode_s = 0.0
    steps: list[tuple[int, float]] = []
    stats = engine.last_stats
    begin = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            if engine.last_stats is not stats:  # a step that ran the model (else stats are the last step's)
                stats = engine.last_stats
                total_tokens += int(stats.step_num_generation_tokens)
                if stats.step_num_prompt_tokens == 0 and stats.step_num_generation_tokens:
                    decode_tokens += int(stats.step_num_generation_tokens)
                    decode_s += elapsed
                    decode_steps += 1
                    steps.append((int(stats.step_num_generation_tokens), elapsed))
            for output in outputs:
                if output.finished:
                    finished[output.request_id] = output
    finally:
        del masks.apply  # back to the class's method
    total_s = time.perf_counter() - begin
    errors = [out.error for out in finished.values() if out.error]
    if errors:
        raise RuntimeError(f"{kind} run: {len(errors)} requests failed, e.g. {errors[0]}")
    counts = [len(finished[i].outputs[0].token_ids) for i in ids]
    reasons = [finished[i].outputs[0].finish_reason for i in ids]
    return RunResult(kind, decode_tokens, decode_s, decode_steps, total_tokens, total_s, counts, reasons,
                     len(prompts), steps, timer)  # fmt: skip


def run_summary(run: RunResult) -> dict[str, Any]:
    """The run as JSON, its steps folded into {batch size: [steps, median seconds]}."""
    out = asdict(run)
    by_size: dict[int, list[float]] = {}
    for tokens, seconds in out.pop("steps"):
        by_size.setdefault(tokens, []).append(seconds)
    out["steps_by_batch"] = {size: [len(t), statistics.median(t)] for size, t in sorted(by_size.items())}
    return out


def compile_times(engine: LLMEngine, repeats: int) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds per schema to build its `StructuredOutputsParams` and compile it; and the failures."""
    backend = engine.grammars.backend
    _ = backend.tokenizer  # type: ignore[attr-defined]  # built once per engine; not a per-schema cost
    times: dict[str, float] = {}
    failures: dict[str, str] = {}
    for case in SCHEMAS:
        samples = []
        try:
            for _ in range(repeats):
                start = time.perf_counter()
                backend.compile(StructuredOutputsParams(json=case.schema, strict=True))
                samples.append(time.perf_counter() - start)
        except GrammarError as err:
            failures[case.name] = str(err)
            continue
        times[case.name] = statistics.median(samples)
    return times, failures


def main() -> None:
    args = parse_args()
    model = resolve_model(args.model)
    kwargs: dict[str, Any] = {"show_progress": False}
    if args.num_threads:
        kwargs["num_threads"] = args.num_threads
    llm = LLM(model, **kwargs)
    engine = llm.engine

    print(f"compiling the suite's {len(SCHEMAS)} schemas ({args.compile_repeats} times each)...", flush=True)
    times, compile_failures = compile_times(engine, args.compile_repeats)

    cases = pick_cases(llm, args.batch, args.max_tokens)
    prompts = [chat_prompt(llm, case.prompt) for case in cases]
    constrained = [constrained_params(case, args.max_tokens) for case in cases]
    warm = run_batch(engine, "constrained", prompts, constrained, "warm-c")
    free = [SamplingParams(temperature=0, max_tokens=max(1, n), ignore_eos=True) for n in warm.token_counts]
    run_batch(engine, "unconstrained", prompts, free, "warm-u")

    reps: list[dict[str, Any]] = []
    results: dict[str, list[RunResult]] = {"constrained": [], "unconstrained": []}
    for rep in range(args.reps):
        order = ("constrained", "unconstrained") if rep % 2 == 0 else ("unconstrained", "constrained")
        runs = {}
        for kind in order:
            params = constrained if kind == "constrained" else free
            runs[kind] = run_batch(engine, kind, prompts, params, f"{kind[0]}{rep}")
        c, u = runs["constrained"], runs["unconstrained"]
        results["constrained"].append(c)
        results["unconstrained"].append(u)
        if c.token_counts != warm.token_counts:
            print(f"  repetition {rep}: constrained token counts differ from the warm-up's", flush=True)
        ratio = c.decode_tok_s / u.decode_tok_s if u.decode_tok_s else float("nan")
        full_ratio = c.full_tok_s / u.full_tok_s if u.full_tok_s else float("nan")
        reps.append({"constrained": run_summary(c), "unconstrained": run_summary(u), "ratio": ratio,
                     "full_batch_ratio": full_ratio,
                     "constrained_decode_tok_s": c.decode_tok_s, "unconstrained_decode_tok_s": u.decode_tok_s,
                     "constrained_full_tok_s": c.full_tok_s, "unconstrained_full_tok_s": u.full_tok_s})  # fmt: skip
        print(f"  repetition {rep}: decode tok/s constrained {c.decode_tok_s:6.1f}, unconstrained "
              f"{u.decode_tok_s:6.1f}, ratio {ratio:.3f}; at batch {len(prompts)}: {c.full_tok_s:6.1f} vs "
              f"{u.full_tok_s:6.1f}, ratio {full_ratio:.3f}", flush=True)  # fmt: skip

    ratios = [r["ratio"] for r in reps]
    mask_s = sum(r["constrained"]["mask"]["seconds"] for r in reps)
    mask_rows = sum(r["constrained"]["mask"]["rows"] for r in reps)
    mask_calls = sum(r["constrained"]["mask"]["calls"] for r in reps)
    c_decode_s = sum(r["constrained"]["decode_s"] for r in reps)
    c_total_s = sum(r["constrained"]["total_s"] for r in reps)
    compile_ms = sorted(t * 1000 for t in times.values())
    robust = {kind: robust_tok_s(runs) for kind, runs in results.items()}
    full = {kind: robust_tok_s(runs, args.batch) for kind, runs in results.items()}
    num_full = sum(tokens == args.batch for run in results["constrained"] for tokens, _ in run.steps)
    batch_sizes = [r["constrained"]["decode_tokens"] / max(1, r["constrained"]["decode_steps"]) for r in reps]
    summary = {
        "model": model,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "schemas_in_batch": [c.name for c in cases],
        "constrained_token_counts": warm.token_counts,
        "constrained_finish_reasons": warm.finish_reasons,
        "median_ratio": statistics.median(ratios),
        "ratios": ratios,
        "robust_constrained_tok_s": robust["constrained"],
        "robust_unconstrained_tok_s": robust["unconstrained"],
        "robust_ratio": robust["constrained"] / robust["unconstrained"] if robust["unconstrained"] else None,
        "full_batch_steps": num_full,
        "full_batch_constrained_tok_s": full["constrained"],
        "full_batch_unconstrained_tok_s": full["unconstrained"],
        "full_batch_ratio": full["constrained"] / full["unconstrained"] if full["unconstrained"] else None,
        "median_constrained_decode_tok_s": statistics.median(r["constrained_decode_tok_s"] for r in reps),
        "median_unconstrained_decode_tok_s": statistics.median(r["unconstrained_decode_tok_s"] for r in reps),
        "mean_decode_batch": statistics.mean(batch_sizes),
        "mask_us_per_token": 1e6 * mask_s / max(1, mask_rows),
        "mask_ms_per_step": 1e3 * mask_s / max(1, mask_calls),
        "mask_share_of_constrained_time": mask_s / c_total_s if c_total_s else 0.0,
        "constrained_decode_s": c_decode_s,
        "compile_ms": {"min": compile_ms[0], "median": statistics.median(compile_ms), "max": compile_ms[-1]}
        if compile_ms
        else {},
        "compile_ms_per_schema": {name: t * 1000 for name, t in times.items()},
        "compile_failures": compile_failures,
        "repetitions": reps,
        "platform": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": str(getattr(engine, "device", "cpu")),
        },
    }
    print_table(summary, times)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")
    llm.engine.close()


def print_table(summary: dict[str, Any], times: dict[str, float]) -> None:
    print()
    print(f"structured outputs overhead: batch {summary['batch']}, greedy, max_tokens {summary['max_tokens']}, "
          f"{summary['reps']} alternating repetitions "
          f"(mean decode batch {summary['mean_decode_batch']:.1f})")  # fmt: skip
    print("| measure | value |")
    print("|---|---|")
    print(f"| decode tok/s, constrained (median) | {summary['median_constrained_decode_tok_s']:.1f} |")
    print(f"| decode tok/s, unconstrained (median) | {summary['median_unconstrained_decode_tok_s']:.1f} |")
    print(f"| ratio constrained / unconstrained (median) | {summary['median_ratio']:.3f} (target >= 0.9) |")
    batch = summary["batch"]
    if summary["robust_ratio"] is not None:
        print(
            f"| decode tok/s, median step per batch size: constrained / unconstrained | "
            f"{summary['robust_constrained_tok_s']:.1f} / {summary['robust_unconstrained_tok_s']:.1f} |"
        )
        print(f"| ratio, median step per batch size | {summary['robust_ratio']:.3f} (target >= 0.9) |")
    if summary["full_batch_ratio"] is not None:
        print(
            f"| decode tok/s at full batch {batch} ({summary['full_batch_steps']} steps, median step): "
            f"constrained / unconstrained | {summary['full_batch_constrained_tok_s']:.1f} / "
            f"{summary['full_batch_unconstrained_tok_s']:.1f} |"
        )
        print(f"| ratio at full batch {batch} | {summary['full_batch_ratio']:.3f} (target >= 0.9) |")
    print(f"| mask time per constrained token | {summary['mask_us_per_token']:.1f} µs |")
    print(f"| mask time per step | {summary['mask_ms_per_step']:.3f} ms |")
    print(f"| mask share of constrained run time | {100 * summary['mask_share_of_constrained_time']:.1f} % |")
    if summary["compile_ms"]:
        c = summary["compile_ms"]
        print(f"| grammar compile, {len(times)} schemas: min / median / max | "
              f"{c['min']:.2f} / {c['median']:.2f} / {c['max']:.2f} ms |")  # fmt: skip
        slowest = sorted(times, key=times.__getitem__, reverse=True)[:3]
        print(f"| slowest compiles | {', '.join(f'{n} {times[n] * 1000:.1f} ms' for n in slowest)} |")
    for name, error in summary["compile_failures"].items():
        print(f"| compile FAILED: {name} | {error[:100]} |")


if __name__ == "__main__":
    main()
