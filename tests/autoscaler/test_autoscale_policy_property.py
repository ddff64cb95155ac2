"""Property tests of the autoscaling policy (hypothesis): the invariants of policy.py's docstring."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tidepool.operator.autoscaler.policy import decide
from tidepool.operator.autoscaler.policy_types import (
    AutoscaleConfig,
    History,
    PoolBounds,
    PoolSnapshot,
    PoolState,
)

NOW = 10_000.0
optional_pos = st.one_of(st.none(), st.floats(0.0, 5.0))


@st.composite
def configs(draw, disaggregated: bool | None = None) -> AutoscaleConfig:
    is_pd = draw(st.booleans()) if disaggregated is None else disaggregated
    names = ("prefill", "decode") if is_pd else ("unified",)
    pools = {}
    for name in names:
        low = draw(st.integers(0, 5))
        pools[name] = PoolBounds(low, draw(st.integers(max(low, 1), 60)))
    lo = draw(st.floats(0.05, 1.0))
    return AutoscaleConfig(
        pools=pools,
        ttft_p95_s=draw(st.sampled_from([None, 0.2, 1.0])),
        itl_p95_s=draw(st.sampled_from([None, 0.02, 0.1])),
        kv_cache_target=draw(st.floats(0.3, 0.95)),
        queue_depth_target=draw(st.floats(0.5, 16.0)),
        scale_to_zero=draw(st.booleans()),
        idle_seconds=draw(st.floats(0.0, 2000.0)),
        up_seconds=draw(st.floats(0.0, 120.0)),
        down_seconds=draw(st.floats(0.0, 900.0)),
        max_step_percent=draw(st.floats(5.0, 300.0)),
        min_step_replicas=draw(st.integers(1, 6)),
        tolerance=draw(st.floats(0.0, 0.3)),
        pd_ratio_min=lo,
        pd_ratio_max=draw(st.floats(lo, 8.0)),
    )


@st.composite
def snapshots(draw, replicas: int) -> PoolSnapshot:
    return PoolSnapshot(
        ttft_p95_s=draw(optional_pos),
        itl_p95_s=draw(st.one_of(st.none(), st.floats(0.0, 0.5))),
        num_requests=draw(st.one_of(st.none(), st.floats(0.0, 1000.0))),
        kv_cache_usage=draw(st.one_of(st.none(), st.floats(0.0, 1.0))),
        num_waiting=draw(st.one_of(st.none(), st.floats(0.0, 200.0))),
        num_running=draw(st.one_of(st.none(), st.floats(0.0, 500.0))),
        preemptions_per_s=draw(st.one_of(st.none(), st.floats(0.0, 3.0))),
        held_requests=draw(st.sampled_from([0.0, 0.0, 2.0])),
        num_pods_scraped=draw(st.integers(0, replicas)),
        num_pods_failed=draw(st.sampled_from([0, 0, 0, 1])),
        window_s=60.0,
    )


@st.composite
def scenarios(draw, disaggregated: bool | None = None):
    config = draw(configs(disaggregated))
    current, snaps = {}, {}
    for name, bounds in config.pools.items():
        floor = 0 if config.scale_to_zero else bounds.min_replicas
        replicas = draw(st.integers(floor, bounds.max_replicas))
        current[name] = PoolState(replicas, draw(st.sampled_from([0, 0, 0, 1])))
        snaps[name] = draw(snapshots(replicas))
    recs = draw(
        st.lists(
            st.tuples(st.floats(NOW - 1000, NOW - 1), st.fixed_dictionaries({n: st.integers(0, 80) for n in current})),
            max_size=6,
        )
    )
    history = History(
        recommendations=tuple(sorted(recs, key=lambda r: r[0])),
        last_active_time=draw(st.one_of(st.none(), st.floats(NOW - 3000, NOW))),
    )
    return config, snaps, current, history


def is_complete(snap: PoolSnapshot, state: PoolState) -> bool:
    expected = state.replicas - state.num_unschedulable
    return snap.num_pods_failed == 0 and snap.num_pods_scraped >= expected and snap.num_requests is not None


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_never_outside_min_max(scenario):
    config, snaps, current, history = scenario
    decision = decide(config, snaps, current, history, NOW)
    for name, pool in decision.pools.items():
        bounds = config.pools[name]
        if pool.desired == 0 and pool.current > 0:  # only the idle rule goes to zero
            assert config.scale_to_zero and "idleSeconds" in decision.reason, decision.reason
            continue
        if pool.desired == 0 and config.scale_to_zero:
            continue
        assert bounds.min_replicas <= pool.desired <= bounds.max_replicas, decision.reason


def scale_load(snap: PoolSnapshot, factor: float, extra_waiting: float) -> PoolSnapshot:
    def up(value: float | None) -> float | None:
        return None if value is None else value * factor

    return dataclasses.replace(
        snap,
        ttft_p95_s=up(snap.ttft_p95_s),
        itl_p95_s=up(snap.itl_p95_s),
        num_requests=up(snap.num_requests),
        kv_cache_usage=None if snap.kv_cache_usage is None else min(snap.kv_cache_usage * factor, 1.0),
        num_waiting=None if snap.num_waiting is None else snap.num_waiting * factor + extra_waiting,
        num_running=up(snap.num_running),
        preemptions_per_s=up(snap.preemptions_per_s),
        held_requests=snap.held_requests * factor,
    )


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.floats(1.0, 4.0), st.floats(0.0, 20.0), st.sampled_from([None, "prefill", "decode", "unified"]))
def test_monotone_in_load(scenario, factor, extra_waiting, only_pool):
    config, snaps, current, history = scenario
    heavier = {
        name: scale_load(snap, factor, extra_waiting) if only_pool in (None, name) else snap
        for name, snap in snaps.items()
    }
    light = decide(config, snaps, current, history, NOW)
    heavy = decide(config, heavier, current, history, NOW)
    for name in config.pools:
        assert heavy.pools[name].desired >= light.pools[name].desired, (light.reason, heavy.reason)


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_missing_data_never_shrinks(scenario):
    config, snaps, current, history = scenario
    decision = decide(config, snaps, current, history, NOW)
    for name, pool in decision.pools.items():
        if not is_complete(snaps[name], current[name]):
            assert pool.desired >= current[name].replicas, decision.reason


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_advisory_never_acts_but_decides_the_same(scenario):
    config, snaps, current, history = scenario
    advisory = decide(dataclasses.replace(config, is_advisory=True), snaps, current, history, NOW)
    active = decide(config, snaps, current, history, NOW)
    assert advisory.replicas == {name: state.replicas for name, state in current.items()}
    assert advisory.desired == active.desired
    assert advisory.history.last_scale_time == history.last_scale_time


@settings(max_examples=150, deadline=None)
@given(scenarios(disaggregated=True))
def test_ratio_bounds_held_or_reported(scenario):
    config, snaps, current, history = scenario
    decision = decide(config, snaps, current, history, NOW)
    p, d = decision.desired["prefill"], decision.desired["decode"]
    if p and d and not config.pd_ratio_min - 1e-9 <= p / d <= config.pd_ratio_max + 1e-9:
        assert "outside" in decision.pools["prefill"].limited_reason, decision.reason


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 100),
    st.integers(1, 100),
    st.floats(0.0, 4.0),
    st.floats(0.0, 4.0),
    st.floats(0.0, 0.2),
)
def test_ratio_bounds_held_when_pools_can_grow(p, d, prefill_load, decode_load, preempt):
    config = AutoscaleConfig(
        pools={"prefill": PoolBounds(1, 1000), "decode": PoolBounds(1, 1000)},
        ttft_p95_s=0.5,
        itl_p95_s=0.05,
        down_seconds=0.0,
        pd_ratio_min=0.25,
        pd_ratio_max=4.0,
    )
    snaps = {
        "prefill": PoolSnapshot(ttft_p95_s=0.5 * prefill_load, num_requests=10, num_waiting=0, num_pods_scraped=p),
        "decode": PoolSnapshot(
            itl_p95_s=0.05 * decode_load,
            kv_cache_usage=min(0.75 * decode_load, 1.0),
            preemptions_per_s=preempt,
            num_requests=10,
            num_waiting=0,
            num_pods_scraped=d,
        ),
    }
    decision = decide(config, snaps, {"prefill": PoolState(p), "decode": PoolState(d)}, None, NOW)
    got_p, got_d = decision.desired["prefill"], decision.desired["decode"]
    assert 0.25 <= got_p / got_d <= 4.0, decision.reason


@settings(max_examples=150, deadline=None)
@given(
    st.floats(0.3, 60.0),
    st.integers(1, 60),
    st.floats(0.2, 0.7),
    st.floats(0.0, 120.0),
    st.floats(0.0, 600.0),
    st.floats(10.0, 200.0),
    st.floats(0.0, 0.2),
)
def test_constant_load_settles_without_flapping(load, start, latency_scale, up_s, down_s, step_pct, tolerance):
    """Closed loop: a constant total load spread over the replicas; replica counts never reverse."""
    config = AutoscaleConfig(
        pools={"unified": PoolBounds(1, 64)},
        ttft_p95_s=0.5,
        itl_p95_s=0.05,
        kv_cache_target=0.75,
        up_seconds=up_s,
        down_seconds=down_s,
        max_step_percent=step_pct,
        tolerance=tolerance,
    )
    replicas, history, seen = start, None, []
    for tick in range(120):
        per_replica = load / replicas  # load in units of "one replica at its targets"
        snap = PoolSnapshot(
            ttft_p95_s=0.5 * latency_scale * per_replica,
            itl_p95_s=0.05 * latency_scale * per_replica,
            num_requests=100.0,
            kv_cache_usage=min(0.75 * per_replica, 1.0),
            num_waiting=0.0,
            num_running=10.0 * load,  # sequences follow the load, not the replica count
            num_pods_scraped=replicas,
            window_s=60.0,
        )
        decision = decide(config, {"unified": snap}, {"unified": PoolState(replicas)}, history, tick * 15.0)
        history, replicas = decision.history, decision.replicas["unified"]
        seen.append(replicas)
    diffs = [b - a for a, b in itertools.pairwise(seen) if b != a]
    assert all(x > 0 for x in diffs) or all(x < 0 for x in diffs), seen
    assert len(set(seen[-20:])) == 1, seen


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 20),
    st.floats(0.0, 1.0),
    st.floats(0.0, 0.5),
    st.floats(50.0, 300.0),
    st.floats(0.0, 2000.0),
    st.booleans(),
)
def test_only_the_idle_rule_reaches_zero(replicas, kv, waiting, step_pct, idle_for, has_requests):
    config = AutoscaleConfig(
        pools={"unified": PoolBounds(0, 20)},
        kv_cache_target=0.8,
        scale_to_zero=True,
        idle_seconds=600.0,
        down_seconds=0.0,
        max_step_percent=step_pct,
    )
    snap = PoolSnapshot(
        num_requests=10.0 if has_requests else 0.0,
        kv_cache_usage=kv,
        num_waiting=waiting,
        num_running=0.0,
        num_pods_scraped=replicas,
        window_s=60.0,
    )
    history = History(last_active_time=NOW - idle_for)
    decision = decide(config, {"unified": snap}, {"unified": PoolState(replicas)}, history, NOW)
    is_idle = not has_requests and not waiting and not kv and idle_for >= 600.0
    if decision.desired["unified"] == 0:
        assert not has_requests and idle_for >= 600.0, decision.reason
    elif is_idle:
        raise AssertionError(f"idle for {idle_for}s but not scaled to zero: {decision.reason}")
