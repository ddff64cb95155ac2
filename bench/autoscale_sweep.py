"""`autoscale_sim.py --sweep GRID`: every policy on every trace of a grid, and the distribution of the results.

Role: load a grid (bench/autoscale_grids/*.json), run autoscale_compare.run_all on each of its
traces in a process pool (progress bar on stderr), print one row per trace and the distribution
(median, min) of Tidepool's attainment and GPU-hour share, and write `<out>.json` and `<out>.png`
(SLO miss rate vs GPU-hour share of every policy on every trace; per-trace margin over the best
baseline at equal GPU-hours).

Grid JSON: {"description": str, "defaults": {field: value}, "mixes": {name: [class, ...]},
"traces": [{"name": str, field: value, ...}]}, fields: seed, hours, trough, bursts_per_hour,
pod_start_s, mix (a name from "mixes"). tune.json is for tuning; heldout.json (disjoint seeds) is for
reporting: a change tuned on heldout.json's traces makes its numbers meaningless.

Invariants: the traces run in grid order in the output whatever order they finish in; the figures
printed are those written to the JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from autoscale_compare import run_all
from autoscale_fleet import Params, Perf, fit_scale
from autoscale_traces import Mix, generate
from tqdm import tqdm

POLICIES = ("tidepool", "tidepool-reactive")


@dataclass(frozen=True, slots=True)
class TraceSpec:
    name: str
    seed: int
    hours: float = 24.0
    trough: float = 0.1
    bursts_per_hour: float = 1.0
    pod_start_s: float = 90.0
    mix: str = "fixed"


def load_grid(path: Path) -> tuple[dict[str, Any], list[TraceSpec], dict[str, Mix]]:
    grid = json.loads(path.read_text())
    mixes = {name: Mix.from_json(name, spec) for name, spec in grid.get("mixes", {}).items()}
    defaults = grid.get("defaults", {})
    specs = [TraceSpec(**{**defaults, **entry}) for entry in grid["traces"]]
    for spec in specs:
        if spec.mix not in mixes:
            raise ValueError(f"{path}: trace {spec.name} uses mix {spec.mix!r}, not in 'mixes'")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: trace names repeat")
    return grid, specs, mixes


def run_spec(spec: TraceSpec, mix: Mix, perf: Perf, params: Params) -> dict:
    """One grid trace under every policy (runs in a worker process)."""
    params = replace(params, pod_start_s=spec.pod_start_s)
    trace = generate(
        spec.hours,
        params.dt,
        spec.trough,
        spec.bursts_per_hour,
        spec.seed,
        mix,
        lambda unit: fit_scale(perf, params, unit),
        name=spec.name,
    )
    started = time.perf_counter()
    run = run_all(trace, perf, params)
    run["elapsed_s"] = time.perf_counter() - started
    run["spec"] = asdict(spec)
    return run


def distribution(values: list[float]) -> dict[str, float | None]:
    return {
        "median": statistics.median(values) if values else None,
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }


def summarize(runs: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for policy in POLICIES:
        rows = [next(r for r in run["results"] if r["policy"] == policy) for run in runs]
        comps = [run["comparison"][policy]["slo_attainment"] for run in runs]
        margins = [c["margin_points"] for c in comps if c["margin_points"] is not None]
        out[policy] = {
            "slo_attainment": distribution([r["slo_attainment"] for r in rows]),
            "ttft_attainment": distribution([r["ttft_attainment"] for r in rows]),
            "itl_attainment": distribution([r["itl_attainment"] for r in rows]),
            "gpu_share": distribution([r["gpu_share"] for r in rows]),
            "margin_points": distribution(margins),
            "traces_without_equal_gpu_hours_baseline": sum(c["best_at_equal_gpu_hours"] is None for c in comps),
            "traces_with_positive_margin": sum(m > 0 for m in margins),
        }
    out["fixed_settings"] = fixed_settings(runs)
    return out


def fixed_settings(runs: list[dict]) -> list[dict]:
    """Every policy setting as an admin would run it: one setting (family and utilization level) for every
    trace of the grid, not re-picked per trace; its attainment and GPU-hour share distributions."""
    by_setting: dict[str, list[dict]] = {}
    for run in runs:
        for r in run["results"]:
            by_setting.setdefault(r["policy"].split(" (")[0], []).append(r)
    return [
        {
            "setting": name,
            "slo_attainment": distribution([r["slo_attainment"] for r in rows]),
            "gpu_share": distribution([r["gpu_share"] for r in rows]),
        }
        for name, rows in by_setting.items()
        if len(rows) == len(runs)
    ]


def _pct(x: float | None, digits: int = 2) -> str:
    return "None" if x is None else f"{100 * x:.{digits}f}%"


def print_rows(runs: list[dict], summary: dict) -> None:
    print(
        f"{'trace':<8} {'bursts/h':>8} {'trough':>6} {'start s':>7} {'mix':<12} {'p:d':>5} "
        f"{'TTFT':>8} {'ITL':>8} {'SLO':>8} {'GPU-h':>6} {'best=GPU-h':>11} {'(family)':<12} {'margin':>8} "
        f"{'best>=GPU-h':>11} {'reactive':>8} {'GPU-h':>6}"
    )
    for run in runs:
        spec = run["spec"]
        res = {r["policy"]: r for r in run["results"]}
        tp, re = res["tidepool"], res["tidepool-reactive"]
        c = run["comparison"]["tidepool"]["slo_attainment"]
        ratio = run["static"]["prefill"] / run["static"]["decode"]
        margin = "None" if c["margin_points"] is None else f"{c['margin_points']:+.2f}"
        print(
            f"{spec['name']:<8} {spec['bursts_per_hour']:>8g} {spec['trough']:>6g} {spec['pod_start_s']:>7g} "
            f"{spec['mix']:<12} {ratio:>5.2f} {_pct(tp['ttft_attainment']):>8} {_pct(tp['itl_attainment']):>8} "
            f"{_pct(tp['slo_attainment']):>8} {_pct(tp['gpu_share'], 0):>6} {_pct(c['best_at_equal_gpu_hours']):>11} "
            f"{c['best_family'] or '-':<12} {margin:>8} {_pct(c['best_with_more_gpu_hours']):>11} "
            f"{_pct(re['slo_attainment']):>8} {_pct(re['gpu_share'], 0):>6}"
        )
    print()
    print("one setting for the whole grid (what an admin runs): SLO attainment median / min, GPU-hour share median")
    for row in summary["fixed_settings"]:
        att, share = row["slo_attainment"], row["gpu_share"]
        median, least, cost = _pct(att["median"]), _pct(att["min"]), _pct(share["median"], 1)
        print(f"  {row['setting']:<28} {median:>8} / {least:>8}   {cost:>6}")
    print()
    for policy in POLICIES:
        s = summary[policy]
        att, share, margin = s["slo_attainment"], s["gpu_share"], s["margin_points"]
        print(
            f"{policy}: SLO attainment median {_pct(att['median'])}, min {_pct(att['min'])}; "
            f"GPU-hours vs peak-static median {_pct(share['median'], 1)}, min {_pct(share['min'], 1)}, "
            f"max {_pct(share['max'], 1)}"
        )
        m_med = "None" if margin["median"] is None else f"{margin['median']:+.2f}"
        m_min = "None" if margin["min"] is None else f"{margin['min']:+.2f}"
        print(
            f"  margin over the best baseline at equal GPU-hours (points): median {m_med}, min {m_min}; "
            f"positive on {s['traces_with_positive_margin']} of {len(runs)} traces; "
            f"no baseline family spans its GPU-hours on {s['traces_without_equal_gpu_hours_baseline']}"
        )


def plot_sweep(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "tidepool": "tab:blue",
        "tidepool-reactive": "tab:cyan",
        "static": "black",
        "hpa-running": "tab:orange",
        "hpa-kv": "tab:green",
        "hpa-waiting": "tab:red",
        "kubeai": "tab:purple",
    }
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(12, 10))
    for label in colors:
        xs, ys = [], []
        for run in runs:
            for r in run["results"]:
                key = r["policy"] if r["family"] == "tidepool" else r["family"]
                if key == label:
                    xs.append(100 * r["gpu_share"])
                    ys.append(max(1 - r["slo_attainment"], 1e-5))
        big = label.startswith("tidepool")
        ax0.scatter(
            xs,
            ys,
            s=30 if big else 10,
            alpha=0.9 if big else 0.5,
            color=colors[label],
            label=label,
            zorder=3 if big else 2,
        )
    ax0.set_yscale("log")
    ax0.set_xlabel("GPU-hours, % of static peak provisioning")
    ax0.set_ylabel("SLO miss rate (1 - attainment; 1e-5 = none)")
    ax0.legend(fontsize=8, ncol=4)
    ax0.grid(alpha=0.3)
    names = [run["spec"]["name"] for run in runs]
    for offset, policy in ((-0.2, "tidepool"), (0.2, "tidepool-reactive")):
        margins = [run["comparison"][policy]["slo_attainment"]["margin_points"] for run in runs]
        xs = [i + offset for i, m in enumerate(margins) if m is not None]
        ax1.bar(xs, [m for m in margins if m is not None], width=0.4, color=colors[policy], label=policy)
        for i, m in enumerate(margins):
            if m is None:
                ax1.text(i + offset, 0, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    ax1.axhline(0, color="k", lw=0.8)
    ax1.set_yscale("symlog", linthresh=1.0)
    ax1.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    ax1.set_ylabel("margin over best baseline\nat equal GPU-hours (points)")
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(grid_path: Path, perf: Perf, params: Params, out: Path, workers: int = 2) -> int:
    grid, specs, mixes = load_grid(grid_path)
    started = time.perf_counter()
    runs: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_spec, spec, mixes[spec.mix], perf, params): spec.name for spec in specs}
        with tqdm(total=len(futures), file=sys.stderr, desc="traces", unit="trace") as bar:
            for future in as_completed(futures):
                runs[futures[future]] = future.result()
                bar.update(1)
    ordered = [runs[spec.name] for spec in specs]
    elapsed = time.perf_counter() - started
    summary = summarize(ordered)
    print(f"grid {grid_path}: {len(specs)} traces, {len(ordered[0]['results'])} policies each")
    print_rows(ordered, summary)
    print(f"swept in {elapsed:.0f} s with {workers} processes")
    report = {
        "grid": str(grid_path),
        "description": grid.get("description", ""),
        "params": asdict(params),
        "elapsed_s": elapsed,
        "summary": summary,
        "traces": ordered,
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot_sweep(ordered, out.with_suffix(".png"), f"autoscale sweep: {grid_path.name}, {len(specs)} traces")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0
