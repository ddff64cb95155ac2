"""bench/autoscale_sim.py and its modules: trace files, the baselines' rules, the equal-GPU-hours comparison.

Fast (a few seconds, no network): short trace files in the three accepted column shapes (CSV and
JSONL) are binned and run through the simulator; the HPA baseline is checked on hand-made metric
sequences against the Kubernetes rules (tolerance band, 300 s scale-down window, scale-up at most
max(100%, 4 pods) per 15 s, missing pods); KubeAI's moving average and scale-down delay; and the
interpolation of the best baseline at equal GPU-hours, including the no-extrapolation case.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the bench scripts' own way
import autoscale_sim
from autoscale_compare import compare, interpolate, run_all
from autoscale_fleet import Params, Perf, fit_scale
from autoscale_k8s import Hpa, KubeAiAutoscaler, pods_metric_replicas
from autoscale_traces import Mix, fixed_mix, generate, load_trace_file

# (arrival seconds, prompt tokens, output tokens): 4 requests in the first 2-s tick, then one every 3 s.
REQUESTS = [(0.0, 100, 10), (0.5, 200, 20), (1.0, 300, 30), (1.9, 400, 40)] + [
    (2.0 + 3 * k, 500, 50) for k in range(200)
]


def _write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _trace_files(tmp_path: Path) -> dict[str, Path]:
    start = datetime(2023, 11, 16, 18, 15, 46, tzinfo=UTC)
    azure_rows = [[(start + timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0", p, o] for t, p, o in REQUESTS]
    burst_rows = [[t + 1000.0, "ChatGPT", p, o, p + o, "Conversation log"] for t, p, o in REQUESTS]
    jsonl = tmp_path / "plain.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"arrival_s": t, "prompt_tokens": p, "output_tokens": o}) + "\n" for t, p, o in REQUESTS)
    )
    burst_jsonl = tmp_path / "burst.jsonl"
    burst_jsonl.write_text(
        "".join(json.dumps({"Timestamp": t, "Request tokens": p, "Response tokens": o}) + "\n" for t, p, o in REQUESTS)
    )
    return {
        "azure_csv": _write_csv(tmp_path / "azure.csv", ["TIMESTAMP", "ContextTokens", "GeneratedTokens"], azure_rows),
        "burstgpt_csv": _write_csv(
            tmp_path / "burstgpt.csv",
            ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"],
            burst_rows,
        ),
        "plain_csv": _write_csv(
            tmp_path / "plain.csv", ["arrival_s", "prompt_tokens", "output_tokens"], [list(r) for r in REQUESTS]
        ),
        "plain_jsonl": jsonl,
        "burstgpt_jsonl": burst_jsonl,
    }


def test_trace_files_bin_into_ticks(tmp_path: Path) -> None:
    for name, path in _trace_files(tmp_path).items():
        trace = load_trace_file(path, dt=2.0)
        assert trace.ticks == int(REQUESTS[-1][0] // 2) + 1, name
        assert trace.arrivals.sum() == len(REQUESTS), name
        assert (trace.arrivals[0], trace.prompt_tokens[0], trace.output_tokens[0]) == (4, 1000, 100), name
        assert trace.prompt_tokens.sum() == sum(p for _, p, _ in REQUESTS), name
        assert trace.output_tokens.sum() == sum(o for _, _, o in REQUESTS), name


def test_unknown_columns_are_refused(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "bad.csv", ["time", "in", "out"], [[0, 1, 1]])
    with pytest.raises(ValueError, match="match no trace schema"):
        load_trace_file(path, dt=2.0)


def test_trace_file_runs_through_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _trace_files(tmp_path)
    out = tmp_path / "out" / "sim"
    assert autoscale_sim.main(["--trace", str(files["azure_csv"]), "--gpus", "40", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    policies = {r["policy"] for r in report["results"]}
    assert {"tidepool", "tidepool-reactive", "static"} <= policies
    assert {r["family"] for r in report["results"]} >= {"hpa-running", "hpa-kv", "hpa-waiting", "kubeai"}
    for r in report["results"]:
        assert 0.0 <= r["slo_attainment"] <= 1.0 and r["gpu_hours"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "best baseline at equal GPU-hours" in capsys.readouterr().out
    # A JSONL file through the same path, without the CLI: a fixed rate multiplier.
    perf, params = Perf.calibrated(), Params(gpus=40)
    trace = load_trace_file(files["burstgpt_jsonl"], dt=2.0).scaled(50.0)
    run = run_all(trace, perf, params)
    assert run["requests"] == pytest.approx(50.0 * len(REQUESTS))


def test_generator_mix_sets_the_token_totals() -> None:
    perf, params = Perf.calibrated(), Params()
    mix = Mix.from_json(
        "two",
        [
            {"share": 0.8, "prompt": 400, "output": 300, "sigma": 0.6, "burst_share": 0.2},
            {"share": 0.2, "prompt": 2000, "output": 100, "sigma": 0.4, "burst_share": 0.8},
        ],
    )
    a = generate(2.0, 2.0, 0.1, 2.0, 7, mix, lambda unit: fit_scale(perf, params, unit))
    b = generate(2.0, 2.0, 0.1, 2.0, 7, mix, lambda unit: fit_scale(perf, params, unit))
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens)  # seeded
    expected_prompt = float((a.rate * 2.0 * a.prompt_mean).sum())
    assert a.prompt_tokens.sum() == pytest.approx(expected_prompt, rel=0.02)
    assert np.all(a.prompt_tokens >= a.arrivals)
    fixed = generate(1.0, 2.0, 0.1, 1.0, 0, fixed_mix(512, 256), lambda unit: 10.0)
    assert np.array_equal(fixed.prompt_tokens, fixed.arrivals * 512)


# --- the HPA against the Kubernetes rules ----------------------------------------------------------


def test_hpa_tolerance_band_holds_replicas() -> None:
    for value, expected in ((1.05, 10), (0.95, 10), (1.1, 10), (0.9, 10), (1.2, 12), (0.8, 8)):
        hpa = Hpa(target=1.0, min_replicas=1, max_replicas=100)
        assert hpa.sync(0.0, current=10, ready=10, missing=0, unready=0, value=value) == expected, value


def test_hpa_scales_down_only_after_the_300s_window() -> None:
    hpa = Hpa(target=1.0, min_replicas=1, max_replicas=100)
    assert hpa.sync(0.0, 10, 10, 0, 0, value=1.0) == 10  # recommendation 10 at t=0
    current = 10
    for k in range(1, 21):  # load halves from t=15 s on: raw recommendation 5
        now = 15.0 * k
        current = hpa.sync(now, current, current, 0, 0, value=0.5 * 10 / current)
        assert current == (10 if now < 300 else 5), now


def test_hpa_scale_up_is_limited_to_max_of_100_percent_and_4_pods_per_15s() -> None:
    hpa = Hpa(target=1.0, min_replicas=1, max_replicas=1000)
    assert hpa.sync(0.0, 2, 2, 0, 0, value=50.0) == 6  # max(2 x 2, 2 + 4)
    assert hpa.sync(5.0, 6, 6, 0, 0, value=50.0) == 6  # same 15-s period: period start 2, limit 6
    assert hpa.sync(15.0, 6, 6, 0, 0, value=50.0) == 12  # the t=0 event left the period: max(12, 10)
    assert hpa.sync(30.0, 12, 12, 0, 0, value=50.0) == 24
    big = Hpa(target=1.0, min_replicas=1, max_replicas=30)
    assert big.sync(0.0, 20, 20, 0, 0, value=50.0) == 30  # maxReplicas caps the 100% step


def test_hpa_missing_and_unready_pods() -> None:
    # Scale-down with 4 missing pods: they count as at target: (6 x 0.5 + 4 x 1) / 10 = 0.7 -> 7, not 3.
    assert pods_metric_replicas(10, 6, 4, 0, 500, 1000, 0.1) == 7
    # Scale-up with missing pods: they count as 0: 6 x 1.5 / 10 = 0.9 -> within tolerance, hold 10.
    assert pods_metric_replicas(10, 6, 4, 0, 1500, 1000, 0.1) == 10
    # Scale-up with Pending pods: 0 too: 6 x 3 / 10 = 1.8 -> 18.
    assert pods_metric_replicas(10, 6, 0, 4, 3000, 1000, 0.1) == 18
    # Scale-down with Pending pods only: they are dropped: ceil(0.5 x 6) = 3.
    assert pods_metric_replicas(10, 6, 0, 4, 500, 1000, 0.1) == 3
    hpa = Hpa(target=1.0, min_replicas=1, max_replicas=100)
    assert hpa.sync(0.0, 10, 0, 10, 0, value=0.0) == 10  # no metrics at all: no scaling
    assert hpa.recommendations == []  # ... and nothing recorded


def test_kubeai_moving_average_and_scale_down_delay() -> None:
    scaler = KubeAiAutoscaler(target_requests=10, min_replicas=1, max_replicas=100)  # 60 samples of 10 s
    assert scaler.decide(current=5, in_flight=50) == 5  # window seeded at 50: ceil(50 / 10)
    assert scaler.decide(5, 650) == 6  # (59 x 50 + 650) / 60 = 60 -> 6: up at once
    current, seen = 6, []
    for k in range(1, 30):  # no requests from now on: the average falls by 50 / 60 per decision
        wanted = math.ceil((3600 - 50 * k) / 60 / 10)
        current = scaler.decide(current, 0)
        seen.append((wanted, current))
    first = next(i for i, (wanted, _) in enumerate(seen) if wanted < 6)
    # Held for ceil(scaleDownDelaySeconds 30 / interval 10) = 3 decisions, then applied.
    assert [c for _, c in seen[: first + 3]] == [6] * (first + 3)
    assert seen[first + 3] == (5, 5)


# --- best baseline at equal GPU-hours --------------------------------------------------------------


def test_interpolation_never_extrapolates() -> None:
    points = [(30.0, 1.0), (10.0, 0.9), (20.0, 0.99)]
    assert interpolate(points, 15.0) == pytest.approx(0.945)
    assert interpolate(points, 20.0) == pytest.approx(0.99)
    assert interpolate(points, 5.0) is None
    assert interpolate(points, 31.0) is None
    assert interpolate([], 10.0) is None


def test_best_baseline_at_equal_gpu_hours() -> None:
    def run(family: str, gpu_h: float, att: float) -> dict:
        return {"policy": f"{family} {gpu_h}", "family": family, "gpu_hours": gpu_h, "slo_attainment": att}

    baselines = [
        run("a", 10, 0.5),
        run("a", 30, 0.9),  # a at 20: 0.7
        run("b", 15, 0.8),
        run("b", 25, 0.95),  # b at 20: 0.875
        run("c", 21, 1.0),
        run("c", 40, 1.0),  # c does not reach down to 20: None
    ]
    result = compare({"gpu_hours": 20.0, "slo_attainment": 0.99}, baselines)
    assert result["at_equal_gpu_hours_by_family"] == {"a": pytest.approx(0.7), "b": pytest.approx(0.875), "c": None}
    assert result["best_family"] == "b"
    assert result["best_at_equal_gpu_hours"] == pytest.approx(0.875)
    assert result["margin_points"] == pytest.approx(11.5)
    assert result["best_with_more_gpu_hours"] == 1.0  # c at 21 GPU-h
    nothing = compare({"gpu_hours": 100.0, "slo_attainment": 0.99}, baselines)
    assert nothing["best_at_equal_gpu_hours"] is None and nothing["margin_points"] is None
    assert nothing["best_with_more_gpu_hours"] is None
