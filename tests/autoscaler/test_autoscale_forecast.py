"""Anticipation (forecast.py, capacity.py, anticipate.py) under fake clocks: a step change, a ramp, a
burst, a pod that starts slower than expected, and capacity learned from noisy live metrics.

Every test drives time explicitly (decisions every 15 s, as the operator's default interval); nothing
depends on the machine's speed.
"""

from __future__ import annotations

import math
import random

import pytest

from tidepool.operator.autoscaler.capacity import Load, Model, capacities, learn
from tidepool.operator.autoscaler.forecast import (
    Channel,
    ForecastConfig,
    Startup,
    note_scale_up,
    observe_startup,
    predict,
    update,
)
from tidepool.operator.autoscaler.policy import decide
from tidepool.operator.autoscaler.policy_types import AutoscaleConfig, PoolBounds, PoolSnapshot, PoolState

TICK = 15.0
CONFIG = ForecastConfig()


def _queue_load(demand: float, replicas: int = 10, mu: float = 5000.0, service_s: float = 0.2) -> Load:
    """A prefill pool serving `demand` prompt tokens/s on `replicas` M/M/1 servers of rate mu."""
    rho = demand / replicas / mu
    return Load("queue", demand, demand / replicas, rho, 0.5, service_s / (1 - rho), 0.8)


def _run(channel: Channel, demands, start: float, lookahead: float = 300.0) -> tuple[Channel, float]:
    now = start
    for demand in demands:
        channel = update(channel, _queue_load(demand), lookahead, CONFIG, now)
        now += TICK
    return channel, now


def test_step_change_is_followed_and_its_errors_raise_then_age_out_of_headroom():
    channel, now = _run(Channel(), [20_000.0] * 240, 0.0)  # one calm hour
    assert channel.headroom(CONFIG) == pytest.approx(1.0, abs=0.02)
    channel, now = _run(channel, [30_000.0] * 40, now)  # +50 %, held for 10 min
    assert channel.level == pytest.approx(30_000.0, rel=0.03)  # Holt overshoots a step a little (its trend)
    # The forecasts made just before the step saw 1.5x their value within their lookahead.
    assert channel.headroom(CONFIG) == pytest.approx(1.5, rel=0.02)
    # Demand stays at the new level: once the step's samples are older than the window, headroom is ~1 again.
    channel, now = _run(channel, [30_000.0] * int(CONFIG.headroom_window_s / TICK + 40), now)
    assert channel.headroom(CONFIG) == pytest.approx(1.0, abs=0.02)


def test_a_ramp_is_forecast_ahead_of_itself():
    slope = 10.0  # tokens/s per second: +6,000 tokens/s over 10 min
    demands = [10_000.0 + slope * TICK * i for i in range(80)]
    channel, _ = _run(Channel(), demands, 0.0)
    last = demands[-1]
    prediction = predict(channel, _queue_load(last), 300.0, CONFIG)
    assert prediction.forecast > last  # ahead of the demand measured now ...
    assert prediction.forecast == pytest.approx(last + slope * 300.0, rel=0.05)  # ... by about the ramp's rise


def test_a_burst_sets_headroom_to_its_size_relative_to_the_forecast():
    calm, burst = [20_000.0] * 240, [20_000.0 * (1 + 0.5 * min(i / 8, 1.0)) for i in range(40)]  # 2-min build, 10 min
    channel, _ = _run(Channel(), calm + burst + calm[:60], 0.0)
    assert 1.45 <= channel.headroom(CONFIG) <= 1.52
    prediction = predict(channel, _queue_load(20_000.0), 300.0, CONFIG)
    at_target, at_limit = prediction.capacity, prediction.capacity_limit
    assert prediction.replicas == math.ceil(20_000.0 * max(prediction.headroom / at_limit, 1 / at_target))


def test_a_pod_that_starts_slower_than_expected_lengthens_the_lookahead_at_once():
    startup = Startup()
    assert startup.lookahead_s(CONFIG, 0.0) == CONFIG.default_startup_s
    startup = note_scale_up(startup, ready=2, desired=5, now=0.0)
    for now in range(15, 400, 15):  # the pods take 400 s, not the 120 s assumed
        ready = 5 if now >= 400 else 2
        startup = observe_startup(startup, ready, replicas=5, unschedulable=0, now=float(now))
        # While they start, the time they have taken already counts.
        assert startup.lookahead_s(CONFIG, float(now)) == max(CONFIG.default_startup_s, float(now))
    startup = observe_startup(startup, 5, replicas=5, unschedulable=0, now=405.0)
    assert startup.learned_s == 405.0 and not startup.waiting
    # A faster start later is averaged in, never taken whole: one fast pod does not make the pool fast.
    startup = note_scale_up(startup, ready=5, desired=6, now=1000.0)
    startup = observe_startup(startup, 6, replicas=6, unschedulable=0, now=1150.0)
    assert startup.learned_s == pytest.approx(0.7 * 405.0 + 0.3 * 150.0)
    # Unschedulable pods never start: the schedulable part of a scale-up being ready completes it.
    startup = note_scale_up(startup, ready=6, desired=9, now=2000.0)
    startup = observe_startup(startup, 7, replicas=9, unschedulable=2, now=2090.0)
    assert not startup.waiting


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_queue_capacity_converges_from_noisy_metrics(seed):
    rng = random.Random(seed)
    mu, service = 3000.0 + 4000.0 * rng.random(), 0.1 + 0.3 * rng.random()
    model, now = Model(), 0.0
    for _ in range(400):
        replicas = rng.randint(2, 40)
        rho = rng.uniform(0.05, 0.95)
        measured_rho = rho * rng.uniform(0.95, 1.05)
        load = Load("queue", rho * mu * replicas, rho * mu, measured_rho, 0.5, service / (1 - rho), 1.0)
        model = learn(model, load, TICK, CONFIG.memory_s)
        now += TICK
    at_target, at_limit = capacities(model, load)
    assert at_target == pytest.approx(0.5 * mu, rel=0.05)
    assert at_limit == pytest.approx(mu * (1 - service / 1.0), rel=0.08)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_capacity_converges_to_the_step_line_and_kv_bound(seed):
    rng = random.Random(seed)
    a, c = rng.uniform(0.005, 0.02), rng.uniform(0.0001, 0.0005)
    b_full, efficiency = rng.uniform(40, 200), rng.uniform(0.6, 1.0)
    model = Model()
    for _ in range(400):
        kv = rng.uniform(0.1, 0.85)
        b = kv * b_full
        tokens = efficiency * b / (a + c * b) * rng.uniform(0.97, 1.03)
        load = Load("batch", tokens * 8, tokens, kv, 0.6, (a + c * b) * rng.uniform(0.98, 1.02), 0.05, b)
        model = learn(model, load, TICK, CONFIG.memory_s)
    at_target, at_limit = capacities(model, load)
    b_target = 0.6 * b_full
    b_limit = min(0.95 * b_full, (0.05 - a) / c)
    assert at_target == pytest.approx(efficiency * b_target / (a + c * b_target), rel=0.06)
    assert at_limit == pytest.approx(efficiency * b_limit / (a + c * b_limit), rel=0.06)


def test_saturated_points_teach_nothing():
    load = Load("batch", 1000.0, 100.0, 0.99, 0.6, 0.5, 0.05, 10.0)
    assert learn(Model(), load, TICK, CONFIG.memory_s) == Model()
    waiting = Load("batch", 1000.0, 100.0, 0.5, 0.6, 0.03, 0.05, 10.0, is_saturated=True)
    assert learn(Model(), waiting, TICK, CONFIG.memory_s) == Model()


def _fleet(pod_start_s: float, demand_at, hours: float = 2.0):
    """A decode pool in a tiny closed loop: pods take `pod_start_s` to be ready; tokens/s served per ready
    replica = 0.8 b / (10 ms + 0.2 ms b), b from KV usage (100 sequences fill the cache)."""
    config = AutoscaleConfig(pools={"decode": PoolBounds(1, 500), "prefill": PoolBounds(1, 500)}, itl_p95_s=0.05)
    replicas = {"prefill": 4, "decode": 4}
    starts: dict[str, list[float]] = {"prefill": [], "decode": []}
    ready = dict(replicas)
    history, decisions, now = None, [], 0.0
    while now < hours * 3600:
        demand = demand_at(now)
        snaps = {}
        for pool in replicas:
            ready[pool] += sum(1 for t in starts[pool] if t <= now)
            starts[pool] = [t for t in starts[pool] if t > now]
        per = demand / ready["decode"]
        b = min(_batch_for(per), 100.0)
        snaps["decode"] = PoolSnapshot(
            itl_p95_s=0.010 + 0.0002 * b,
            num_requests=demand / 200 * 60,
            kv_cache_usage=b / 100,
            num_waiting=0.0,
            num_running=b * ready["decode"],
            generation_tokens_per_s=min(demand, ready["decode"] * 0.8 * b / (0.010 + 0.0002 * b)),
            num_pods_scraped=ready["decode"],
            window_s=60.0,
        )
        snaps["prefill"] = PoolSnapshot(
            num_requests=10.0, num_waiting=0.0, num_running=1.0, num_pods_scraped=ready["prefill"], window_s=60.0
        )
        states = {p: PoolState(replicas[p], num_ready=ready[p]) for p in replicas}
        decision = decide(config, snaps, states, history, now)
        history = decision.history
        for pool, target in decision.replicas.items():
            if target > replicas[pool]:
                starts[pool] += [now + pod_start_s] * (target - replicas[pool])
            elif target < replicas[pool]:
                drop = replicas[pool] - target
                pending = len(starts[pool])
                starts[pool] = starts[pool][: max(pending - drop, 0)]
                ready[pool] -= max(drop - pending, 0)
            replicas[pool] = target
        decisions.append((now, decision))
        now += TICK
    return decisions


def _batch_for(tokens_per_replica: float) -> float:
    """Inverse of tokens = 0.8 b / (0.010 + 0.0002 b)."""
    if tokens_per_replica >= 0.8 / 0.0002:
        return math.inf
    return tokens_per_replica * 0.010 / (0.8 - 0.0002 * tokens_per_replica)


def test_the_policy_learns_a_slow_start_and_plans_that_far_ahead():
    decisions = _fleet(400.0, lambda t: 4000.0 * (1 + t / 3600))  # a ramp: +100 % per hour
    learned = [d.history.forecasts["decode"].startup.learned_s for _, d in decisions]
    assert learned[-1] is not None and learned[-1] >= 400.0
    last = decisions[-1][1].pools["decode"]
    assert last.prediction is not None and last.prediction.lookahead_s >= 400.0
    assert "forecast" in decisions[-1][1].reason
    # Planned that far ahead, the pool stays under its KV limit all along the ramp once capacity is learned.
    late = [d.pools["decode"] for t, d in decisions if t > 1800]
    assert all(p.load_ratio is None or p.load_ratio < 0.95 / 0.8 for p in late)
