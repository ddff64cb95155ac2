"""Metric windows: percentiles from bucket deltas over the window, per-pod baselines, rates."""

from __future__ import annotations

import pytest
from autoscale_helpers import engine_metrics_text

from tidepool.operator.autoscaler.metrics import pod_metrics_from_text
from tidepool.operator.autoscaler.window import PoolWindow, Scrape


def pod(**kwargs):
    return pod_metrics_from_text(engine_metrics_text(**kwargs))


def test_percentile_comes_from_the_window_not_the_lifetime():
    window = PoolWindow(60.0)
    window.add(Scrape(0.0, {"a": pod(ttft=[0.01] * 1000)}))
    window.add(Scrape(30.0, {"a": pod(ttft=[0.01] * 1000 + [3.0] * 100, kv=0.5)}))
    snap = window.snapshot()
    assert snap.num_requests == 100
    assert 2.5 <= snap.ttft_p95_s <= 5.0  # lifetime p95 would be ~0.01 s
    assert snap.kv_cache_usage == 0.5 and snap.window_s == 30.0


def test_new_pod_counts_from_zero_restarted_pod_from_its_new_counters():
    window = PoolWindow(60.0)
    window.add(Scrape(0.0, {"a": pod(ttft=[0.01] * 50)}))
    window.add(Scrape(20.0, {"a": pod(ttft=[0.02] * 3), "b": pod(ttft=[0.3] * 7)}))
    snap = window.snapshot()
    assert snap.num_requests == 10  # a restarted (50 -> 3 observations): 3; b is new: 7
    assert snap.num_pods_scraped == 2


def test_single_scrape_has_no_window_and_failed_pods_are_reported():
    window = PoolWindow(60.0)
    window.add(Scrape(0.0, {"a": pod(waiting=2, running=3)}, num_pods_failed=1, held_requests=4))
    snap = window.snapshot()
    assert snap.ttft_p95_s is None and snap.num_requests is None and snap.preemptions_per_s is None
    assert snap.num_waiting == 2 and snap.num_running == 3
    assert snap.num_pods_failed == 1 and snap.held_requests == 4
    assert PoolWindow(10.0).snapshot().num_pods_scraped == 0


def test_window_keeps_one_baseline_older_than_the_window():
    window = PoolWindow(60.0)
    for t in range(0, 200, 15):
        window.add(Scrape(float(t), {"a": pod(ttft=[0.1] * t, preemptions=t)}))
    snap = window.snapshot()
    assert snap.window_s == 60.0  # latest 195, baseline 135
    assert snap.num_requests == 60
    assert snap.preemptions_per_s == pytest.approx(1.0)
    assert len(window) == 5


def test_window_rejects_bad_input():
    with pytest.raises(ValueError, match="positive"):
        PoolWindow(0)
    window = PoolWindow(10.0)
    window.add(Scrape(5.0))
    with pytest.raises(ValueError, match="time order"):
        window.add(Scrape(4.0))
