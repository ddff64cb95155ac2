"""Trace simulation of a prefill/decode fleet under Tidepool's real autoscaling policy.

Compares, on one seeded bursty trace (Poisson arrivals, a daily cycle, random bursts of 1.3-1.6x for
5-15 min that build over 2 min):
  tidepool   `tidepool.operator.autoscaler.policy.decide` (the operator's code, unchanged)
  static     both pools provisioned for the trace's peak
  naive-hpa  the HPA algorithm on `vllm:num_requests_waiting` per replica (what a KEDA
             ScaledObject on that metric does), at several targets, to compare at equal GPU-hours
and reports SLO attainment (TTFT and ITL), GPU-hours and scale events, plus a PNG.

Model (a fluid model per tick: replicas of a pool are identical and the router balances them,
so the fleet is simulated per pool, not per replica, and 24 h of 1,000 GPUs take seconds):
- Per-replica performance is calibrated from our own measurements on the 2-core dev machine
  (smollm-135m, float32; bench/README.md and bench/results/*.json):
  prefill 279 tok/s (1,932-token prompt in 6.92 s, prefix_cache_off.json median TTFT);
  decode step 108.7 ms at batch 1 (offline_throughput json `bs1_step_s`) and ~350 ms at ~16
  sequences (serve_smollm_135m_load: TPOT mean 348 ms), i.e. step(b) = 93 ms + 16.1 ms x b;
  KV capacity 2 GiB / 46,080 B per token (30 layers x 3 KV heads x 64 x 2 x fp32) = 46,603 tokens.
  A GPU-class replica is modelled with two documented factors: `--speedup` (default 12) on prefill
  throughput and the fixed part of a decode step (weight reads: memory-bound on a GPU), and
  `--batch-speedup` (default 100) on the per-sequence part (compute: the CPU is compute-bound at
  batch, a GPU is not; its FLOP/byte ratio is ~50x the CPU's), giving prefill 3,350 tok/s and
  step(b) = 7.7 ms + 0.16 ms x b, with the same KV capacity in tokens (so KV, not ITL, binds first,
  as on GPUs).
- Prefill: utilization rho = prompt tokens arriving / capacity; TTFT of a tick's arrivals =
  prompt time x 1.5 / (1 - rho) (queueing at load; p95 ~ 1.5x the mean wait) + backlog / capacity.
  In-flight prefills per replica (what the engine's running+waiting gauges show) = rho / (1 - rho).
- Decode: sequences are admitted while KV has room; step time = step(batch); ITL = step time;
  requests that wait for a decode slot see one gap of at least a tick (an ITL violation).
- A request meets the SLO when its TTFT <= slo.ttft and its decode ITL <= slo.itl; TTFT misses
  (per arrival tick) and ITL misses (per decode admission) are counted separately and combined
  as independent: attainment = (1 - TTFT miss rate) x (1 - ITL miss rate).
- New pods become ready after `--pod-start-s` (scheduling + image + model load); pods beyond the
  GPU budget stay Pending/unschedulable (the policy sees them: capacity-aware). GPU-hours count
  every scheduled pod, loading or ready.

Usage: python bench/autoscale_sim.py [--hours 24 --gpus 1000 --seed 0 --out bench/results/autoscale_sim]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tidepool.operator.autoscaler.policy import decide
from tidepool.operator.autoscaler.policy_types import AutoscaleConfig, History, PoolBounds, PoolSnapshot, PoolState

# Measured on the dev machine (see the module docstring for the source of each number).
CPU_PREFILL_TPS = 1932 / 6.919
CPU_STEP_BS1_S = 0.1087
CPU_STEP_PER_SEQ_S = (0.348 - 0.1087) / 15
KV_CAPACITY_TOKENS = 2 * 1024**3 // 46_080


@dataclass(slots=True)
class Perf:
    prefill_tps: float
    step0_s: float
    step_per_seq_s: float
    kv_tokens: float
    prompt_len: float
    output_len: float

    def step(self, batch: float) -> float:
        return self.step0_s + self.step_per_seq_s * batch

    @property
    def context_tokens(self) -> float:  # mean KV held by a running sequence
        return self.prompt_len + self.output_len / 2


@dataclass(slots=True)
class Pool:
    desired: int
    pending: list[float] = field(default_factory=list)  # ready times of loading pods
    ready: int = 0
    unschedulable: int = 0

    @property
    def scheduled(self) -> int:
        return self.ready + len(self.pending)


def make_trace(
    hours: float, dt: float, peak_rate: float, trough: float, bursts_per_hour: float, seed: int, ramp_s: float = 120.0
):
    """Arrivals per tick: Poisson around peak x daily cycle (minimum 3am, maximum 3pm) x bursts."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, hours * 3600, dt, dtype=float)
    daily = trough + (1 - trough) * (0.5 - 0.5 * np.cos(2 * np.pi * (t - 3 * 3600) / 86400))
    burst = np.ones_like(t)
    for start in rng.uniform(0, hours * 3600, rng.poisson(bursts_per_hour * hours)):
        length = rng.uniform(300, 900)
        ramp = np.clip((t - start) / ramp_s, 0.0, 1.0) * (t < start + length)  # bursts build over ramp_s
        burst *= 1 + ramp * (rng.uniform(1.3, 1.6) - 1)
    rate = peak_rate * daily * burst
    return t, rate, rng.poisson(rate * dt)


def weighted_p95(values: list[float], weights: list[float]) -> float | None:
    w = np.asarray(weights)
    if w.sum() <= 0:
        return None
    v = np.asarray(values)
    order = np.argsort(v)
    cum = np.cumsum(w[order])
    return float(v[order][np.searchsorted(cum, 0.95 * cum[-1])])


class NaiveHpa:
    """The Kubernetes HPA algorithm on waiting requests per replica (10% tolerance, 300 s down window)."""

    def __init__(self, target: float, bounds: dict[str, PoolBounds]) -> None:
        self.target, self.bounds, self.recs = target, bounds, []

    def decide(self, waiting: dict[str, float], current: dict[str, int], ready: dict[str, int], now: float):
        raw = {}
        for name, cur in current.items():
            ratio = waiting[name] / max(ready[name], 1) / self.target
            raw[name] = cur if abs(ratio - 1) <= 0.1 else math.ceil(ratio * max(ready[name], 1))
            raw[name] = max(raw[name], cur) if ratio > 1 else raw[name]
        self.recs = [(t, r) for t, r in self.recs if t > now - 300] + [(now, raw)]
        out = {}
        for name, cur in current.items():
            value = min(raw[name], max(r[name] for _, r in self.recs)) if raw[name] < cur else raw[name]
            value = min(value, cur + max(cur, 4))
            out[name] = min(max(value, self.bounds[name].min_replicas), self.bounds[name].max_replicas)
        return out


def simulate(
    policy: str, args, perf: Perf, trace, static: dict[str, int], hpa_target: float = 0.0, peak: dict | None = None
) -> dict:
    t_axis, rate, arrivals = trace
    dt = args.dt
    # Both autoscalers get the same bounds: 1 .. 1.2 x the static peak of each pool.
    peak = peak or static
    bounds = {name: PoolBounds(1, math.ceil(1.2 * peak[name])) for name in ("prefill", "decode")}
    config = AutoscaleConfig(
        pools=bounds,
        ttft_p95_s=args.slo_ttft,
        itl_p95_s=args.slo_itl,
        kv_cache_target=args.kv_target,
        queue_depth_target=args.queue_target,
        down_seconds=args.down_seconds,
        max_step_percent=args.max_step_percent,
        pd_ratio_min=0.1,
        pd_ratio_max=4.0,
    )
    hpa = NaiveHpa(hpa_target, bounds)
    pools = {name: Pool(desired=static[name], ready=static[name]) for name in ("prefill", "decode")}
    history: History | None = None
    backlog_tokens = decode_waiting = running = 0.0
    window: dict[str, list[tuple[float, float, float]]] = {"ttft": [], "itl": []}  # (time, value, weight)
    served_decode = 0.0
    totals = dict(requests=0.0, ttft_bad=0.0, itl_bad=0.0, gpu_s=0.0, events=0)
    series = {k: [] for k in ("t", "rate", "prefill", "decode", "ttft", "itl")}
    for i, now in enumerate(t_axis):
        for pool in pools.values():  # pods finishing their start become ready
            done = [r for r in pool.pending if r <= now]
            pool.ready += len(done)
            pool.pending = [r for r in pool.pending if r > now]
        n = float(arrivals[i])
        # Prefill pool.
        rp = pools["prefill"].ready
        cap = rp * perf.prefill_tps
        rho = min(n * perf.prompt_len / dt / cap, 0.95) if cap else 0.95
        backlog_tokens += n * perf.prompt_len
        wait = backlog_tokens / cap - perf.prompt_len / perf.prefill_tps if cap else args.pod_start_s
        ttft = perf.prompt_len / perf.prefill_tps * 1.5 / (1 - rho) + max(wait - dt, 0.0)
        handed = min(backlog_tokens, cap * dt) / perf.prompt_len
        backlog_tokens -= handed * perf.prompt_len
        # Decode pool.
        rd = pools["decode"].ready
        waited = decode_waiting  # handed off before this tick: admitting them now means a gap >= dt
        decode_waiting += handed
        slots = rd * min(perf.kv_tokens / perf.context_tokens, 256)
        admit = max(min(decode_waiting, slots - running), 0.0)
        running += admit
        decode_waiting -= admit
        step = perf.step(running / rd) if rd else math.inf
        occupied = running  # what the engine gauges show during the tick
        # Exponential drain: a sequence lives output_len steps; short lives must not empty the pool per tick.
        finished = running * (1 - math.exp(-dt / (step * perf.output_len))) if rd else 0.0
        tokens = (running - finished / 2) * dt / step if rd else 0.0
        running -= finished
        served_decode += admit
        totals["requests"] += n
        totals["ttft_bad"] += n if ttft > args.slo_ttft else 0.0
        totals["itl_bad"] += admit if step > args.slo_itl else min(admit, waited)
        window["ttft"].append((now, ttft, n))
        window["itl"].append((now, step if rd else 0.0, tokens))
        if decode_waiting > 0:
            window["itl"].append((now, dt, decode_waiting))
        totals["gpu_s"] += sum(p.scheduled for p in pools.values()) * dt

        if i % int(args.interval / dt) == 0 and policy != "static" and now >= args.window:
            cut = now - args.window
            for key in window:
                window[key] = [w for w in window[key] if w[0] > cut]
            current = {name: p.desired for name, p in pools.items()}
            if policy == "tidepool":
                snaps = {
                    "prefill": PoolSnapshot(
                        ttft_p95_s=weighted_p95([w[1] for w in window["ttft"]], [w[2] for w in window["ttft"]]),
                        num_requests=sum(w[2] for w in window["ttft"]),
                        num_waiting=backlog_tokens / perf.prompt_len + rp * rho * rho / (1 - rho),
                        num_running=rp * rho,
                        num_pods_scraped=rp,
                        window_s=args.window,
                    ),
                    "decode": PoolSnapshot(
                        itl_p95_s=weighted_p95([w[1] for w in window["itl"]], [w[2] for w in window["itl"]]),
                        num_requests=served_decode,
                        kv_cache_usage=min(occupied * perf.context_tokens / (rd * perf.kv_tokens), 1.0) if rd else None,
                        num_waiting=decode_waiting,
                        num_running=occupied,
                        num_pods_scraped=rd,
                        window_s=args.window,
                    ),
                }
                states = {name: PoolState(p.desired, p.unschedulable) for name, p in pools.items()}
                decision = decide(config, snaps, states, history, now)
                history, target = decision.history, dict(decision.replicas)
            else:
                waiting = {
                    "prefill": backlog_tokens / perf.prompt_len + rp * rho * rho / (1 - rho),
                    "decode": decode_waiting,
                }
                target = hpa.decide(waiting, current, {k: p.ready for k, p in pools.items()}, now)
            served_decode = 0.0
            if target != current:
                totals["events"] += 1
            _actuate(pools, target, now, args)
        if i % int(60 / dt) == 0:
            for key, value in (("t", now / 3600), ("rate", rate[i]), ("ttft", ttft), ("itl", step if rd else 0.0)):
                series[key].append(float(value))
            series["prefill"].append(pools["prefill"].scheduled)
            series["decode"].append(pools["decode"].scheduled)
    return {
        "policy": policy if policy != "naive-hpa" else f"naive-hpa (waiting target {hpa_target:g})",
        # TTFT and ITL misses treated as independent (a request meets the SLO when it meets both).
        "slo_attainment": (1 - totals["ttft_bad"] / totals["requests"]) * (1 - totals["itl_bad"] / totals["requests"]),
        "ttft_attainment": 1 - totals["ttft_bad"] / totals["requests"],
        "itl_attainment": 1 - totals["itl_bad"] / totals["requests"],
        "gpu_hours": totals["gpu_s"] / 3600,
        "scale_events": totals["events"],
        "series": series,
    }


def _actuate(pools: dict[str, Pool], target: dict[str, int], now: float, args) -> None:
    """Apply desired replicas: new pods load for pod_start_s; pods over the GPU budget stay Pending."""
    for name, pool in pools.items():
        pool.desired = target[name]
        while pool.scheduled > pool.desired:  # remove loading pods first, then ready ones
            if pool.pending:
                pool.pending.pop()
            else:
                pool.ready -= 1
    free = args.gpus - sum(p.scheduled for p in pools.values())
    for pool in pools.values():
        want = pool.desired - pool.scheduled
        start = max(min(want, free), 0)
        pool.pending.extend([now + args.pod_start_s] * start)
        free -= start
        pool.unschedulable = want - start


def static_replicas(perf: Perf, peak_rate: float, args) -> dict[str, float]:
    """Replicas (fractional; round up) serving `peak_rate` at the per-replica targets the policy uses."""
    rho = args.queue_target / (1 + args.queue_target)  # in-flight per replica = rho / (1 - rho)
    batch = args.kv_target * perf.kv_tokens / perf.context_tokens
    per_replica = batch / perf.step(batch) / perf.output_len
    return {"prefill": peak_rate * perf.prompt_len / (perf.prefill_tps * rho), "decode": peak_rate / per_replica}


def plot(results: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    base = results[0]["series"]
    axes[0].plot(base["t"], base["rate"], color="black", lw=0.8)
    axes[0].set_ylabel("load (req/s)")
    for res, color in zip(results, ("tab:blue", "tab:gray", "tab:red"), strict=False):
        s = res["series"]
        axes[1].plot(s["t"], np.add(s["prefill"], s["decode"]), color=color, lw=0.9, label=res["policy"])
        axes[2].plot(s["t"], np.minimum(s["ttft"], 10), color=color, lw=0.6, label=res["policy"])
        axes[3].plot(s["t"], np.minimum(np.array(s["itl"]) * 1000, 300), color=color, lw=0.6, label=res["policy"])
    axes[1].set_ylabel("GPUs (prefill + decode)")
    axes[2].axhline(args.slo_ttft, ls="--", color="k", lw=0.8)
    axes[2].set_ylabel("TTFT (s, capped 10)")
    axes[3].axhline(args.slo_itl * 1000, ls="--", color="k", lw=0.8)
    axes[3].set_ylabel("ITL / step (ms)")
    axes[3].set_xlabel("hour")
    axes[1].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"autoscale_sim: {args.hours:g} h, {args.gpus} GPUs, seed {args.seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--gpus", type=int, default=1000, help="GPU budget; static peak provisioning uses ~all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dt", type=float, default=2.0, help="tick seconds")
    parser.add_argument("--trough", type=float, default=0.1, help="night load / day peak")
    parser.add_argument("--bursts-per-hour", type=float, default=1.0)
    parser.add_argument("--speedup", type=float, default=12.0, help="GPU-class replica vs measured CPU times")
    parser.add_argument("--batch-speedup", type=float, default=100.0, help="same, for the per-sequence step time")
    parser.add_argument("--prompt-len", type=float, default=512)
    parser.add_argument("--output-len", type=float, default=256)
    parser.add_argument("--pod-start-s", type=float, default=90.0, help="scheduling + image + model load")
    parser.add_argument("--slo-ttft", type=float, default=1.0)
    parser.add_argument("--slo-itl", type=float, default=0.06)
    parser.add_argument("--kv-target", type=float, default=0.6)
    parser.add_argument("--queue-target", type=float, default=1.0)
    parser.add_argument("--down-seconds", type=float, default=300.0)
    parser.add_argument("--max-step-percent", type=float, default=20.0, help="maxStepPercent of the policy")
    parser.add_argument("--interval", type=float, default=15.0, help="decision interval (s)")
    parser.add_argument("--window", type=float, default=60.0, help="metrics window (s)")
    parser.add_argument("--static-headroom", type=float, default=1.15, help="static = peak rate x this")
    parser.add_argument("--hpa-targets", default="0.25,0.5,1,2,4")
    parser.add_argument("--out", default="bench/results/autoscale_sim")
    args = parser.parse_args(argv)
    perf = Perf(
        CPU_PREFILL_TPS * args.speedup,
        (CPU_STEP_BS1_S - CPU_STEP_PER_SEQ_S) / args.speedup,
        CPU_STEP_PER_SEQ_S / args.batch_speedup,
        KV_CAPACITY_TOKENS,
        args.prompt_len,
        args.output_len,
    )
    started = time.perf_counter()
    _, shape, _ = make_trace(args.hours, args.dt, 1.0, args.trough, args.bursts_per_hour, args.seed)
    per_unit = static_replicas(perf, 1.0, args)
    scale = 0.97 * args.gpus / args.static_headroom / (shape.max() * (per_unit["prefill"] + per_unit["decode"]))
    trace = make_trace(args.hours, args.dt, scale, args.trough, args.bursts_per_hour, args.seed)
    peak_rate = float(trace[1].max()) * args.static_headroom
    static = {k: math.ceil(v) for k, v in static_replicas(perf, peak_rate, args).items()}
    first = static_replicas(perf, float(trace[1][: int(600 / args.dt)].max()), args)
    initial = {k: math.ceil(v) for k, v in first.items()}  # sized for the first 10 minutes
    results = [
        simulate("tidepool", args, perf, trace, initial, peak=static),
        simulate("static", args, perf, trace, static),
    ]
    hpas = [simulate("naive-hpa", args, perf, trace, initial, float(x), static) for x in args.hpa_targets.split(",")]
    elapsed = time.perf_counter() - started
    tidepool, peak = results[0], results[1]
    # The naive policy at (about) Tidepool's GPU-hours: the cheapest target that spends at least as much.
    richer = [h for h in hpas if h["gpu_hours"] >= tidepool["gpu_hours"]]
    matched = min(richer, key=lambda h: h["gpu_hours"]) if richer else max(hpas, key=lambda h: h["gpu_hours"])
    results.append(matched)

    print(f"trace: {args.hours:g} h, peak {trace[1].max():.0f} req/s, {trace[2].sum():,} requests, seed {args.seed}")
    print(f"static peak provisioning: prefill {static['prefill']} + decode {static['decode']} GPUs")
    print(f"{'policy':<34} {'SLO att.':>9} {'TTFT att.':>9} {'ITL att.':>9} {'GPU-h':>8} {'vs peak':>8} {'events':>7}")
    for res in [tidepool, peak, *hpas]:
        share = res["gpu_hours"] / peak["gpu_hours"]
        print(
            f"{res['policy']:<34} {res['slo_attainment']:9.2%} {res['ttft_attainment']:9.2%} "
            f"{res['itl_attainment']:9.2%} {res['gpu_hours']:8.0f} {share:8.0%} {res['scale_events']:7d}"
        )
    print()
    print("Tidepool policy:")
    print(f"SLO attainment: {100 * tidepool['slo_attainment']:.1f}%")
    print(f"GPU-hours vs peak-static: {100 * tidepool['gpu_hours'] / peak['gpu_hours']:.0f}%")
    print(
        f"naive HPA at >= equal GPU-hours ({matched['policy']}, {matched['gpu_hours']:.0f} GPU-h): "
        f"SLO attainment {100 * matched['slo_attainment']:.1f}%"
    )
    print(f"simulated in {elapsed:.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {k: v for k, v in vars(args).items()}
    summary["elapsed_s"] = elapsed
    summary["results"] = [{k: v for k, v in r.items() if k != "series"} for r in [tidepool, peak, *hpas]]
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(results, out.with_suffix(".png"), args)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
