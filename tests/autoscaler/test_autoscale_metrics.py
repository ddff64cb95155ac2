"""Prometheus text parsing, histogram deltas and PromQL-style quantiles against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from autoscale_helpers import engine_metrics_text
from hypothesis import given, settings
from hypothesis import strategies as st

from tidepool.contract import metrics_names as names
from tidepool.engine.server.metrics import ITL_BUCKETS
from tidepool.operator.autoscaler.metrics import (
    Histogram,
    MetricsParseError,
    held_requests_by_pool,
    histogram_quantile,
    parse_text,
    pod_metrics_from_text,
)


def test_parse_text_labels_escapes_special_values_and_timestamps():
    text = "\n".join(
        [
            "# HELP x help text",
            "# TYPE x counter",
            'x_total{a="1",b="q\\"uote\\\\ \\n"} 3.5 1700000000000',
            "plain 7",
            'h_bucket{le="+Inf"} 4',
            "",
            "nan_value NaN",
        ]
    )
    samples = parse_text(text)
    assert [s.name for s in samples] == ["x_total", "plain", "h_bucket", "nan_value"]
    assert samples[0].labels == {"a": "1", "b": 'q"uote\\ \n'}
    assert samples[0].value == 3.5
    assert samples[2].labels["le"] == "+Inf"
    assert math.isnan(samples[3].value)


@pytest.mark.parametrize("line", ["no_value", 'x{a="1" 3', "x{a=1} 3", "x abc"])
def test_parse_text_rejects_garbage_naming_the_line(line):
    with pytest.raises(MetricsParseError, match="metrics line"):
        parse_text(line)


def test_pod_metrics_from_real_exposition_sums_labels_and_takes_max_kv():
    text = engine_metrics_text(
        ttft=[0.03, 0.3, 3.0], itl=[0.02] * 10, kv=0.4, waiting=3, running=5, preemptions=2, model_names=("a", "b")
    )
    pod = pod_metrics_from_text(text)
    assert pod.gauges[names.NUM_REQUESTS_WAITING] == 3
    assert pod.gauges[names.NUM_REQUESTS_RUNNING] == 5
    assert pod.gauges[names.KV_CACHE_USAGE_PERC] == 0.4  # max over model_name, not 0.8
    assert pod.counters[names.sample_total(names.NUM_PREEMPTIONS)] == 2
    ttft = pod.histograms[names.TIME_TO_FIRST_TOKEN_SECONDS]
    assert ttft.count == 3 and math.isclose(ttft.total, 3.33)
    assert pod.histograms[names.INTER_TOKEN_LATENCY_SECONDS].count == 10


def test_held_requests_by_pool():
    text = (
        "# TYPE tidepool_router_held_requests gauge\n"
        'tidepool_router_held_requests{pool="prefill"} 2\n'
        'tidepool_router_held_requests{pool="decode"} 0\n'
    )
    assert held_requests_by_pool(text) == {"prefill": 2.0, "decode": 0.0}


def test_histogram_minus_is_the_window_delta_and_handles_reset():
    bounds = (0.1, 1.0, math.inf)
    old = Histogram(bounds, (5, 8, 9), 3.0)
    new = Histogram(bounds, (6, 12, 14), 9.0)
    delta = new.minus(old)
    assert delta.counts == (1, 4, 5) and delta.total == 6.0
    restarted = Histogram(bounds, (1, 1, 1), 0.05)
    assert restarted.minus(old) is restarted
    assert new.minus(None) is new


def brute_force_promql_quantile(q: float, bounds: list[float], values: list[float]) -> float | None:
    """PromQL's estimate by a different route: invert the piecewise-linear bucket CDF by bisection."""
    if not values:
        return None
    finite = [b for b in bounds if not math.isinf(b)]
    knots = [(0.0, 0.0)] + [(b, float(sum(v <= b for v in values))) for b in finite]
    rank = q * len(values)
    if rank > knots[-1][1]:
        return finite[-1]  # the rank is in the +Inf bucket
    lo, hi = 0.0, finite[-1]

    def cdf(x: float) -> float:
        for (x0, c0), (x1, c1) in itertools.pairwise(knots):
            if x <= x1:
                return c0 + (c1 - c0) * (x - x0) / (x1 - x0)
        return knots[-1][1]

    for _ in range(200):  # smallest x with cdf(x) >= rank
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cdf(mid) >= rank else (mid, hi)
    return hi


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(0.0, 12.0, allow_nan=False), min_size=0, max_size=300),
    q=st.sampled_from([0.5, 0.9, 0.95, 0.99]),
)
def test_quantile_matches_brute_force_on_real_exposition(values, q):
    text = engine_metrics_text(itl=values)
    hist = pod_metrics_from_text(text).histograms[names.INTER_TOKEN_LATENCY_SECONDS]
    estimate = hist.quantile(q)
    expected = brute_force_promql_quantile(q, [*ITL_BUCKETS, math.inf], values)
    if expected is None:
        assert estimate is None
        return
    assert estimate == pytest.approx(expected, abs=1e-6)
    # The true sample quantile lies in the bucket the estimate interpolates in.
    true_q = sorted(values)[max(math.ceil(q * len(values)) - 1, 0)]
    if true_q <= ITL_BUCKETS[-1]:
        upper = next(b for b in ITL_BUCKETS if true_q <= b)
        lower = max([0.0] + [b for b in ITL_BUCKETS if b < upper])
        assert lower - 1e-9 <= estimate <= upper + 1e-9


@given(
    bounds=st.lists(st.floats(0.001, 100.0), min_size=1, max_size=12, unique=True).map(sorted),
    values=st.lists(st.floats(0.0, 120.0, allow_nan=False), min_size=1, max_size=100),
)
def test_quantile_matches_brute_force_on_random_layouts(bounds, values):
    layout = (*bounds, math.inf)
    counts = tuple(float(sum(v <= b for v in values)) for b in layout)
    assert histogram_quantile(0.95, layout, counts) == pytest.approx(
        brute_force_promql_quantile(0.95, list(layout), values), abs=1e-6
    )


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, (1.0, math.inf), (1, 1))
    with pytest.raises(ValueError, match=r"\+Inf"):
        histogram_quantile(0.5, (1.0, 2.0), (1, 1))
    assert histogram_quantile(0.5, (1.0, math.inf), (0, 0)) is None
