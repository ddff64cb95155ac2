"""Trace simulation of a prefill/decode fleet under Tidepool's real autoscaling policy, against baselines.

Compares on a trace (generated, or a file of requests) or on a grid of generated traces (`--sweep`):
  tidepool           `tidepool.operator.autoscaler.policy.decide` (the operator's code, unchanged)
  tidepool-reactive  the same with `is_predictive=False` (ablation: no anticipation)
  static             both pools provisioned for the trace's peak
  hpa-running, hpa-kv, hpa-waiting
                     the Kubernetes HPA (autoscaling/v2, default behavior) on vllm:num_requests_running,
                     vllm:kv_cache_usage_perc or vllm:num_requests_waiting per pod, one HPA per pool
  kubeai             KubeAI's autoscaler (moving average of in-flight requests / targetRequests), per pool
each baseline at several targets, and reports SLO attainment (TTFT, ITL, both), GPU-hours (and their
share of static peak's), scale events, and the best baseline at Tidepool's GPU-hours (interpolated
per baseline family, never extrapolated) with the margin in points; a PNG and a JSON.

Modules: autoscale_traces.py (generator, trace files), autoscale_fleet.py (calibrated replica
performance, static sizing, pods), autoscale_fluid.py (the per-tick model), autoscale_k8s.py (HPA
and KubeAI algorithms), autoscale_policies.py (controllers, baseline targets), autoscale_compare.py
(all policies on one trace, equal-GPU-hours comparison), autoscale_sweep.py (`--sweep`).

Traces: the generator (Poisson, daily cycle, bursts; a prompt/output length mix: `--prompt-len`,
`--output-len`, `--length-sigma`, or `--mix` with classes) or `--trace FILE` (CSV or JSONL with the
columns of the Azure LLM inference traces, BurstGPT, or arrival_s,prompt_tokens,output_tokens),
binned into `--dt` ticks. `--trace-scale K` multiplies a file's arrival rate by K (each tick's requests
and tokens x K; the time axis is kept); the default `fit` picks K so that static peak provisioning
uses 97% of `--gpus`, as the generator does.

Usage:
  python bench/autoscale_sim.py [--hours 24 --gpus 1000 --seed 0 --out bench/results/autoscale_sim]
  python bench/autoscale_sim.py --trace azure_conv.csv [--trace-scale fit] --out /tmp/azure
  python bench/autoscale_sim.py --sweep bench/autoscale_grids/tune.json --out /tmp/autoscale_tune

Invariants: every policy of a run sees the same trace, calibration, static sizing and replica bounds;
the numbers printed are the simulator's output for the stated command, nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autoscale_compare import run_all
from autoscale_fleet import Params, Perf, fit_scale
from autoscale_traces import Mix, Trace, fixed_mix, generate, load_trace_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--gpus", type=int, default=1000, help="GPU budget; static peak provisioning uses ~97%%")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dt", type=float, default=2.0, help="tick seconds")
    parser.add_argument("--trough", type=float, default=0.1, help="night load / day peak")
    parser.add_argument("--bursts-per-hour", type=float, default=1.0)
    parser.add_argument("--speedup", type=float, default=12.0, help="GPU-class replica vs measured CPU times")
    parser.add_argument("--batch-speedup", type=float, default=100.0, help="same, for the per-sequence step time")
    parser.add_argument("--prompt-len", type=float, default=512, help="generator: mean prompt tokens")
    parser.add_argument("--output-len", type=float, default=256, help="generator: mean output tokens")
    parser.add_argument("--length-sigma", type=float, default=0.0, help="generator: lognormal log-sd per request")
    parser.add_argument(
        "--mix",
        help='generator length mix as JSON: [{"share", "prompt", "output", "sigma"?, '
        '"burst_share"?}, ...] (overrides the three above)',
    )
    parser.add_argument("--trace", type=Path, help="trace file (CSV or JSONL) instead of the generator")
    parser.add_argument("--trace-scale", default="fit", help="arrival-rate multiplier for --trace, or 'fit'")
    parser.add_argument("--pod-start-s", type=float, default=90.0, help="scheduling + image + model load")
    parser.add_argument("--slo-ttft", type=float, default=1.0)
    parser.add_argument("--slo-itl", type=float, default=0.06)
    parser.add_argument("--kv-target", type=float, default=0.6)
    parser.add_argument("--queue-target", type=float, default=1.0)
    parser.add_argument("--down-seconds", type=float, default=300.0)
    parser.add_argument("--max-step-percent", type=float, default=100.0, help="maxStepPercent of the policy")
    parser.add_argument("--interval", type=float, default=15.0, help="Tidepool's decision interval (s)")
    parser.add_argument("--window", type=float, default=60.0, help="metrics window (s)")
    parser.add_argument("--static-headroom", type=float, default=1.15, help="static = peak demand x this")
    parser.add_argument("--sweep", type=Path, help="grid JSON (bench/autoscale_grids/*.json): run every trace")
    parser.add_argument("--workers", type=int, default=2, help="--sweep: processes")
    parser.add_argument("--out", default="bench/results/autoscale_sim")
    return parser


def perf_from(args: argparse.Namespace) -> Perf:
    return Perf.calibrated(args.speedup, args.batch_speedup)


def params_from(args: argparse.Namespace) -> Params:
    return Params(
        dt=args.dt,
        gpus=args.gpus,
        pod_start_s=args.pod_start_s,
        slo_ttft=args.slo_ttft,
        slo_itl=args.slo_itl,
        kv_target=args.kv_target,
        queue_target=args.queue_target,
        down_seconds=args.down_seconds,
        max_step_percent=args.max_step_percent,
        window_s=args.window,
        interval_s=args.interval,
        static_headroom=args.static_headroom,
    )


def mix_from(args: argparse.Namespace) -> Mix:
    if args.mix:
        return Mix.from_json("cli", json.loads(args.mix))
    return fixed_mix(args.prompt_len, args.output_len, args.length_sigma)


def trace_from(args: argparse.Namespace, perf: Perf, params: Params) -> Trace:
    if args.trace is None:
        return generate(
            args.hours,
            args.dt,
            args.trough,
            args.bursts_per_hour,
            args.seed,
            mix_from(args),
            lambda unit: fit_scale(perf, params, unit),
            name=f"generated seed {args.seed}",
        )
    trace = load_trace_file(args.trace, args.dt)
    factor = fit_scale(perf, params, trace) if args.trace_scale == "fit" else float(args.trace_scale)
    return trace.scaled(factor)


def print_report(run: dict) -> None:
    static = run["static"]
    print(
        f"trace {run['trace']}: {run['hours']:.3g} h, {run['requests']:,.0f} requests, "
        f"peak {run['peak_rate']:.0f} req/s, "
        f"mean prompt {run['mean_prompt']:.0f} / output {run['mean_output']:.0f} tokens"
    )
    print(f"static peak provisioning: prefill {static['prefill']} + decode {static['decode']} GPUs")
    print(f"{'policy':<52} {'SLO att.':>9} {'TTFT att.':>9} {'ITL att.':>9} {'GPU-h':>8} {'vs peak':>8} {'events':>7}")
    for r in run["results"]:
        print(
            f"{r['policy']:<52} {r['slo_attainment']:9.2%} {r['ttft_attainment']:9.2%} {r['itl_attainment']:9.2%} "
            f"{r['gpu_hours']:8.0f} {r['gpu_share']:8.0%} {r['scale_events']:7d}"
        )
    print()
    for policy, by_key in run["comparison"].items():
        c = by_key["slo_attainment"]
        r = next(x for x in run["results"] if x["policy"] == policy)
        best = (
            "None (outside every family's GPU-hours)"
            if c["best_at_equal_gpu_hours"] is None
            else (f"{c['best_at_equal_gpu_hours']:.2%} ({c['best_family']}), margin {c['margin_points']:+.2f} points")
        )
        richer = c["best_with_more_gpu_hours"]
        print(f"{policy}: SLO attainment {r['slo_attainment']:.2%} at {r['gpu_share']:.0%} of peak-static GPU-hours")
        print(f"  best baseline at equal GPU-hours: {best}")
        print(
            f"  best baseline with >= its GPU-hours: {'None' if richer is None else f'{richer:.2%}'}"
            + (f" ({c['best_with_more_gpu_hours_policy']})" if richer is not None else "")
        )


def plot_run(run: dict, path: Path, title: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {r["policy"]: r for r in run["results"]}
    tidepool = results["tidepool"]
    richer = [r for r in run["results"] if r["family"] not in ("tidepool", "static")]
    richer = [r for r in richer if r["gpu_hours"] >= tidepool["gpu_hours"]]
    shown = [tidepool, results["tidepool-reactive"], results["static"]]
    if richer:
        shown.append(min(richer, key=lambda r: r["gpu_hours"]))  # the cheapest baseline spending at least as much
    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    base = tidepool["series"]
    axes[0].plot(base["t"], base["rate"], color="black", lw=0.8)
    axes[0].set_ylabel("load (req/s)")
    for res, color in zip(shown, ("tab:blue", "tab:cyan", "tab:gray", "tab:red"), strict=False):
        s = res["series"]
        label = res["policy"]
        axes[1].plot(s["t"], np.add(s["prefill"], s["decode"]), color=color, lw=0.9, label=label)
        axes[2].plot(s["t"], np.minimum(s["ttft"], 10), color=color, lw=0.6, label=label)
        axes[3].plot(s["t"], np.minimum(np.array(s["itl"]) * 1000, 300), color=color, lw=0.6, label=label)
    axes[1].set_ylabel("GPUs (prefill + decode)")
    axes[2].axhline(args.slo_ttft, ls="--", color="k", lw=0.8)
    axes[2].set_ylabel("TTFT (s, capped 10)")
    axes[3].axhline(args.slo_itl * 1000, ls="--", color="k", lw=0.8)
    axes[3].set_ylabel("ITL / step (ms)")
    axes[3].set_xlabel("hour")
    axes[1].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    perf, params = perf_from(args), params_from(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep is not None:
        from autoscale_sweep import run_sweep

        return run_sweep(args.sweep, perf, params, out, workers=args.workers)
    started = time.perf_counter()
    trace = trace_from(args, perf, params)
    run = run_all(trace, perf, params, record_series=True)
    elapsed = time.perf_counter() - started
    print_report(run)
    runs = len(run["results"])
    print(f"simulated {runs} policies in {elapsed:.1f} s ({elapsed / runs:.2f} s per policy, trace included)")
    summary = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "elapsed_s": elapsed}
    summary.update({k: v for k, v in run.items() if k != "results"})
    summary["results"] = [{k: v for k, v in r.items() if k != "series"} for r in run["results"]]
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    title = f"autoscale_sim: {trace.name}, {trace.hours:.3g} h, {args.gpus} GPUs"
    plot_run(run, out.with_suffix(".png"), title, args)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
