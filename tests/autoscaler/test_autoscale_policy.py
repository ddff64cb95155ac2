"""Table-driven tests of the autoscaling policy: one row per rule of policy.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from autoscale_helpers import pd_config, snap, state, unified_config

from tidepool.operator.autoscaler.policy import decide
from tidepool.operator.autoscaler.policy_types import AutoscaleConfig, History, PoolBounds, PoolSnapshot


@dataclass
class Case:
    name: str
    config: AutoscaleConfig
    snapshots: dict
    current: dict
    expected: dict
    reason: str = ""  # a substring the decision's reason must contain
    history: History | None = None
    now: float = 1000.0
    is_limited: bool = False
    extra: dict = field(default_factory=dict)


CASES = [
    Case(
        "steady load inside the tolerance band",
        unified_config(),
        {"unified": snap(4)},
        {"unified": state(4)},
        {"unified": 4},
        "unified 4:",
    ),
    Case(
        "kv cache over target scales up",
        unified_config(),
        {"unified": snap(4, kv_cache_usage=0.95)},
        {"unified": state(4)},
        {"unified": 6},
        "kv_cache 0.95",
    ),
    Case(
        "ttft over slo scales up",
        unified_config(),
        {"unified": snap(4, ttft_p95_s=1.0)},
        {"unified": state(4)},
        {"unified": 8},
        "ttft_p95 1.000s",
    ),
    Case(
        "queue per replica over target",
        unified_config(),
        {"unified": snap(2, num_waiting=24.0)},
        {"unified": state(2)},
        {"unified": 3},  # utilization 12/13 vs 4/5: ratio 1.15
        "queue 12.0/replica",
    ),
    Case(
        "preemptions read as over target",
        unified_config(),
        {"unified": snap(4, preemptions_per_s=0.4)},
        {"unified": state(4)},
        {"unified": 6},
        "preemptions",
    ),
    Case(
        "low utilization scales down",
        unified_config(),
        {"unified": snap(8, kv_cache_usage=0.3)},
        {"unified": state(8)},
        {"unified": 4},
        "unified 8->4",
    ),
    Case(
        "latency near the slo blocks scale-down",
        unified_config(),
        {"unified": snap(8, kv_cache_usage=0.3, ttft_p95_s=0.45)},
        {"unified": state(8)},
        {"unified": 8},
    ),
    Case(
        "a failed scrape never shrinks",
        unified_config(),
        {"unified": snap(7, kv_cache_usage=0.1, num_pods_failed=1)},
        {"unified": state(8)},
        {"unified": 8},
        "incomplete data",
    ),
    Case(
        "no snapshot at all never shrinks",
        unified_config(),
        {},
        {"unified": state(8)},
        {"unified": 8},
        "no pods measured",
    ),
    Case(
        "capped at maxReplicas",
        unified_config(pools={"unified": PoolBounds(1, 5)}),
        {"unified": snap(4, kv_cache_usage=1.5)},
        {"unified": state(4)},
        {"unified": 5},
        "maxReplicas 5",
        is_limited=True,
    ),
    Case(
        "unschedulable pods stop scale-up",
        unified_config(),
        {"unified": snap(3, kv_cache_usage=1.5)},
        {"unified": state(4, unschedulable=1)},
        {"unified": 4},
        "1 pod(s) unschedulable: Insufficient gpu",
        is_limited=True,
    ),
    Case(
        "step bound: +max(100%, 4) per decision",
        unified_config(queue_depth_target=0.25),
        {"unified": snap(2, num_waiting=200.0)},  # utilization ratio 4.95: wants 10
        {"unified": state(2)},
        {"unified": 6},
    ),
    Case(
        "latency alone grows a pool at most LATENCY_RATIO_CAP x per decision",
        unified_config(),
        {"unified": snap(2, ttft_p95_s=10.0)},
        {"unified": state(2)},
        {"unified": 4},
        "ratio 2.00",
    ),
    Case(
        "step bound on the way down",
        unified_config(max_step_percent=25),
        {"unified": snap(8, kv_cache_usage=0.1)},
        {"unified": state(8)},
        {"unified": 6},
    ),
    Case(
        "slow down: a recent higher recommendation holds",
        unified_config(down_seconds=300),
        {"unified": snap(8, kv_cache_usage=0.3)},
        {"unified": state(8)},
        {"unified": 7},
        history=History(recommendations=((800.0, {"unified": 7}), (900.0, {"unified": 6}))),
    ),
    Case(
        "slow up when configured: min over the up window",
        unified_config(up_seconds=60),
        {"unified": snap(4, kv_cache_usage=1.5)},
        {"unified": state(4)},
        {"unified": 5},
        history=History(recommendations=((950.0, {"unified": 5}),)),
    ),
    Case(
        "below minReplicas is raised",
        unified_config(pools={"unified": PoolBounds(3, 9)}),
        {"unified": snap(1)},
        {"unified": state(1)},
        {"unified": 3},
    ),
    Case(
        "idle long enough scales to zero",
        unified_config(scale_to_zero=True, idle_seconds=300),
        {"unified": snap(2, num_requests=0.0, num_running=0.0, ttft_p95_s=None, itl_p95_s=None, kv_cache_usage=0.0)},
        {"unified": state(2)},
        {"unified": 0},
        "idleSeconds 300",
        history=History(last_active_time=600.0),
    ),
    Case(
        "idle but not long enough keeps minReplicas",
        unified_config(scale_to_zero=True, idle_seconds=600),
        {"unified": snap(2, num_requests=0.0, num_running=0.0, ttft_p95_s=None, itl_p95_s=None, kv_cache_usage=0.0)},
        {"unified": state(2)},
        {"unified": 1},
        history=History(last_active_time=600.0),
    ),
    Case(
        "minReplicas 0: low load alone never reaches zero (only idleSeconds does)",
        unified_config(scale_to_zero=True, idle_seconds=600, pools={"unified": PoolBounds(0, 9)}),
        {"unified": snap(2, kv_cache_usage=0.0, num_running=0.0)},
        {"unified": state(2)},
        {"unified": 1},
    ),
    Case(
        "held requests wake a pool at zero",
        unified_config(scale_to_zero=True, pools={"unified": PoolBounds(2, 9)}),
        {"unified": PoolSnapshot(held_requests=3)},
        {"unified": state(0)},
        {"unified": 2},
        "router holds requests",
    ),
    Case(
        "at zero without held requests stays at zero",
        unified_config(scale_to_zero=True),
        {"unified": PoolSnapshot()},
        {"unified": state(0)},
        {"unified": 0},
    ),
    Case(
        "decode itl breach grows decode only",
        pd_config(),
        {"prefill": snap(2, num_running=8.0), "decode": snap(4, itl_p95_s=0.1, kv_cache_usage=0.7)},
        {"prefill": state(2), "decode": state(4)},
        {"prefill": 2, "decode": 8},
        "itl_p95 0.100s",
    ),
    Case(
        "prefill growth pulls decode up to the ratio bound",
        pd_config(pd_ratio_max=2.0),
        {"prefill": snap(4, ttft_p95_s=1.0), "decode": snap(2)},
        {"prefill": state(4), "decode": state(2)},
        {"prefill": 8, "decode": 4},
    ),
    Case(
        "ratio bound trims prefill when decode cannot grow",
        pd_config(pd_ratio_max=2.0),
        {"prefill": snap(4, ttft_p95_s=1.0), "decode": snap(2)},
        {"prefill": state(4), "decode": state(3, unschedulable=1)},
        {"prefill": 6, "decode": 3},
        is_limited=True,
    ),
    Case(
        "held requests at zero wake both pools",
        pd_config(scale_to_zero=True),
        {"prefill": PoolSnapshot(held_requests=1), "decode": PoolSnapshot()},
        {"prefill": state(0), "decode": state(0)},
        {"prefill": 1, "decode": 1},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_policy_table(case: Case):
    decision = decide(case.config, case.snapshots, case.current, case.history, case.now)
    assert decision.desired == case.expected, decision.reason
    assert decision.replicas == case.expected
    assert case.reason in decision.reason
    assert decision.is_limited == case.is_limited, decision.limited_reason


def test_advisory_reports_but_keeps_current_replicas():
    config = unified_config(is_advisory=True)
    decision = decide(config, {"unified": snap(4, kv_cache_usage=0.95)}, {"unified": state(4)}, None, 0.0)
    assert decision.desired == {"unified": 6}
    assert decision.replicas == {"unified": 4}
    assert decision.reason.startswith("advisory (not applied)")
    assert decision.history.last_scale_time is None


def test_history_records_scale_time_activity_and_prunes_old_recommendations():
    config = unified_config(down_seconds=120)
    old = History(recommendations=((0.0, {"unified": 9}), (900.0, {"unified": 4})), last_active_time=5.0)
    decision = decide(config, {"unified": snap(4, kv_cache_usage=0.95)}, {"unified": state(4)}, old, 1000.0)
    assert decision.history.last_scale_time == 1000.0
    assert decision.history.last_active_time == 1000.0
    assert [t for t, _ in decision.history.recommendations] == [900.0, 1000.0]


def test_bad_pools_are_rejected_with_the_pool_named():
    with pytest.raises(ValueError, match="'unified' or 'prefill' and 'decode'"):
        decide(unified_config(pools={"prefill": PoolBounds(1, 2)}), {}, {"prefill": state(1)}, None, 0.0)
    with pytest.raises(ValueError, match="unified"):
        decide(unified_config(), {}, {}, None, 0.0)


def test_more_decode_load_never_gets_fewer_decode_replicas_when_the_ratio_band_has_no_integer_pair():
    """prefill:decode pinned to exactly 0.75 with prefill at its max of 7: no integer decode count fits (7/0.75 =
    9.33). At light load the guard grows decode to 10 for prefill's sake; at heavy load decode's own growth (to 10)
    must not then be trimmed to 9 for the band's other edge (the case hypothesis found: 9 < 10, not monotone)."""
    config = pd_config(
        pools={"prefill": PoolBounds(0, 7), "decode": PoolBounds(0, 10)},
        ttft_p95_s=None, itl_p95_s=None, max_step_percent=29.0, pd_ratio_min=0.75, pd_ratio_max=0.75,
        up_seconds=0.0, tolerance=0.0,
    )  # fmt: skip
    current = {"prefill": state(7), "decode": state(7)}
    no_data = PoolSnapshot(num_pods_scraped=0, window_s=60.0)
    decisions = [
        decide(config, {"prefill": no_data,
                        "decode": PoolSnapshot(preemptions_per_s=rate, num_pods_scraped=5, window_s=60.0)},
               current, History(), 1000.0).pools["decode"]
        for rate in (2.0, 6.0)
    ]  # fmt: skip
    assert [d.recommendation for d in decisions] == [7, 10]  # the heavier load asks for more decode
    assert [d.desired for d in decisions] == [10, 10]
