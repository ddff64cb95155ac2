"""One trace under every policy, and the comparison at equal GPU-hours.

Role: `run_all` runs Tidepool's policy (predictive, and reactive-only as an ablation), static peak
and every baseline of autoscale_policies.py on one trace; `compare` computes, without picking by
hand, the best baseline at the policy's GPU-hours: per baseline family, the attainment at the
policy's GPU-hours by linear interpolation between that family's runs ordered by GPU-hours (None
outside the family's range: no extrapolation), then the max over families; and the best
attainment among all baseline runs that spent at least the policy's GPU-hours.

Invariants: the same trace, sizing and bounds for every policy; results carry no series unless
asked (the sweep keeps only numbers).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict

from autoscale_fleet import Controller, Params, Perf, static_replicas
from autoscale_fluid import simulate
from autoscale_policies import (
    FAMILIES,
    StaticController,
    TidepoolController,
    baseline_controller,
    baseline_grid,
)
from autoscale_traces import Trace

ATTAINMENTS = ("slo_attainment", "ttft_attainment", "itl_attainment")


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """y at x on the polyline through (x, y) points ordered by x; None outside [min x, max x]."""
    if not points:
        return None
    pts = sorted(points)
    if x < pts[0][0] or x > pts[-1][0]:
        return None
    exact = [y for px, y in pts if px == x]
    if exact:
        return max(exact)
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 < x < x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def compare(tidepool: dict, baselines: Sequence[dict], key: str = "slo_attainment") -> dict:
    """Best baseline at the policy's GPU-hours (interpolated per family) and among runs spending at least as much."""
    gpu_h = tidepool["gpu_hours"]
    per_family: dict[str, float | None] = {}
    for family in sorted({b["family"] for b in baselines}):
        points = [(b["gpu_hours"], b[key]) for b in baselines if b["family"] == family]
        per_family[family] = interpolate(points, gpu_h)
    known = {f: v for f, v in per_family.items() if v is not None}
    best_family = max(known, key=lambda f: known[f]) if known else None
    richer = [b for b in baselines if b["gpu_hours"] >= gpu_h]
    best_richer = max(richer, key=lambda b: b[key]) if richer else None
    best = known[best_family] if best_family is not None else None
    return {
        "metric": key,
        "at_equal_gpu_hours_by_family": per_family,
        "best_at_equal_gpu_hours": best,
        "best_family": best_family,
        "margin_points": 100 * (tidepool[key] - best) if best is not None else None,
        "best_with_more_gpu_hours": best_richer[key] if best_richer else None,
        "best_with_more_gpu_hours_policy": best_richer["policy"] if best_richer else None,
    }


def run_all(
    trace: Trace,
    perf: Perf,
    params: Params,
    record_series: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Every policy on `trace`; returns sizing, per-policy results and the comparison."""
    static = static_replicas(perf, params, trace)
    initial = static_replicas(perf, params, trace, until_s=600.0)  # sized for the first 10 minutes
    mean_prompt = float(trace.prompt_tokens.sum() / trace.arrivals.sum())
    mean_output = float(trace.output_tokens.sum() / trace.arrivals.sum())
    runs: list[tuple[str, Controller, dict[str, int]]] = [
        ("tidepool", TidepoolController(params, static, is_predictive=True), initial),
        ("tidepool", TidepoolController(params, static, is_predictive=False), initial),
        ("static", StaticController(), static),
    ]
    specs = baseline_grid(perf, mean_prompt, mean_output)
    runs += [(spec.family, baseline_controller(spec, static), initial) for spec in specs]
    results = []
    for family, controller, start in runs:
        result = simulate(controller, trace, perf, params, start, record_series)
        result["family"] = family
        results.append(result)
        if progress:
            progress(result["policy"])
    by_name = {r["policy"]: r for r in results}
    peak = by_name["static"]["gpu_hours"]
    for r in results:
        r["gpu_share"] = r["gpu_hours"] / peak
    baselines = [r for r in results if r["family"] in FAMILIES]
    return {
        "trace": trace.name,
        "hours": trace.hours,
        "requests": float(trace.arrivals.sum()),
        "peak_rate": float(trace.rate.max()),
        "mean_prompt": mean_prompt,
        "mean_output": mean_output,
        "static": static,
        "initial": initial,
        "params": asdict(params),
        "results": results,
        "comparison": {
            policy: {key: compare(by_name[policy], baselines, key) for key in ATTAINMENTS}
            for policy in ("tidepool", "tidepool-reactive")
        },
    }
